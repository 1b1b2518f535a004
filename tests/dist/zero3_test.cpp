// ZeRO-3 end to end (dist/zero.h, Note [ZeRO-3] in dist/zero3.cpp): N processes on loopback train
// the tiny GPT-2 and the tiny Llama through dist::Strategy with the parameters sharded, gathered
// block by block, and must match one process training on the same global batch, and ZeRO-2 on the
// same ranks; with and without keeping the blocks from forward to backward; within the memory
// bound; through sharded checkpoints across world sizes and stages; and on one rank.
// Tolerances: against one process, the gradients are averaged over ranks in another order (each
// rank's mean over its rows, then the mean over ranks) — fp32 rounding, as DDP's test: losses
// within 1e-5 relative, parameters within 2e-5 absolute after ten steps. Bit for bit where the
// arithmetic is the same: with clipping off, one rank against one process, ZeRO-3 on 2 ranks
// against ZeRO-2 on 2 ranks (the same per-element average of two values, the same AdamW kernel),
// and keeping the blocks against gathering them twice (the same values either way).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

struct TrainRun {
  std::vector<double> losses;
  std::vector<float> params;
};

using Env = std::vector<std::pair<std::string, std::string>>;

TrainRun train(const TempDir& dir, const std::string& tag, const std::string& mode, int n, int steps, Env extra = {}) {
  const std::string out = dir.str() + "/" + tag;
  extra.insert(extra.end(), {{"BLU_DIST_MODE", mode},
                             {"BLU_DIST_STEPS", std::to_string(steps)},
                             {"BLU_DIST_OUT", out}});
  const LaunchResult r = run_workers("train", n, extra);
  EXPECT_EQ(r.status, 0) << tag << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  if (r.out.find("ZeRO-3 parameter bytes") != std::string::npos) std::printf("%s", r.out.c_str());
  TrainRun run;
  std::ifstream lf(out + ".losses");
  for (double l; lf >> l;) run.losses.push_back(l);
  std::ifstream pf(out + ".params", std::ios::binary);
  pf.seekg(0, std::ios::end);
  run.params.resize(size_t(pf.tellg()) / 4);
  pf.seekg(0);
  pf.read(reinterpret_cast<char*>(run.params.data()), std::streamsize(run.params.size() * 4));
  return run;
}

void expect_close(const TrainRun& a, const TrainRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  ASSERT_FALSE(a.losses.empty()) << what;
  double worst_loss = 0, worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5 * std::abs(a.losses[i])) << what << " step " << i;
    worst_loss = std::max(worst_loss, std::abs(a.losses[i] - b.losses[i]) / std::abs(a.losses[i]));
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  ASSERT_FALSE(a.params.empty()) << what;
  for (size_t i = 0; i < a.params.size(); ++i) worst = std::max(worst, double(std::abs(a.params[i] - b.params[i])));
  EXPECT_LE(worst, 2e-5) << what;
  std::printf("%s: max relative loss diff %.3g, max |param diff| %.3g\n", what.c_str(), worst_loss, worst);
}

void expect_bitwise(const TrainRun& a, const TrainRun& b, const std::string& what) {
  ASSERT_FALSE(a.losses.empty()) << what;
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_TRUE(a.params == b.params) << what << ": the final weights differ";
}

class Zero3 : public ::testing::TestWithParam<std::string> {};

// Ten steps (clipping at 1) on 2 and 4 ranks, both ways of handling the blocks, against one process.
TEST_P(Zero3, MatchesOneProcessOn2And4Ranks) {
  TempDir dir;
  const Env fam = {{"BLU_DIST_FAMILY", GetParam()}};
  const TrainRun single = train(dir, "single", "single", 1, 10, fam);
  for (int n : {2, 4})
    for (const std::string mode : {"zero3", "zero3keep"})
      expect_close(single, train(dir, mode + std::to_string(n), mode, n, 10, fam),
                   GetParam() + " " + mode + " on " + std::to_string(n) + " ranks vs 1 process");
}

// Clipping off: ZeRO-3 on 2 ranks equals ZeRO-2 on 2 ranks and keeping the blocks equals gathering
// them twice, bit for bit; on 4 ranks ZeRO-3 is within fp32 rounding of ZeRO-2; one rank equals
// one process bit for bit.
TEST_P(Zero3, MatchesZero2AndRunsOnOneRank) {
  TempDir dir;
  const Env env = {{"BLU_DIST_FAMILY", GetParam()}, {"BLU_DIST_CLIP", "0"}};
  const TrainRun z2 = train(dir, "z2", "zero2", 2, 10, env);
  const TrainRun z3 = train(dir, "z3", "zero3", 2, 10, env);
  expect_bitwise(z2, z3, GetParam() + " zero3 vs zero2, 2 ranks");
  expect_bitwise(z3, train(dir, "z3k", "zero3keep", 2, 10, env), GetParam() + " zero3keep vs zero3, 2 ranks");
  expect_close(train(dir, "z2_4", "zero2", 4, 10, env), train(dir, "z3_4", "zero3", 4, 10, env),
               GetParam() + " zero3 vs zero2, 4 ranks");
  const TrainRun single = train(dir, "single", "single", 1, 10, env);
  expect_bitwise(single, train(dir, "one", "zero3", 1, 10, env), GetParam() + " zero3 on one rank vs 1 process");
}

// Two micro-batches a step (each reduces its own gradients; the shard sums them).
TEST_P(Zero3, AccumulatesMicroBatches) {
  TempDir dir;
  const Env env = {{"BLU_DIST_FAMILY", GetParam()}, {"BLU_DIST_ACCUM", "2"}};
  expect_close(train(dir, "single", "single", 1, 4, env), train(dir, "z3", "zero3", 2, 4, env),
               GetParam() + " zero3 on 2 ranks, 2 micro-batches vs 1 process");
}

// The memory bound of zero3_memory_hooks (train_harness.h) on 4 ranks with 6 blocks, at every block
// of every step's forward and backward.
TEST_P(Zero3, GathersAtMostTwoUnitsBetweenBlocks) {
  TempDir dir;
  train(dir, "mem", "zero3", 4, 3, {{"BLU_DIST_FAMILY", GetParam()}, {"BLU_DIST_LAYERS", "6"}, {"BLU_DIST_MEMCHECK", "1"}});
}

// A checkpoint written by 4 ranks under ZeRO-3 resumes on 2 ranks under ZeRO-3 and under ZeRO-2,
// and a ZeRO-2 checkpoint resumes under ZeRO-3, each continuing as the straight run.
TEST_P(Zero3, ShardedCheckpointResumesAcrossWorldSizesAndStages) {
  TempDir dir;
  const std::string fam = GetParam();
  const std::string ckpt = dir.str() + "/ckpt", ckpt2 = dir.str() + "/ckpt2";
  const TrainRun straight = train(dir, "straight", "zero3", 4, 6, {{"BLU_DIST_FAMILY", fam}});
  const TrainRun first = train(dir, "first", "zero3", 4, 3,
                               {{"BLU_DIST_FAMILY", fam}, {"BLU_DIST_SAVE_DIR", ckpt}, {"BLU_DIST_SAVE_AT", "3"}});
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/ckpt_00000003/COMMIT"));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first.losses.at(i), straight.losses.at(i));
  TrainRun tail = straight;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  expect_close(tail, train(dir, "resumed", "zero3", 2, 6, {{"BLU_DIST_FAMILY", fam}, {"BLU_DIST_RESUME_DIR", ckpt}}),
               fam + " ZeRO-3 on 4 ranks → checkpoint → ZeRO-3 on 2 ranks");
  expect_close(tail, train(dir, "as_z2", "zero2", 2, 6, {{"BLU_DIST_FAMILY", fam}, {"BLU_DIST_RESUME_DIR", ckpt}}),
               fam + " ZeRO-3 on 4 ranks → checkpoint → ZeRO-2 on 2 ranks");
  train(dir, "first2", "zero2", 4, 3, {{"BLU_DIST_FAMILY", fam}, {"BLU_DIST_SAVE_DIR", ckpt2}, {"BLU_DIST_SAVE_AT", "3"}});
  expect_close(tail, train(dir, "from_z2", "zero3", 2, 6, {{"BLU_DIST_FAMILY", fam}, {"BLU_DIST_RESUME_DIR", ckpt2}}),
               fam + " ZeRO-2 on 4 ranks → checkpoint → ZeRO-3 on 2 ranks");
}

INSTANTIATE_TEST_SUITE_P(Families, Zero3, ::testing::Values("gpt2", "llama"));

}  // namespace
}  // namespace blu::dist::test
