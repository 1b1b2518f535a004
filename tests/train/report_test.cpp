// The run report without a browser: reading run folders (and refusing bad ones by file and line),
// the plotted series against the JSONL, the page's safety (no network loads, run text only as
// escaped JSON), `blutrain report`'s atomic overwrite, and the TensorBoard event files checked by
// an independent reader (tests/train/tb_read_events.py).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "blu/core/error.h"
#include "blu/train/metrics.h"
#include "blu/train/report.h"
#include "blu/train/tb_events.h"
#include "data/data_test_util.h"
#include "train/report_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::TempDir;

// Expects `f` to throw blu::Error whose message holds every one of `parts`.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

const json& plot(const json& plots, const std::string& id) {
  for (const auto& p : plots)
    if (p["id"] == id) return p;
  ADD_FAILURE() << "no plot " << id;
  static const json none;
  return none;
}

TEST(Report, ReadsEventsAndConfig) {
  TempDir dir;
  test::write_fake_run(dir / "alpha", 10, 0.01);
  const train::RunData r = train::read_run(dir / "alpha");
  EXPECT_EQ(r.name, "alpha");
  EXPECT_EQ(r.events.size(), 10u + 2 + 2 + 1);  // steps, evals, samples, summary
  EXPECT_EQ(r.config["options"]["steps"], 10);
  EXPECT_TRUE(r.warnings.empty());
}

TEST(Report, RefusesAFolderWithoutMetrics) {
  TempDir dir;
  fs::create_directories(dir / "empty");
  expect_error([&] { train::read_run(dir / "empty"); }, {(dir / "empty").string(), "no metrics.jsonl"});
  expect_error([&] { train::read_run(dir / "missing"); }, {"missing", "no such folder"});
}

TEST(Report, NamesTheFileAndLineOfAMalformedLine) {
  TempDir dir;
  test::write_fake_run(dir / "r", 3, 0.01);
  std::string text = test::read_bytes(dir / "r" / "metrics.jsonl");
  const size_t second = text.find('\n') + 1;
  test::write_bytes(dir / "r" / "metrics.jsonl", text.substr(0, second) + "{\"event\": \"step\", \"step\": 2,\n" +
                                                     text.substr(second));
  expect_error([&] { train::read_run(dir / "r"); }, {"metrics.jsonl:2:", "not valid JSON"});
  test::write_bytes(dir / "r" / "metrics.jsonl", text.substr(0, second) + "[1, 2]\n" + text.substr(second));
  expect_error([&] { train::read_run(dir / "r"); }, {"metrics.jsonl:2:", "\"event\""});
}

TEST(Report, SkipsAnUnfinishedLastLineWithAWarning) {
  TempDir dir;
  test::write_fake_run(dir / "r", 3, 0.01);
  const fs::path m = dir / "r" / "metrics.jsonl";
  const size_t complete = train::read_run(dir / "r").events.size();
  test::write_bytes(m, test::read_bytes(m) + "{\"event\": \"st");
  const train::RunData r = train::read_run(dir / "r");
  EXPECT_EQ(r.events.size(), complete);
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("metrics.jsonl:" + std::to_string(complete + 1)), std::string::npos) << r.warnings[0];
}

TEST(Report, PlotsMatchTheJsonl) {
  TempDir dir;
  test::write_fake_run(dir / "a", 12, 0.02, /*with_mfu=*/true);
  test::write_fake_run(dir / "b", 7, 0.01);
  const json plots = train::report_plots(train::read_runs({dir / "a", dir / "b"}));
  std::vector<std::string> ids;
  for (const auto& p : plots) ids.push_back(p["id"]);
  EXPECT_EQ(ids, (std::vector<std::string>{"loss", "lr", "grad_norm", "tok_per_s", "mfu", "memory"}));
  for (const char* run : {"a", "b"}) {
    const auto want = test::expected_points(dir / run / "metrics.jsonl");
    for (const auto& p : plots) {
      std::map<std::string, size_t> got;
      for (const auto& s : p["series"])
        if (s["run"] == run) got[s["part"]] = s["x"].size();
      const auto it = want.find(p["id"]);
      const std::map<std::string, size_t> expected = it == want.end() ? std::map<std::string, size_t>{} : it->second;
      EXPECT_EQ(got, expected) << run << " " << p["id"];
    }
  }
  // Values and units: memory in MiB, MFU in percent, one colour per run across series.
  const json& mem = plot(plots, "memory")["series"][0];
  EXPECT_EQ(mem["x"][2], 3);
  EXPECT_DOUBLE_EQ(mem["y"][2].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(plot(plots, "mfu")["series"][0]["y"][4].get<double>(), 5.0);
  EXPECT_EQ(plot(plots, "mfu")["series"].size(), 1u);  // run b recorded none
  const json& loss = plot(plots, "loss")["series"];
  ASSERT_EQ(loss.size(), 6u);
  EXPECT_EQ(loss[0]["color"], loss[1]["color"]);
  EXPECT_NE(loss[0]["color"], loss[3]["color"]);
  EXPECT_EQ(loss[1]["label"], "a val");
}

TEST(Report, SkipsNonNumbersAndKeepsARepeatedStepsLastValue) {
  TempDir dir;
  fs::create_directories(dir / "r");
  test::write_bytes(dir / "r" / "metrics.jsonl",
                    "{\"event\":\"step\",\"step\":1,\"loss\":3.0}\n"
                    "{\"event\":\"step\",\"step\":2,\"loss\":null}\n"      // NaN, as nlohmann writes it
                    "{\"event\":\"step\",\"step\":3,\"loss\":2.0}\n"
                    "{\"event\":\"step\",\"step\":3,\"loss\":1.5}\n"
                    "{\"event\":\"checkpoint\",\"step\":3,\"path\":\"x\"}\n");
  const train::RunData r = train::read_run(dir / "r");
  EXPECT_EQ(r.warnings.size(), 1u);  // no run.json
  const json s = plot(train::report_plots({r}), "loss")["series"][0];
  EXPECT_EQ(s["x"], json::array({1, 3}));
  EXPECT_EQ(s["y"], json::array({3.0, 1.5}));
}

// A sample cut inside a multi-byte character reaches metrics.jsonl (as U+FFFD) and the report,
// instead of failing the run.
TEST(Report, MetricsLogWritesInvalidUtf8Samples) {
  TempDir dir;
  fs::create_directories(dir / "r");
  {
    train::MetricsLog log((dir / "r" / "metrics.jsonl").string());
    log.write({{"event", "sample"}, {"step", 1}, {"text", std::string("caf\xc3")}});
    log.write({{"event", "step"}, {"step", 1}, {"loss", 2.0}});
  }
  const train::RunData r = train::read_run(dir / "r");
  ASSERT_EQ(r.events.size(), 2u);
  EXPECT_EQ(r.events[0]["text"], "caf\xef\xbf\xbd");
}

TEST(Report, SameFolderNamesAreLabelledByPath) {
  TempDir dir;
  test::write_fake_run(dir / "x" / "run", 2, 0.01);
  test::write_fake_run(dir / "y" / "run", 2, 0.01);
  const auto runs = train::read_runs({dir / "x" / "run", dir / "y" / "run", dir / "x" / "run"});
  EXPECT_EQ(runs[0].name, (dir / "x" / "run").string());
  EXPECT_EQ(runs[1].name, (dir / "y" / "run").string());
  EXPECT_EQ(runs[2].name, (dir / "x" / "run").string() + " #2");
}

TEST(Report, PageIsSelfContainedAndEscapesRunText) {
  TempDir dir;
  test::write_fake_run(dir / "r<b>", 5, 0.01);
  {
    std::ofstream m(dir / "r<b>" / "metrics.jsonl", std::ios::app);
    m << json({{"event", "sample"}, {"step", 6}, {"text", "</script><script>alert(1)</script> <!-- x"}}).dump() << "\n";
  }
  train::ReportAssets assets;
  assets.uplot_js = "var uPlot = function () {};";
  assets.uplot_css = ".u-wrap {}";
  assets.uplot_license = "MIT -- licence";
  const std::string html = train::render_report(train::read_runs({dir / "r<b>"}), assets);
  EXPECT_NE(html.find("Content-Security-Policy\" content=\"default-src 'none'"), std::string::npos);
  EXPECT_EQ(html.find("alert(1)</script>"), std::string::npos);  // only as \u003c/script>
  EXPECT_NE(html.find("\\u003c/script>\\u003cscript>alert(1)"), std::string::npos);
  EXPECT_NE(html.find("<title>BluTrain report: r&lt;b&gt;</title>"), std::string::npos);
  EXPECT_NE(html.find("MIT - - licence"), std::string::npos);
  for (const char* load : {" src=", " href=", "@import", "url("}) EXPECT_EQ(html.find(load), std::string::npos) << load;
  assets.uplot_js = "x = '</SCRIPT>';";
  expect_error([&] { train::render_report(train::read_runs({dir / "r<b>"}), assets); }, {"</script"});
}

TEST(Report, MissingUplotSaysHowToFetchIt) {
  TempDir dir;
  expect_error([&] { train::load_report_assets(dir.path()); }, {"uPlot.iife.min.js", "scripts/fetch_uplot.sh"});
}

// CRC-32C check values (RFC 3720 B.4 and the standard "123456789").
TEST(TensorBoard, Crc32cKnownValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(train::crc32c(digits.data(), digits.size()), 0xE3069283u);
  std::string zeros(32, '\0'), ones(32, '\xff'), inc(32, 0);
  for (int i = 0; i < 32; ++i) inc[i] = char(i);
  EXPECT_EQ(train::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(train::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(train::crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(train::crc32c(digits.data() + 4, 5, train::crc32c(digits.data(), 4)), 0xE3069283u);
}

TEST(TensorBoard, EventFileReadsBackAsTheRunsSeries) {
  TempDir dir;
  test::write_fake_run(dir / "run a", 9, 0.02, /*with_mfu=*/true);
  const auto runs = train::read_runs({dir / "run a"});
  const auto files = train::write_tensorboard(runs, dir / "tb");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], dir / "tb" / "run a" / "events.out.tfevents.blutrain");
  const test::ProcResult r =
      test::run_process({"/usr/bin/python3", std::string(BLU_TEST_DIR) + "/train/tb_read_events.py", files[0].string()},
                        /*merge_stderr=*/false);
  ASSERT_EQ(r.status, 0) << r.output;
  const json got = json::parse(r.output);
  EXPECT_EQ(got["file_version"], "brain.Event:2");
  // Every step and eval of the JSONL, tag by tag, as float32.
  std::map<std::string, std::map<int64_t, double>> want;
  std::ifstream in(dir / "run a" / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const json e = json::parse(line);
    const int64_t step = e["step"];
    if (e["event"] == "step") {
      want["loss/train"][step] = e["loss"];
      want["lr"][step] = e["lr"];
      want["grad_norm"][step] = e["norm"];
      want["tok_per_s"][step] = e["tok_per_s"];
      want["mfu"][step] = e["mfu"].get<double>() * 100;
      want["memory"][step] = e["mem_bytes"].get<double>() / (1 << 20);
    } else if (e["event"] == "eval") {
      want["loss/val"][step] = e["val_loss"];
      want["loss/bigram_baseline"][step] = e["bigram_loss"];
    }
  }
  std::map<std::string, std::map<int64_t, double>> seen;
  double last_wall = 0;
  int64_t last_step = 0;
  for (const auto& ev : got["events"]) {
    EXPECT_GT(ev["step"].get<int64_t>(), last_step);
    EXPECT_GE(ev["wall_time"].get<double>(), last_wall);
    last_step = ev["step"];
    last_wall = ev["wall_time"];
    for (const auto& [tag, v] : ev["scalars"].items()) seen[tag][ev["step"].get<int64_t>()] = v;
  }
  ASSERT_EQ(seen.size(), want.size());
  for (const auto& [tag, points] : want) {
    ASSERT_EQ(seen[tag].size(), points.size()) << tag;
    for (const auto& [step, v] : points) EXPECT_EQ(seen[tag][step], double(float(v))) << tag << " step " << step;
  }
  // Wall time: the step times add up (ms 11..19 at steps 1..9).
  const auto& evs = got["events"];
  EXPECT_NEAR(evs[8]["wall_time"].get<double>() - evs[0]["wall_time"].get<double>(), (12 + 19) * 8 / 2 / 1e3, 1e-6);
}

TEST(ReportCli, WritesThePageAndReplacesAnOldOneAtomically) {
  if (!fs::exists(test::report_blutrain_path())) GTEST_SKIP() << "blutrain not built at " << test::report_blutrain_path();
  if (!fs::exists(train::default_uplot_dir() / "dist" / "uPlot.iife.min.js"))
    GTEST_SKIP() << "uPlot not fetched (scripts/fetch_uplot.sh)";
  TempDir dir;
  test::write_fake_run(dir / "a", 6, 0.01);
  const fs::path out = dir / "report.html";
  test::write_bytes(out, "old page");
  test::ProcResult r = test::run_blutrain({"report", (dir / "a").string(), "-o", out.string(), "--tensorboard",
                                           (dir / "tb").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("wrote " + out.string()), std::string::npos) << r.output;
  const std::string page = test::read_bytes(out);
  EXPECT_EQ(page.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(page.find("uPlot"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir / "tb" / "a" / "events.out.tfevents.blutrain"));
  EXPECT_EQ(test::list_dir(dir.path()), (std::vector<std::string>{"a", "report.html", "tb"}));

  // A failing report leaves the old page as it was, and names what was wrong.
  const std::string before = test::read_bytes(out);
  fs::create_directories(dir / "empty");
  r = test::run_blutrain({"report", (dir / "a").string(), (dir / "empty").string(), "-o", out.string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("no metrics.jsonl"), std::string::npos) << r.output;
  EXPECT_EQ(test::read_bytes(out), before);
  test::write_bytes(dir / "a" / "metrics.jsonl", test::read_bytes(dir / "a" / "metrics.jsonl") + "oops\n{}\n");
  r = test::run_blutrain({"report", (dir / "a").string(), "-o", out.string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find((dir / "a" / "metrics.jsonl").string() + ":10:"), std::string::npos) << r.output;
  EXPECT_EQ(test::read_bytes(out), before);
  r = test::run_blutrain({"report", (dir / "a").string(), "-o", (dir / "no" / "such.html").string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
  r = test::run_blutrain({"report", (dir / "a").string(), "-o", dir.path().string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("folder"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "report.html.tmp"));
}

}  // namespace
}  // namespace blu
