// Sharded checkpoints that survive (ZeRO runs write layout checkpoints, dist/layout_checkpoint.h;
// the older ZeRO-sharded format is read and checked here too): COMMIT on a full disk fails every
// rank loudly and keeps the previous checkpoint; a truncated newest checkpoint makes --auto-resume
// fall back with a warning; a checksum mismatch names the file, expected and got; an empty COMMIT
// names its path; selection is by step number; a newer format is refused by number; main's
// pre-version ZeRO checkpoint (tests/train/data/legacy_765617b) resumes on 2 ranks; SIGTERM to
// `blutrain launch` checkpoints both Gloo ranks, exits 75, and the resumed run repeats the
// uninterrupted one's losses bit for bit.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "blu/data/shard.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/zero.h"
#include "blu/dist/zero_checkpoint.h"
#include "blu/io/json_file.h"
#include "blu/train/trainer.h"
#include "common/checks.h"
#include "dist_test_util.h"
#include "train/train_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;
using blu::test::metric_losses;
using blu::test::error_of;

const fs::path kLegacy = fs::path(BLU_TEST_DIR) / "train/data/legacy_765617b";

class ShardedDurability : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    std::vector<uint16_t> t(8192);
    for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 131 + i / 7) % 50000);
    write_shard(dir.path / "d_train_000000.bin", t);
  }
  std::vector<std::string> train_cmd(int steps, const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", "2", "--", blutrain().string(), "train",
                                    "--train-pattern", (dir.path / "d_train_*.bin").string(), "--model", "tiny",
                                    "--dp", "2", "--zero", "1", "-B", "2", "-T", "32", "--steps",
                                    std::to_string(steps), "--schedule", "constant", "--warmup", "0", "--lr", "1e-3",
                                    "--out", (dir.path / run).string()};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return cmd;
  }
  LaunchResult train(int steps, const std::string& run, std::vector<std::string> extra = {},
                     std::vector<std::pair<std::string, std::string>> env = {}) {
    env.emplace_back("OMP_NUM_THREADS", "1");
    return run_command(1, train_cmd(steps, run, std::move(extra)), env);
  }
  TempDir dir;
};

TEST_F(ShardedDurability, CommitOnAFullDiskFailsLoudlyAndKeepsThePreviousCheckpoint) {
  const LaunchResult a = train(2, "run");
  ASSERT_EQ(a.status, 0) << a.out << a.err;
  const fs::path two = dir.path / "run/ckpt_00000002";
  const nlohmann::json commit = io::read_json_file(two / "COMMIT");
  EXPECT_EQ(commit["format_version"], kLayoutCheckpointFormatVersion);
  EXPECT_EQ(commit["files"].size(), 3u);  // train_state.json and each rank's pieces
  // Step 4's COMMIT goes to /dev/full (Note [Write fault injection]): every rank fails, naming it.
  const LaunchResult full = train(4, "run", {"--resume", "--keep-last", "1"}, {{"BLU_TEST_WRITE_FULL", "COMMIT"}});
  EXPECT_NE(full.status, 0);
  EXPECT_NE(full.err.find("ckpt_00000004/COMMIT.tmp"), std::string::npos) << full.err;
  EXPECT_NE(full.err.find("No space left on device"), std::string::npos) << full.err;
  EXPECT_NE(full.err.find("was not committed"), std::string::npos) << full.err;
  EXPECT_FALSE(fs::exists(dir.path / "run/ckpt_00000004/COMMIT"));
  verify_layout_checkpoint(two.string());  // kept, although --keep-last 1
  // The next save removes the unfinished directory and commits.
  const LaunchResult again = train(4, "run", {"--auto-resume", "--keep-last", "1"});
  ASSERT_EQ(again.status, 0) << again.out << again.err;
  EXPECT_NE(again.out.find("resumed from " + two.string()), std::string::npos) << again.out;
  verify_layout_checkpoint((dir.path / "run/ckpt_00000004").string());
  EXPECT_FALSE(fs::exists(two));  // pruned after the commit
}

TEST_F(ShardedDurability, TruncatedNewestFallsBackAndChecksumMismatchIsNamed) {
  const LaunchResult a = train(4, "straight", {"--ckpt-every", "2"});
  ASSERT_EQ(a.status, 0) << a.out << a.err;
  const LaunchResult b = train(4, "cut", {"--ckpt-every", "2"});
  ASSERT_EQ(b.status, 0) << b.out << b.err;
  const fs::path shard = dir.path / "cut/ckpt_00000004/pieces_00001.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  const LaunchResult c = train(4, "cut", {"--auto-resume"});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  EXPECT_NE(c.out.find("warning: skipping checkpoint " + (dir.path / "cut/ckpt_00000004").string() + " (step 4)"),
            std::string::npos)
      << c.out;
  EXPECT_NE(c.out.find("bytes, expected"), std::string::npos) << c.out;
  EXPECT_NE(c.out.find("resumed from " + (dir.path / "cut/ckpt_00000002").string()), std::string::npos) << c.out;
  const auto straight = metric_losses(dir.path / "straight"), cut = metric_losses(dir.path / "cut");
  ASSERT_EQ(straight.size(), 4u);
  ASSERT_EQ(cut.size(), 4u);
  for (const auto& [step, loss] : straight) EXPECT_EQ(cut.at(step), loss) << "step " << step;

  // One byte of a shard changed (same size): its checksum.
  const fs::path s0 = dir.path / "straight/ckpt_00000004/pieces_00000.safetensors";
  {
    std::fstream f(s0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    f.put('\x55');
  }
  const std::string err = error_of([&] { verify_layout_checkpoint(s0.parent_path().string()); });
  EXPECT_NE(err.find("checksum mismatch in " + s0.string() + ": expected xxh3-64:"), std::string::npos) << err;
  EXPECT_NE(err.find(", got xxh3-64:"), std::string::npos) << err;
  EXPECT_EQ(latest_any_checkpoint((dir.path / "straight").string()),
            (dir.path / "straight/ckpt_00000002").string());
}

TEST(ShardedSelection, ByStepNumberVersionAndEmptyCommit) {
  TempDir dir;
  for (const char* name : {"ckpt_99999999", "ckpt_100000000", "ckpt_200000000"})
    fs::copy(kLegacy / "zero/ckpt_00000002", dir.path / name);
  fs::remove(dir.path / "ckpt_200000000/COMMIT");  // unfinished: ignored
  EXPECT_EQ(latest_sharded_checkpoint(dir.str()), (dir.path / "ckpt_100000000").string());

  const fs::path commit = dir.path / "ckpt_100000000/COMMIT";
  nlohmann::json j = io::read_json_file(commit);
  j["format_version"] = 3;
  io::write_json_file(commit, j);
  std::string err = error_of([&] { verify_sharded_checkpoint(commit.parent_path().string()); });
  EXPECT_NE(err.find("has format version 3; this build reads versions 1 to 2"), std::string::npos) << err;
  std::vector<std::string> warnings;
  EXPECT_EQ(latest_sharded_checkpoint(dir.str(), [&](const std::string& w) { warnings.push_back(w); }),
            (dir.path / "ckpt_99999999").string());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("format version 3"), std::string::npos) << warnings[0];

  std::ofstream(commit, std::ios::trunc).close();
  err = error_of([&] { verify_sharded_checkpoint(commit.parent_path().string()); });
  EXPECT_NE(err.find(commit.string() + ": empty file"), std::string::npos) << err;
}

// A COMMIT listing a file name the file system refuses (longer than NAME_MAX) is an error naming
// it, not a std::filesystem exception out of verify (found by fuzz_commit after 6.1M inputs).
TEST(ShardedSelection, CommitWithAnOverlongFileNameIsRefusedByName) {
  TempDir dir;
  fs::copy(kLegacy / "zero/ckpt_00000002", dir.path / "ckpt_00000002");
  const fs::path commit = dir.path / "ckpt_00000002/COMMIT";
  nlohmann::json j = io::read_json_file(commit);  // format 1: made a version-2 COMMIT listing one file
  j["format_version"] = 2;
  j["files"] = nlohmann::json::array();  // the model file and the world size's 2 shards, one name too long
  for (const std::string& name : {std::string(300, 'a'), std::string("b"), std::string("c")})
    j["files"].push_back({{"name", name}, {"bytes", 1}, {"checksum", "0"}});
  io::write_json_file(commit, j);
  const std::string err = error_of([&] { verify_sharded_checkpoint(commit.parent_path().string()); });
  EXPECT_NE(err.find("COMMIT lists a file name the file system refuses"), std::string::npos) << err;
  EXPECT_NE(err.find("300 bytes"), std::string::npos) << err;
  EXPECT_EQ(latest_sharded_checkpoint(dir.str(), [](const std::string&) {}), "");  // skipped, with a warning
}

// One rank of the legacy resume below: the Trainer of make_legacy_checkpoints.cpp, resuming.
TEST(ShardedLegacyWorker, Run) {
  const char* out = std::getenv("BLU_LEGACY_OUT");
  if (!out) GTEST_SKIP() << "only runs as a rank of ShardedCompat.MainBeforeVersionsResumesOnTwoRanks";
  const fs::path data = std::getenv("BLU_LEGACY_DATA");
  train::TrainOptions o = train::test_util::toy_run(data, out, 64, "fp32");
  o.model["n_layer"] = 1;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 16;
  o.model["block_size"] = 16;
  o.batch_size = 2, o.seq_len = 16, o.steps = 4, o.ckpt_every = 2, o.keep_last = 5, o.lr = 1e-2;
  o.val_pattern = "";
  o.dp = 2, o.zero = 1, o.resume = true;
  train::Trainer t(o);
  ASSERT_EQ(t.step(), 2);
  t.run();
}

TEST(ShardedCompat, MainBeforeVersionsResumesOnTwoRanks) {
  TempDir data, out;
  train::test_util::write_toy_shards(data.path, 64, 2048, 16384);
  fs::copy(kLegacy / "zero/ckpt_00000002", out.path / "ckpt_00000002");
  const LaunchResult r = run_command(2, {self_exe(), "--gtest_filter=ShardedLegacyWorker.Run", "--gtest_brief=1"},
                                     {{"BLU_LEGACY_OUT", out.str()}, {"BLU_LEGACY_DATA", data.str()},
                                      {"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const nlohmann::json want = io::read_json_file(kLegacy / "losses.json")["zero"];
  const auto got = metric_losses(out.path);
  ASSERT_EQ(got.size(), 2u);
  for (int64_t step : {3, 4})  // main's uninterrupted run; the tolerance allows kernels that change their rounding
    EXPECT_NEAR(got.at(step), want[std::to_string(step)].get<double>(), 1e-6) << "step " << step;
  verify_layout_checkpoint((out.path / "ckpt_00000004").string());  // written in today's format
}

// ---- SIGTERM to `blutrain launch` (what Ctrl-C does to it) ----

TEST_F(ShardedDurability, SigtermToLaunchCheckpointsBothRanksAndResumesBitExactly) {
  const fs::path log = dir.path / "cut.log";
  const std::vector<std::string> cmd = train_cmd(100000, "cut");
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::FILE* f = std::fopen(log.c_str(), "w");
    ::dup2(::fileno(f), 1);
    ::dup2(::fileno(f), 2);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (const std::string& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  bool started = false;
  for (int i = 0; i < 1200 && !started; ++i) {
    const auto l = metric_losses(dir.path / "cut");
    started = !l.empty() && l.rbegin()->first >= 3;
    if (!started) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(started);
  ::kill(pid, SIGTERM);
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::ifstream lf(log);
  const std::string out{std::istreambuf_iterator<char>(lf), {}};
  ASSERT_TRUE(WIFEXITED(st)) << out;
  ASSERT_EQ(WEXITSTATUS(st), kExitStoppedResumable) << out;
  const int64_t stopped = metric_losses(dir.path / "cut").rbegin()->first;
  EXPECT_NE(out.find("stopped at step " + std::to_string(stopped)), std::string::npos) << out;
  EXPECT_NE(out.find("--auto-resume"), std::string::npos) << out;
  char name[32];
  std::snprintf(name, sizeof name, "ckpt_%08lld", static_cast<long long>(stopped));
  verify_layout_checkpoint((dir.path / "cut" / name).string());

  const LaunchResult resumed = train(int(stopped) + 2, "cut", {"--auto-resume"});
  ASSERT_EQ(resumed.status, 0) << resumed.out << resumed.err;
  const LaunchResult straight = train(int(stopped) + 2, "straight");
  ASSERT_EQ(straight.status, 0) << straight.out << straight.err;
  const auto a = metric_losses(dir.path / "straight"), b = metric_losses(dir.path / "cut");
  ASSERT_EQ(a.size(), size_t(stopped + 2));
  ASSERT_EQ(b.size(), a.size());
  for (const auto& [step, loss] : a) EXPECT_EQ(b.at(step), loss) << "step " << step;
}

// A COMMIT is read from disk: numbers of the wrong kind or out of range, and file entries that are
// not objects, are refused naming the COMMIT (found by fuzz/commit.cpp: a float version of 1e300
// was an undefined conversion, a bare number in "files" escaped as a JSON type_error).
TEST(ShardedCommit, HostileCommitsAreRefusedByName) {
  TempDir d;
  const fs::path commit = d.path / "COMMIT";
  const auto refused = [&](const std::string& text, bool pipeline) {
    std::ofstream(commit) << text;
    return error_of([&] {
      if (pipeline)
        PipelineStage::verify_checkpoint(d.str());
      else
        verify_sharded_checkpoint(d.str());
    });
  };
  std::string e = refused(R"({"format_version":1e300,"step":1,"total":8,"world_size":1})", false);
  EXPECT_NE(e.find("COMMIT: expected an integer \"format_version\", got 1e+300"), std::string::npos) << e;
  e = refused(R"({"stages":1,"format_version":2.5})", true);
  EXPECT_NE(e.find("COMMIT: expected an integer \"format_version\", got 2.5"), std::string::npos) << e;
  e = refused(R"({"format_version":2,"step":1,"total":8,"world_size":4294967297})", false);
  EXPECT_NE(e.find("world_size 4294967297 and step 1 must be in [1, 2^20]"), std::string::npos) << e;
  e = refused(R"({"format_version":2,"step":1,"total":8,"world_size":1,"files":[1,2]})", false);
  EXPECT_NE(e.find("COMMIT lists 1; expected {\"name\""), std::string::npos) << e;
  e = refused(R"({"format_version":2,"stages":1,"files":[{"name":"a","bytes":1e300,"checksum":"x"}]})", true);
  EXPECT_NE(e.find("expected {\"name\": a file name, \"bytes\": a size"), std::string::npos) << e;
}

}  // namespace
}  // namespace blu::dist::test
