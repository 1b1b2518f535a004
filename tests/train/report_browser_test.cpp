// The run report in a real browser: headless Chromium (driven by tests/train/report_browser.py)
// opens the page `blutrain report` wrote for real training runs — one run, then two overlaid —
// and the test fails on a missing plot, a plot whose drawn series or point counts differ from the
// runs' metrics.jsonl, a console message of level error or warning, an uncaught exception, a
// browser log error (a CSP violation, a failed load) or any request besides the page itself.
// Skips, saying so, only when no Chromium is installed (scripts/setup.sh installs Debian's).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "blu/data/shard.h"
#include "blu/train/report.h"
#include "data/data_test_util.h"
#include "train/report_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::TempDir;

// $BLU_CHROMIUM, else chromium or chromium-browser on PATH; "" when there is none.
std::string find_chromium() {
  if (const char* env = std::getenv("BLU_CHROMIUM"); env && *env) return env;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    for (const char* name : {"chromium", "chromium-browser"}) {
      const fs::path p = fs::path(dirs.substr(start, end - start)) / name;
      if (!p.empty() && ::access(p.c_str(), X_OK) == 0) return p.string();
    }
    start = end + 1;
  }
  return "";
}

// What the browser saw of `page` (report_browser.py's JSON).
json browse(const std::string& chromium, const fs::path& page, const std::string& screenshot = "") {
  std::vector<std::string> cmd = {"/usr/bin/python3", std::string(BLU_TEST_DIR) + "/train/report_browser.py",
                                  "--browser", chromium, page.string()};
  if (!screenshot.empty()) cmd.insert(cmd.end(), {"--screenshot", screenshot});
  const test::ProcResult r = test::run_process(cmd, /*merge_stderr=*/false);
  if (r.status != 0) {
    ADD_FAILURE() << "report_browser.py failed (" << r.status << "): " << r.output;
    return json();
  }
  return json::parse(r.output);
}

// Everything wrong with what the browser saw, given the runs the page shows (name → folder).
std::vector<std::string> problems(const json& seen, const std::vector<std::pair<std::string, fs::path>>& runs) {
  std::vector<std::string> out;
  if (seen.is_null()) return {"no browser result"};
  for (const auto& url : seen["requests"])
    if (url != seen["page_url"]) out.push_back("network request: " + url.get<std::string>());
  for (const auto& c : seen["console"])
    if (c["type"] == "error" || c["type"] == "warning" || c["type"] == "assert")
      out.push_back("console " + c["type"].get<std::string>() + ": " + c["text"].get<std::string>());
  for (const auto& e : seen["exceptions"]) out.push_back("exception: " + e.get<std::string>());
  for (const auto& l : seen["log"])
    if (l["level"] == "error" || l["level"] == "warning")
      out.push_back("browser log " + l["source"].get<std::string>() + ": " + l["text"].get<std::string>());
  if (seen["status"].is_null()) {
    out.push_back("the page's script did not finish (no data-report-status)");
  } else {
    for (const auto& e : seen["status"]["errors"]) out.push_back("page error: " + e.get<std::string>());
  }
  std::map<std::string, json> plots;
  for (const auto& p : seen["plots"]) plots[p["id"]] = p;
  for (const char* id : {"loss", "lr", "grad_norm", "tok_per_s", "mfu", "memory"}) {
    const auto it = plots.find(id);
    if (it == plots.end()) {
      out.push_back(std::string("missing plot ") + id);
      continue;
    }
    if (!it->second["canvas"].get<bool>()) out.push_back(std::string("plot ") + id + " has no canvas");
    std::map<std::string, size_t> drawn, want;
    for (const auto& s : it->second["series"]) drawn[s["label"]] = s["points"];
    for (const auto& [name, dir] : runs) {
      const auto counts = test::expected_points(dir / "metrics.jsonl");
      const auto c = counts.find(id);
      if (c == counts.end()) continue;
      for (const auto& [part, n] : c->second) {
        const std::string suffix = part.empty() ? "" : part == "bigram_baseline" ? " bigram baseline" : " " + part;
        want[name + suffix] = n;
      }
    }
    if (drawn != want) {
      std::string msg = std::string("plot ") + id + ": drawn {";
      for (const auto& [l, n] : drawn) msg += l + ": " + std::to_string(n) + ", ";
      msg += "}, the JSONL has {";
      for (const auto& [l, n] : want) msg += l + ": " + std::to_string(n) + ", ";
      out.push_back(msg + "}");
    }
  }
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "\n  " + x;
  return s;
}

class ReportBrowser : public ::testing::Test {
 protected:
  // Two real runs of a tiny model (on random token shards), shared by the tests.
  static void SetUpTestSuite() {
    // The runs need the blutrain binary (the sanitizer builds make only the test binaries).
    if (find_chromium().empty() || !fs::exists(test::report_blutrain_path())) return;
    dir_ = new TempDir;
    std::vector<uint16_t> t(20000);
    uint64_t x = 12345;
    for (auto& v : t) v = uint16_t((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 52);  // < 4096
    write_shard(*dir_ / "d_train_000000.bin", t);
    write_shard(*dir_ / "d_val_000000.bin", std::vector<uint16_t>(t.begin(), t.begin() + 4000));
    for (const auto& [name, lr] : {std::pair{"lr-high", "3e-3"}, std::pair{"lr-low", "1e-3"}}) {
      const test::ProcResult r = test::run_blutrain(
          {"train", "--train-pattern", (*dir_ / "d_train_*.bin").string(), "--val-pattern",
           (*dir_ / "d_val_*.bin").string(), "--model", "tiny", "--n-embd", "32", "-B", "4", "-T", "32",
           "--steps", "24", "--lr", lr, "--warmup", "4", "--val-every", "6", "--val-batches", "2",
           "--sample-every", "8", "--sample-tokens", "12", "--log-every", "2", "--out", (*dir_ / name).string()});
      train_output_ += r.output;
      if (r.status != 0) train_failed_ = true;
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    chromium_ = find_chromium();
    if (chromium_.empty())
      GTEST_SKIP() << "chromium not found (set BLU_CHROMIUM or install Debian's chromium; scripts/setup.sh does): "
                      "the report's browser test did not run";
    if (!fs::exists(test::report_blutrain_path()))
      GTEST_SKIP() << "blutrain not built at " << test::report_blutrain_path() << ": the report's browser test did not run";
    ASSERT_TRUE(fs::exists(train::default_uplot_dir() / "dist" / "uPlot.iife.min.js"))
        << "uPlot is missing: run scripts/fetch_uplot.sh";
    ASSERT_FALSE(train_failed_) << train_output_;
  }
  static fs::path run_dir(const char* name) { return *dir_ / name; }

  std::string chromium_;
  static inline TempDir* dir_ = nullptr;
  static inline std::string train_output_;
  static inline bool train_failed_ = false;
};

TEST_F(ReportBrowser, OneRunRendersEveryPlot) {
  const fs::path page = run_dir("one.html");
  const test::ProcResult r = test::run_blutrain({"report", run_dir("lr-high").string(), "-o", page.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  const json seen = browse(chromium_, page);
  const auto p = problems(seen, {{"lr-high", run_dir("lr-high")}});
  EXPECT_TRUE(p.empty()) << joined(p);
  // The real run logged train loss at every other step and validated every 6: sanity of the counts.
  const auto counts = test::expected_points(run_dir("lr-high") / "metrics.jsonl");
  EXPECT_EQ(counts.at("loss").at("train"), 13u);  // step 1, then 2, 4, ..., 24
  EXPECT_EQ(counts.at("loss").at("val"), 4u);
}

TEST_F(ReportBrowser, TwoRunsOverlaid) {
  const fs::path page = run_dir("two.html");
  const char* shot = std::getenv("BLU_REPORT_SCREENSHOT");  // where to keep a screenshot, if anywhere
  const test::ProcResult r = test::run_blutrain(
      {"report", run_dir("lr-high").string(), run_dir("lr-low").string(), "-o", page.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  const json seen = browse(chromium_, page, shot ? shot : "");
  const auto p = problems(seen, {{"lr-high", run_dir("lr-high")}, {"lr-low", run_dir("lr-low")}});
  EXPECT_TRUE(p.empty()) << joined(p);
  std::set<std::string> labels;
  for (const auto& pl : seen["plots"])
    for (const auto& s : pl["series"]) labels.insert(s["label"]);
  for (const char* l : {"lr-high train", "lr-low train", "lr-high val", "lr-low val", "lr-high", "lr-low"})
    EXPECT_TRUE(labels.count(l)) << l;
}

// The checks can fail: a page that loads from the network, logs an error, loses a plot or draws
// other data than the JSONL's is caught.
TEST_F(ReportBrowser, CatchesRequestsErrorsAndMismatches) {
  const fs::path page = run_dir("bad.html");
  ASSERT_EQ(test::run_blutrain({"report", run_dir("lr-high").string(), "-o", page.string()}).status, 0);
  std::string html = test::read_bytes(page);
  const std::string tail = "</body>";
  html.insert(html.rfind(tail),
              "<img src=\"http://192.0.2.1/x.png\"><script>console.error('injected');"
              "document.querySelector('[data-plot=mfu]').remove();</script>");
  test::write_bytes(page, html);
  const json seen = browse(chromium_, page);
  const std::string p = joined(problems(seen, {{"lr-high", run_dir("lr-high")}}));
  for (const char* want : {"network request: http://192.0.2.1/x.png", "console error: injected", "missing plot mfu",
                           "browser log"})
    EXPECT_NE(p.find(want), std::string::npos) << want << " not in:" << p;

  // A page drawn from other data than the JSONL it is checked against: the run without its first
  // step event.
  std::string kept;
  bool dropped = false;
  std::ifstream in(run_dir("lr-high") / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (!dropped && json::parse(line)["event"] == "step") {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  const fs::path edited = run_dir("edited");
  fs::create_directories(edited);
  test::write_bytes(edited / "metrics.jsonl", kept);
  ASSERT_EQ(test::run_blutrain({"report", edited.string(), "-o", page.string()}).status, 0);
  const std::string q = joined(problems(browse(chromium_, page), {{"edited", run_dir("lr-high")}}));
  EXPECT_NE(q.find("plot loss: drawn {"), std::string::npos) << q;
  EXPECT_NE(q.find("edited train: 12,"), std::string::npos) << q;
  EXPECT_NE(q.find("the JSONL has {"), std::string::npos) << q;
}

}  // namespace
}  // namespace blu
