// `blutrain bench --parallel` on two CPU ranks (Gloo): every layout the trainer runs takes steps on
// random tokens beside the planner's prediction. Replica 0 draws the batches a single process
// draws, so tensor parallelism and a pipeline whose micro-batches repeat the batch train the same
// losses as `bench` on one process (fp32; TP sums partial products in another order: 1e-5
// relative). weights=probe splits the rows by the ranks' measured speeds, and auto takes the
// planner's fastest layout.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "blu/data/shard.h"
#include "blu/models/registry.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;

// The JSON line a bench prints (under launch, rank 0's line behind its prefixes).
nlohmann::json bench_line(const LaunchResult& r) {
  const size_t at = r.out.find("{\"");
  if (at == std::string::npos) return {};
  return nlohmann::json::parse(r.out.substr(at, r.out.find('\n', at) - at));
}

class BenchParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    // The tiny Llama with a vocabulary of 128 (tensor parallelism splits the vocabulary evenly;
    // the preset's 101 does not divide by 2): bench builds it from the folder's config.json.
    nlohmann::json c = models::resolve_model_config("llama:tiny");
    c["vocab_size"] = 128;
    models::family("llama").export_hf(*models::build_model(c, 1), (dir.path / "llama128").string());
  }
  LaunchResult bench(int ranks, std::vector<std::string> extra) {
    std::vector<std::string> cmd = {blutrain().string(), "bench", "--device", "cpu", "--precision", "fp32", "--model",
                                    (dir.path / "llama128").string(), "-B", "2", "-T", "16", "--steps", "4", "--lr",
                                    "1e-3"};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    if (ranks > 1) cmd.insert(cmd.begin(), {blutrain().string(), "launch", "-n", std::to_string(ranks), "--"});
    return run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  }
  TempDir dir;
};

TEST_F(BenchParallel, LayoutsMatchOneProcessBesideTheirPrediction) {
  const LaunchResult one = bench(1, {});
  ASSERT_EQ(one.status, 0) << one.out << one.err;
  const nlohmann::json base = bench_line(one);
  ASSERT_TRUE(base.contains("last_loss")) << one.out;
  for (const std::string layout : {"split(2)", "split(2, sp=true)", "pipeline(2, schedule=1f1b, micro=2)",
                                   "pipeline(2, schedule=gpipe, micro=2)"}) {
    const LaunchResult r = bench(2, {"--parallel", layout});
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const nlohmann::json j = bench_line(r);
    ASSERT_TRUE(j.contains("predicted")) << r.out;
    EXPECT_EQ(j["parallel"], layout);
    EXPECT_EQ(j["world"], 2);
    EXPECT_EQ(j["backend"], "gloo");
    for (const char* k : {"first_loss", "last_loss"})
      EXPECT_NEAR(j[k].get<double>(), base[k].get<double>(), 1e-5 * base[k].get<double>()) << layout << " " << k;
    // Tokens of a step: B rows × micro-batches × T, on one replica.
    const int64_t micro = layout.rfind("pipeline", 0) == 0 ? 2 : 1;
    EXPECT_EQ(j["micro"], micro);
    EXPECT_NEAR(j["tok_s"].get<double>(), 2.0 * double(micro) * 16 / (j["step_ms"].get<double>() / 1e3), 1.0);
    EXPECT_GT(j["predicted"]["step_ms"].get<double>(), 0) << j.dump();
    EXPECT_GT(j["predicted"]["memory_mib"].get<double>(), 0) << j.dump();
    EXPECT_GT(j["peak_alloc_mib"].get<double>() + 1, 0);
    const double err = j["error"]["step"].get<double>();
    EXPECT_NEAR(err, (j["predicted"]["step_ms"].get<double>() - j["step_ms"].get<double>()) / j["step_ms"].get<double>(),
                1e-9);
    EXPECT_GT(j["link"]["gb_s"].get<double>(), 0);
    if (layout == "split(2)") {
      EXPECT_GT(j["predicted"]["tp_comm_ms"].get<double>(), 0);
    }
    if (micro > 1) {
      EXPECT_GT(j["predicted"]["bubble_ms"].get<double>(), 0);
    }
  }
}

// The hybrids under bench: DP × TP on 4 ranks and DP × PP × TP on 8 run, print their prediction
// and train (fresh random tokens each step, and replica 1 draws other batches than one process:
// the losses are checked to be a cross-entropy near ln 128, not to equal one process's; the
// layouts' arithmetic against one process is DistLayouts.*EveryLayoutMatchesOneProcess's).
TEST_F(BenchParallel, HybridsRunBesideTheirPrediction) {
  for (const auto& [ranks, layout] : std::vector<std::pair<int, std::string>>{
           {4, "replicate(2){ split(2) }"},
           {8, "replicate(2){ pipeline(2, micro=2){ stage(model.layers.0){ split(2) } stage(model.layers.1){ split(2) } } }"}}) {
    const LaunchResult r = bench(ranks, {"--parallel", layout});
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const nlohmann::json j = bench_line(r);
    EXPECT_EQ(j["world"], ranks) << layout;
    EXPECT_EQ(j["micro"], layout.find("pipeline") != std::string::npos ? 2 : 1) << layout;
    EXPECT_GT(j["predicted"]["step_ms"].get<double>(), 0) << j.dump();
    EXPECT_GT(j["predicted"]["tp_comm_ms"].get<double>(), 0) << j.dump();
    EXPECT_NEAR(j["first_loss"].get<double>(), std::log(128.0), 0.5) << layout;
    EXPECT_NEAR(j["last_loss"].get<double>(), std::log(128.0), 0.5) << layout;
  }
}

TEST_F(BenchParallel, ProbeWeightsAndAuto) {
  const LaunchResult probe = bench(2, {"--parallel", "replicate(2, weights=probe)"});
  ASSERT_EQ(probe.status, 0) << probe.out << probe.err;
  const nlohmann::json p = bench_line(probe);
  ASSERT_TRUE(p.contains("probe_weights")) << probe.out;
  ASSERT_EQ(p["probe_weights"].size(), 2u);
  EXPECT_NEAR(p["probe_weights"][0].get<double>() + p["probe_weights"][1].get<double>(), 1.0, 1e-9);
  EXPECT_EQ(p["rows_per_replica"][0].get<int64_t>() + p["rows_per_replica"][1].get<int64_t>(), 4);
  EXPECT_EQ(p["probe_ms"].size(), 2u);

  const LaunchResult a = bench(2, {"--parallel", "auto"});
  ASSERT_EQ(a.status, 0) << a.out << a.err;
  const nlohmann::json j = bench_line(a);
  ASSERT_TRUE(j.contains("plan")) << a.out;
  EXPECT_EQ(j["parallel"], j["plan"][0]["layout"]);
  EXPECT_NEAR(j["predicted"]["step_ms"].get<double>(), j["plan"][0]["step_ms"].get<double>(), 1e-6);
  // The global batch of `--dp 2 -B 2`: 4 rows a step, however the layout splits them.
  int64_t rows = 0;
  for (const auto& r : j["rows_per_replica"]) rows += r.get<int64_t>();
  EXPECT_EQ(rows * j["micro"].get<int64_t>(), 4) << j.dump();
}

TEST_F(BenchParallel, RefusesWhatTheLayoutStates) {
  const LaunchResult dp = bench(2, {"--parallel", "replicate(2)", "--dp", "2"});
  EXPECT_NE(dp.status, 0);
  EXPECT_NE((dp.out + dp.err).find("drop --dp 2"), std::string::npos) << dp.out << dp.err;
  const LaunchResult world = bench(2, {"--parallel", "split(4)"});
  EXPECT_NE(world.status, 0);
  EXPECT_NE((world.out + world.err).find("needs 4 ranks, the job has 2"), std::string::npos) << world.out << world.err;
}

}  // namespace
}  // namespace blu::dist::test
