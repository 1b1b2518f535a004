// Data parallelism end to end: N processes on loopback train the tiny GPT and must match one
// process training on the same global batch (fp32 rounding differences only), reproduce
// themselves bit for bit, agree across DDP / ZeRO-1 / ZeRO-2, and resume a 4-rank sharded
// checkpoint on 2 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

struct TrainRun {
  std::vector<double> losses;
  std::vector<float> params;
  int64_t peak = 0;  // rank 0's peak tensor bytes
};

TrainRun train(const TempDir& dir, const std::string& tag, const std::string& mode, int n, int steps, int accum,
          std::vector<std::pair<std::string, std::string>> extra = {}) {
  const std::string out = dir.str() + "/" + tag;
  extra.insert(extra.end(), {{"BLU_DIST_MODE", mode},
                             {"BLU_DIST_STEPS", std::to_string(steps)},
                             {"BLU_DIST_ACCUM", std::to_string(accum)},
                             {"BLU_DIST_OUT", out}});
  const LaunchResult r = run_workers("train", n, extra);
  EXPECT_EQ(r.status, 0) << tag << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  TrainRun run;
  std::ifstream lf(out + ".losses");
  for (double l; lf >> l;) run.losses.push_back(l);
  std::ifstream pf(out + ".params", std::ios::binary);
  pf.seekg(0, std::ios::end);
  run.params.resize(size_t(pf.tellg()) / 4);
  pf.seekg(0);
  pf.read(reinterpret_cast<char*>(run.params.data()), std::streamsize(run.params.size() * 4));
  std::ifstream(out + ".peak") >> run.peak;
  return run;
}

// Losses within rel_loss relative; parameters within abs_param (they are O(0.02..1)).
void expect_close(const TrainRun& a, const TrainRun& b, double rel_loss, double abs_param, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  ASSERT_FALSE(a.losses.empty()) << what;
  double worst_loss = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], rel_loss * std::abs(a.losses[i])) << what << " step " << i;
    worst_loss = std::max(worst_loss, std::abs(a.losses[i] - b.losses[i]) / std::abs(a.losses[i]));
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < a.params.size(); ++i) worst = std::max(worst, double(std::abs(a.params[i] - b.params[i])));
  EXPECT_LE(worst, abs_param) << what;
  std::printf("%s: max relative loss diff %.3g, max |param diff| %.3g\n", what.c_str(), worst_loss, worst);
}

constexpr double kLossRel = 1e-5, kParamAbs = 2e-5;

TEST(DataParallel, DDPMatchesSingleProcessAndRepeatsExactly) {
  TempDir dir;
  const TrainRun single = train(dir, "single", "single", 1, 4, 2);
  const TrainRun two = train(dir, "ddp2", "ddp", 2, 4, 2);
  const TrainRun four = train(dir, "ddp4", "ddp", 4, 4, 2);
  expect_close(single, two, kLossRel, kParamAbs, "ddp 2 ranks vs 1 process");
  expect_close(single, four, kLossRel, kParamAbs, "ddp 4 ranks vs 1 process");
  // The loss goes down (the run trains).
  EXPECT_LT(single.losses.back(), single.losses.front());
  const TrainRun again = train(dir, "ddp2b", "ddp", 2, 4, 2);
  EXPECT_EQ(two.losses, again.losses);
  EXPECT_TRUE(two.params == again.params) << "two runs of DDP on 2 ranks differ";
}

TEST(DataParallel, ZeroStagesMatchDDP) {
  TempDir dir;
  const TrainRun ddp = train(dir, "ddp", "ddp", 2, 4, 1);
  const TrainRun z1 = train(dir, "z1", "zero1", 2, 4, 1);
  const TrainRun z2 = train(dir, "z2", "zero2", 4, 4, 1);
  const TrainRun z2_two = train(dir, "z2two", "zero2", 2, 4, 1);
  expect_close(ddp, z2_two, kLossRel, kParamAbs, "zero2 2 ranks vs ddp 2 ranks");
  // Memory on 2 ranks (N parameters, 4 bytes each): DDP keeps N of gradient buckets and 2N of moments,
  // ZeRO-1 N of buckets and N of moments, ZeRO-2 an N/2 shard gradient (plus buckets in flight)
  // and N of moments.
  const int64_t n_bytes = int64_t(ddp.params.size()) * 4;
  std::printf("peak tensor bytes, 2 ranks, N = %lld bytes: DDP %lld, ZeRO-1 %lld, ZeRO-2 %lld\n",
              static_cast<long long>(n_bytes), static_cast<long long>(ddp.peak), static_cast<long long>(z1.peak),
              static_cast<long long>(z2_two.peak));
  EXPECT_LT(z1.peak + n_bytes * 3 / 4, ddp.peak);
  EXPECT_LT(z2_two.peak + n_bytes / 4, z1.peak);
  const TrainRun z2_accum = train(dir, "z2a", "zero2", 2, 3, 2);  // two micro-batches, local accumulation first
  const TrainRun ddp_accum = train(dir, "ddpa", "ddp", 2, 3, 2);
  expect_close(ddp_accum, z2_accum, kLossRel, kParamAbs, "zero2 2 ranks vs ddp 2 ranks, 2 micro-batches");
  // ZeRO-1 uses DDP's averaged gradients and the same AdamW kernel: bitwise equal.
  EXPECT_EQ(ddp.losses, z1.losses);
  EXPECT_TRUE(ddp.params == z1.params) << "ZeRO-1 differs from DDP";
  const TrainRun ddp4 = train(dir, "ddp4", "ddp", 4, 4, 1);
  expect_close(ddp4, z2, kLossRel, kParamAbs, "zero2 4 ranks vs ddp 4 ranks");
}

// ZeRO with AdamW's moments in host memory, streamed through the device (a pool cpu:1) in chunks
// of 1000 elements: every stage's losses and parameters bitwise those of its moments on the
// device; and DDP with the offloaded optimizer (offload/offload_adamw.h) as before.
TEST(DataParallel, ZeroWithOffloadedStateMatchesOnDevice) {
  TempDir dir;
  for (const char* mode : {"zero1", "zero2", "zero3"}) {
    const TrainRun plain = train(dir, std::string(mode) + "p", mode, 2, 3, 1);
    const TrainRun off = train(dir, std::string(mode) + "o", mode, 2, 3, 1, {{"BLU_DIST_OFFLOAD", "1"}});
    EXPECT_EQ(plain.losses, off.losses) << mode;
    EXPECT_TRUE(plain.params == off.params) << mode << ": offloaded moments changed the parameters";
  }
}

// ZeRO-2 with the tied embedding's row exchange (its LM-head part reduced first, its rows after
// the last bucket, added into each rank's rows of the shard): the same steps as DDP, through the
// gather path and the dense one, on 2 and 4 ranks, and with gradient accumulation (rows of the
// earlier micro-batch added locally).
TEST(DataParallel, Zero2RowExchangeMatchesDDP) {
  TempDir dir;
  const std::pair<std::string, std::string> dense = {"BLU_DIST_ROWS_LIMIT", "0.5"};
  const TrainRun ddp = train(dir, "ddp", "ddp", 2, 4, 1);
  expect_close(ddp, train(dir, "g2", "zero2rows", 2, 4, 1), kLossRel, kParamAbs, "zero2 rows gathered, 2 ranks vs ddp");
  expect_close(ddp, train(dir, "d2", "zero2rows", 2, 4, 1, {dense}), kLossRel, kParamAbs, "zero2 rows dense, 2 ranks vs ddp");
  const TrainRun ddp4 = train(dir, "ddp4", "ddp", 4, 4, 1);
  expect_close(ddp4, train(dir, "g4", "zero2rows", 4, 4, 1), kLossRel, kParamAbs, "zero2 rows gathered, 4 ranks vs ddp");
  expect_close(ddp4, train(dir, "d4", "zero2rows", 4, 4, 1, {dense}), kLossRel, kParamAbs, "zero2 rows dense, 4 ranks vs ddp");
  const TrainRun ddp_accum = train(dir, "ddpa", "ddp", 2, 3, 2);
  expect_close(ddp_accum, train(dir, "ga", "zero2rows", 2, 3, 2), kLossRel, kParamAbs,
               "zero2 rows gathered, 2 ranks, 2 micro-batches vs ddp");
}

TEST(DataParallel, ShardedCheckpointFrom4RanksResumesOn2) {  // and from stage 1 under stage 2
  TempDir dir;
  const std::string ckpt = dir.str() + "/ckpt";
  const TrainRun straight = train(dir, "straight", "zero2", 4, 6, 1);
  const TrainRun first = train(dir, "first", "zero2", 4, 3, 1, {{"BLU_DIST_SAVE_DIR", ckpt}, {"BLU_DIST_SAVE_AT", "3"}});
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/ckpt_00000003/COMMIT"));
  for (int q = 0; q < 4; ++q)
    EXPECT_TRUE(std::filesystem::exists(ckpt + "/ckpt_00000003/pieces_0000" + std::to_string(q) + ".safetensors"));
  TrainRun resumed = train(dir, "resumed", "zero2", 2, 6, 1, {{"BLU_DIST_RESUME_DIR", ckpt}});
  ASSERT_EQ(resumed.losses.size(), 3u);
  TrainRun tail = straight;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  expect_close(tail, resumed, kLossRel, kParamAbs, "4 ranks → checkpoint → 2 ranks vs 4 ranks straight");
  // The first three steps were those of the straight run.
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first.losses[i], straight.losses[i]);
  // A stage-1 checkpoint (one flat slice a rank) resumes under stage 2 (a chunk of every bucket).
  const std::string ckpt1 = dir.str() + "/ckpt1";
  train(dir, "first1", "zero1", 4, 3, 1, {{"BLU_DIST_SAVE_DIR", ckpt1}, {"BLU_DIST_SAVE_AT", "3"}});
  const TrainRun across = train(dir, "across", "zero2", 2, 6, 1, {{"BLU_DIST_RESUME_DIR", ckpt1}});
  expect_close(tail, across, kLossRel, kParamAbs, "ZeRO-1 on 4 ranks → checkpoint → ZeRO-2 on 2 ranks vs ZeRO-2 straight");
}

}  // namespace
}  // namespace blu::dist::test
