#include "blu/train/report_page.h"

#include <algorithm>
#include <cctype>

#include "blu/core/error.h"

namespace blu::train {

namespace {

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// JSON that is safe inside <script type="application/json">: '<' only occurs inside JSON strings,
// where \u003c means the same character, so no "</script>" or "<!--" can end the element early.
std::string json_for_script(const nlohmann::json& j) {
  const std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

bool contains_ci(const std::string& hay, const std::string& needle) {
  const auto it = std::search(hay.begin(), hay.end(), needle.begin(), needle.end(),
                              [](char a, char b) { return std::tolower(uint8_t(a)) == std::tolower(uint8_t(b)); });
  return it != hay.end();
}

// Text inside <!-- -->: no "--" (which would end or break the comment).
std::string comment_safe(std::string s) {
  for (size_t p; (p = s.find("--")) != std::string::npos;) s.replace(p, 2, "- -");
  return s;
}

constexpr const char* kHead = R"PAGE(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
)PAGE";

constexpr const char* kStyle = R"PAGE(
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 8px; }
h2 { font-size: 16px; margin: 24px 0 8px; border-bottom: 1px solid #ddd; }
ul.runs { list-style: none; padding: 0; margin: 0; }
ul.runs li { margin: 2px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px; vertical-align: -1px; }
.dir { color: #777; font-size: 12px; }
#plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
section.plot { border: 1px solid #e3e3e3; border-radius: 4px; padding: 4px; min-height: 120px; }
p.empty { color: #999; margin: 4px 8px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #e3e3e3; padding: 3px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.diff td { background: #fff7d6; }
details { margin-top: 8px; }
pre.sample { margin: 0; max-width: 70ch; max-height: 16em; overflow: auto; white-space: pre-wrap; font-size: 12px; }
#errors { color: #b00; }
)PAGE";

constexpr const char* kBody = R"PAGE(</head>
<body>
<h1 id="title"></h1>
<ul class="runs" id="runs"></ul>
<div id="errors"></div>
<h2>Summary</h2>
<table id="summary"></table>
<h2>Metrics</h2>
<div id="plots"></div>
<h2>Samples</h2>
<table id="samples"></table>
<h2>Config</h2>
<div id="config"></div>
)PAGE";

// Draws the page from the JSON blob. Each plot's section gets data-plot (its id) and data-series
// (the drawn series: label and number of points, counted from the data uPlot holds); the body gets
// data-report-status: {"plots": [{"id", "series", "canvas"}], "errors": [...]}.
constexpr const char* kScript = R"PAGE(
(function () {
  "use strict";
  const status = { plots: [], errors: [] };
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function num(v, digits) {
    return typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "\u2014";
  }
  // An axis label with the digits its value needs: 0.0025 (not uPlot's 0.002 beside 0.002), 3.0e-5.
  function tick(v) {
    if (v === null || v === undefined) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-4 || a >= 1e6)) return v.toExponential(1);
    return v.toLocaleString("en-US", { maximumSignificantDigits: 4 });
  }
  function flatten(v, prefix, out) {
    if (v !== null && typeof v === "object" && !(Array.isArray(v) && v.every(x => x === null || typeof x !== "object"))) {
      for (const k of Object.keys(v)) flatten(v[k], prefix ? prefix + "." + k : k, out);
    } else {
      out[prefix || "(value)"] = JSON.stringify(v);
    }
    return out;
  }
  try {
    const data = JSON.parse(document.getElementById("blu-data").textContent);
    document.title = data.title;
    document.getElementById("title").textContent = data.title;

    const runs = document.getElementById("runs");
    for (const r of data.runs) {
      const li = el("li");
      const sw = el("span", { class: "swatch" });
      sw.style.background = r.color;
      li.append(sw, el("b", {}, r.name), el("span", { class: "dir" }, "  " + r.dir + " \u00b7 " + r.events + " events"));
      runs.append(li);
    }

    const lossPlot = data.plots.find(p => p.id === "loss");
    const bestVal = name => {
      const s = lossPlot && lossPlot.series.find(s => s.label === name + " val");
      return s ? Math.min.apply(null, s.y) : undefined;
    };
    const summary = document.getElementById("summary");
    const head = el("tr");
    for (const h of ["run", "steps", "train loss", "val loss", "best val loss", "tokens", "seconds", "tok/s", "peak memory"])
      head.append(el("th", {}, h));
    summary.append(head);
    for (const r of data.runs) {
      const s = r.summary || {};
      const tr = el("tr");
      const cells = [s.step, num(s.train_loss, 4), s.val_loss >= 0 ? num(s.val_loss, 4) : "\u2014",
                     num(bestVal(r.name), 4), s.tokens, num(s.seconds, 1), num(s.tok_per_s, 0),
                     typeof s.peak_mem_bytes === "number" ? (s.peak_mem_bytes / 1048576).toFixed(0) + " MiB" : "\u2014"];
      tr.append(el("td", {}, r.name));
      for (const c of cells) tr.append(el("td", { class: "num" }, c === undefined ? "\u2014" : String(c)));
      summary.append(tr);
    }
    if (data.runs.every(r => !r.summary)) summary.append(el("tr", {}, "no run has finished (no summary event yet)"));

    const grid = document.getElementById("plots");
    const dashes = { "": undefined, dash: [6, 4], dot: [2, 3] };
    for (const p of data.plots) {
      const box = el("section", { class: "plot", "data-plot": p.id });
      grid.append(box);
      const xs = Array.from(new Set(p.series.flatMap(s => s.x))).sort((a, b) => a - b);
      const at = new Map(xs.map((x, i) => [x, i]));
      const cols = [xs];
      for (const s of p.series) {
        const col = new Array(xs.length).fill(null);
        s.x.forEach((x, k) => { col[at.get(x)] = s.y[k]; });
        cols.push(col);
      }
      const width = Math.max(400, box.clientWidth - 10);
      const u = new uPlot({
        title: p.title, width: width, height: 280,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, { label: p.unit, size: 70, values: (u, ticks) => ticks.map(tick) }],
        series: [{ label: "step" }].concat(p.series.map(s => ({
          label: s.label, stroke: s.color, width: 1.5, dash: dashes[s.dash], spanGaps: true,
        }))),
      }, cols, box);
      if (!p.series.length) box.append(el("p", { class: "empty" }, "No run recorded this."));
      const drawn = u.series.slice(1).map((s, i) => ({
        label: s.label, points: u.data[i + 1].filter(v => v !== null && v !== undefined).length,
      }));
      box.setAttribute("data-series", JSON.stringify(drawn));
      status.plots.push({ id: p.id, series: drawn, canvas: box.querySelector("canvas") !== null });
    }

    const samples = document.getElementById("samples");
    const steps = Array.from(new Set(data.runs.flatMap(r => r.samples.map(s => s.step)))).sort((a, b) => a - b);
    const sh = el("tr");
    sh.append(el("th", {}, "step"));
    for (const r of data.runs) sh.append(el("th", {}, r.name));
    samples.append(sh);
    for (const step of steps) {
      const tr = el("tr");
      tr.append(el("td", { class: "num" }, String(step)));
      for (const r of data.runs) {
        const td = el("td");
        const s = r.samples.filter(x => x.step === step).pop();
        if (s) td.append(el("pre", { class: "sample" }, s.text));
        tr.append(td);
      }
      samples.append(tr);
    }
    if (!steps.length) samples.append(el("tr", {}, "no samples recorded"));

    // With several runs: the keys where they differ, then every key folded away.
    const flat = data.runs.map(r => flatten(r.config, "", {}));
    const keys = Array.from(new Set(flat.flatMap(f => Object.keys(f)))).sort();
    const values = k => flat.map(f => (k in f ? f[k] : "\u2014"));
    const differing = keys.filter(k => new Set(values(k)).size > 1);
    function configTable(table, ks) {
      const ch = el("tr");
      ch.append(el("th", {}, "key"));
      for (const r of data.runs) ch.append(el("th", {}, r.name));
      table.append(ch);
      for (const k of ks) {
        const vals = values(k);
        const tr = el("tr", new Set(vals).size > 1 ? { class: "diff" } : {});
        tr.append(el("td", {}, k));
        for (const v of vals) tr.append(el("td", {}, v));
        table.append(tr);
      }
    }
    const config = document.getElementById("config");
    if (data.runs.length > 1) {
      config.append(el("p", {}, differing.length ? "Where the runs differ:" : "The runs' configs are the same."));
      if (differing.length) {
        const t = el("table");
        configTable(t, differing);
        config.append(t);
      }
      const all = el("details");
      all.append(el("summary", {}, "All " + keys.length + " keys"));
      const t = el("table");
      configTable(t, keys);
      all.append(t);
      config.append(all);
    } else {
      const t = el("table");
      configTable(t, keys);
      config.append(t);
    }
  } catch (e) {
    const msg = "report: " + (e && e.stack ? e.stack : e);
    status.errors.push(msg);
    document.getElementById("errors").textContent = msg;
    console.error(msg);
  }
  document.body.setAttribute("data-report-status", JSON.stringify(status));
})();
)PAGE";

}  // namespace

std::string report_page_html(const nlohmann::json& data, const ReportAssets& assets) {
  BLU_CHECK(!contains_ci(assets.uplot_js, "</script"), "uPlot's JS contains '</script' and cannot be inlined");
  BLU_CHECK(!contains_ci(assets.uplot_css, "</style"), "uPlot's CSS contains '</style' and cannot be inlined");
  std::string html = kHead;
  html += "<title>" + html_escape(data.value("title", "BluTrain report")) + "</title>\n";
  html += "<!-- Plots drawn with uPlot (https://github.com/leeoniya/uPlot), inlined under its licence:\n";
  html += comment_safe(assets.uplot_license) + "\n-->\n";
  html += "<style>\n" + assets.uplot_css + "\n</style>\n<style>" + kStyle + "</style>\n";
  html += kBody;
  html += "<script type=\"application/json\" id=\"blu-data\">" + json_for_script(data) + "</script>\n";
  html += "<script>\n" + assets.uplot_js + "\n</script>\n";
  html += std::string("<script>") + kScript + "</script>\n</body>\n</html>\n";
  return html;
}

}  // namespace blu::train
