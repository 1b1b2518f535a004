#include "blu/train/report.h"

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "blu/core/error.h"
#include "blu/train/report_page.h"

namespace blu::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string read_text(const fs::path& path, const char* hint) {
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in.good(), "cannot open ", path.string(), hint);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One colour per run, in order; runs past the tenth reuse them.
constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                    "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

struct SeriesSpec {
  const char* event;  // the event type that carries the value
  const char* key;
  const char* suffix;  // the label is "<run><suffix>"
  const char* part;    // the series within its plot: "" when it is the plot's only one
  double scale;
  const char* dash;  // "" solid, "dash", "dot"
};

struct PlotSpec {
  const char* id;
  const char* title;
  const char* unit;
  std::vector<SeriesSpec> series;
};

const std::vector<PlotSpec>& plot_specs() {
  static const std::vector<PlotSpec> specs = {
      {"loss", "Loss", "nats/token",
       {{"step", "loss", " train", "train", 1, ""}, {"eval", "val_loss", " val", "val", 1, "dash"},
        {"eval", "bigram_loss", " bigram baseline", "bigram_baseline", 1, "dot"}}},
      {"lr", "Learning rate", "lr", {{"step", "lr", "", "", 1, ""}}},
      {"grad_norm", "Gradient norm (before clipping)", "L2 norm", {{"step", "norm", "", "", 1, ""}}},
      {"tok_per_s", "Throughput", "tokens/s", {{"step", "tok_per_s", "", "", 1, ""}}},
      {"mfu", "Model FLOPs utilisation", "% of peak", {{"step", "mfu", "", "", 100, ""}}},
      {"memory", "Peak memory per step", "MiB", {{"step", "mem_bytes", "", "", 1.0 / (1024 * 1024), ""}}},
  };
  return specs;
}

}  // namespace

RunData read_run(const fs::path& dir) {
  BLU_CHECK(fs::is_directory(dir), "expected a run folder (the --out of `blutrain train`), got '", dir.string(),
            "': ", fs::exists(dir) ? "not a folder" : "no such folder");
  RunData run;
  run.dir = dir;
  run.name = fs::weakly_canonical(fs::absolute(dir)).filename().string();
  const fs::path metrics = dir / "metrics.jsonl";
  BLU_CHECK(fs::is_regular_file(metrics), "the folder ", dir.string(),
            " has no metrics.jsonl: expected a run folder written by `blutrain train --out`");
  const std::string text = read_text(metrics, "");
  int64_t line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    const bool terminated = nl != std::string::npos;
    const std::string line = text.substr(pos, terminated ? nl - pos : std::string::npos);
    pos = terminated ? nl + 1 : text.size();
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() && !terminated) {
      run.warnings.push_back(metrics.string() + ":" + std::to_string(line_no) +
                             ": skipped an unfinished last line (the run may still be writing it)");
      break;
    }
    if (j.is_discarded()) {
      std::string why;
      try {
        (void)json::parse(line);
      } catch (const json::parse_error& e) {
        why = e.what();
      }
      BLU_CHECK(false, metrics.string(), ":", line_no, ": not valid JSON (", why, ")");
    }
    BLU_CHECK(j.is_object() && j.contains("event") && j["event"].is_string(), metrics.string(), ":", line_no,
              ": expected a JSON object with a string \"event\", got ", j.dump().substr(0, 80));
    run.events.push_back(std::move(j));
  }
  const fs::path run_json = dir / "run.json";
  if (fs::is_regular_file(run_json)) {
    json cfg = json::parse(read_text(run_json, ""), nullptr, /*allow_exceptions=*/false);
    if (cfg.is_discarded())
      run.warnings.push_back(run_json.string() + ": not valid JSON; the report shows no config for this run");
    else
      run.config = std::move(cfg);
  } else {
    run.warnings.push_back(dir.string() + " has no run.json; the report shows no config for this run");
  }
  return run;
}

std::vector<RunData> read_runs(const std::vector<fs::path>& dirs) {
  std::vector<RunData> runs;
  for (const auto& d : dirs) runs.push_back(read_run(d));
  std::map<std::string, int> count;
  for (const auto& r : runs) ++count[r.name];
  for (auto& r : runs)
    if (count[r.name] > 1) r.name = r.dir.string();
  std::map<std::string, int> seen;  // the same folder given twice
  for (auto& r : runs)
    if (int n = seen[r.name]++; n > 0) r.name += " #" + std::to_string(n + 1);
  return runs;
}

json report_plots(const std::vector<RunData>& runs) {
  json plots = json::array();
  for (const PlotSpec& p : plot_specs()) {
    json series = json::array();
    for (size_t r = 0; r < runs.size(); ++r) {
      for (const SeriesSpec& s : p.series) {
        std::map<int64_t, double> points;  // step → value; a repeated step keeps its last value
        for (const json& e : runs[r].events) {
          if (e["event"] != s.event || !e.contains("step") || !e["step"].is_number_integer()) continue;
          const auto it = e.find(s.key);
          if (it == e.end() || !it->is_number()) continue;
          const double v = it->get<double>() * s.scale;
          if (std::isfinite(v)) points[e["step"].get<int64_t>()] = v;
        }
        if (points.empty()) continue;
        json x = json::array(), y = json::array();
        for (const auto& [step, v] : points) x.push_back(step), y.push_back(v);
        series.push_back({{"run", runs[r].name},
                          {"label", runs[r].name + s.suffix},
                          {"part", s.part},
                          {"color", kPalette[r % std::size(kPalette)]},
                          {"dash", s.dash},
                          {"x", std::move(x)},
                          {"y", std::move(y)}});
      }
    }
    plots.push_back({{"id", p.id}, {"title", p.title}, {"unit", p.unit}, {"series", std::move(series)}});
  }
  return plots;
}

fs::path default_uplot_dir() {
  if (const char* env = std::getenv("BLU_UPLOT_DIR"); env && *env) return env;
  return fs::path(BLU_SOURCE_DIR) / ".deps" / "uplot" / "node_modules" / "uplot";
}

ReportAssets load_report_assets(const fs::path& dir) {
  constexpr const char* hint = " (run scripts/fetch_uplot.sh to fetch uPlot, or set BLU_UPLOT_DIR)";
  ReportAssets a;
  a.uplot_js = read_text(dir / "dist" / "uPlot.iife.min.js", hint);
  a.uplot_css = read_text(dir / "dist" / "uPlot.min.css", hint);
  a.uplot_license = read_text(dir / "LICENSE", hint);
  return a;
}

std::string render_report(const std::vector<RunData>& runs, const ReportAssets& assets) {
  BLU_CHECK(!runs.empty(), "a report needs at least one run folder");
  json data;
  data["plots"] = report_plots(runs);
  json jr = json::array();
  for (size_t r = 0; r < runs.size(); ++r) {
    json samples = json::array(), summary;
    for (const json& e : runs[r].events) {
      if (e["event"] == "sample") samples.push_back({{"step", e.value("step", int64_t(-1))}, {"text", e.value("text", "")}});
      if (e["event"] == "summary") summary = e;
    }
    jr.push_back({{"name", runs[r].name},
                  {"dir", runs[r].dir.string()},
                  {"color", kPalette[r % std::size(kPalette)]},
                  {"config", runs[r].config},
                  {"summary", summary},
                  {"samples", std::move(samples)},
                  {"events", runs[r].events.size()}});
  }
  data["runs"] = std::move(jr);
  std::string title = "BluTrain report:";
  for (const auto& r : runs) title += " " + r.name;
  data["title"] = title;
  return report_page_html(data, assets);
}

}  // namespace blu::train
