// Checkpoints across versions, damage and signals, through the trainer: a checkpoint written by
// main before checkpoint versions existed (data/legacy_765617b) resumes and continues its run; a
// truncated newest checkpoint makes --auto-resume fall back to the previous one with a warning; a
// checksum mismatch is an error naming the file; SIGTERM to `blutrain train` finishes the step,
// checkpoints, exits 75 with the way to continue, and the resumed run repeats the uninterrupted
// one's losses bit for bit.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "blu/dist/launch.h"
#include "blu/io/checkpoint.h"
#include "blu/io/json_file.h"
#include "blu/train/trainer.h"
#include "common/checks.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::train {
namespace {

namespace fs = std::filesystem;
using blu::test::metric_losses;
using blu::test::error_of;
using test::TempDir;

const fs::path kLegacy = fs::path(BLU_TEST_DIR) / "train/data/legacy_765617b";

// The options of data/legacy_765617b/make_legacy_checkpoints.cpp.
TrainOptions legacy_options(const fs::path& data, const fs::path& out) {
  TrainOptions o = test_util::toy_run(data, out, 64, "fp32");
  o.model["n_layer"] = 1;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 16;
  o.model["block_size"] = 16;
  o.batch_size = 2, o.seq_len = 16, o.steps = 4, o.ckpt_every = 2, o.keep_last = 5, o.lr = 1e-2;
  o.val_pattern = "";
  return o;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

TEST(CheckpointCompat, SingleFileCheckpointOfMainBeforeVersionsResumes) {
  TempDir data, out;
  test_util::write_toy_shards(data.path(), 64, 2048, 16384);
  fs::copy_file(kLegacy / "single/ckpt_00000002.safetensors", out.path() / "ckpt_00000002.safetensors");
  TrainOptions o = legacy_options(data.path(), out.path());
  o.resume = true;
  std::map<int64_t, double> got;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) { got[s.step] = s.loss; };
  Trainer t(o, cb);
  EXPECT_EQ(t.step(), 2);
  t.run();
  const nlohmann::json want = io::read_json_file(kLegacy / "losses.json")["single"];
  ASSERT_EQ(got.size(), 2u);
  for (int64_t step : {3, 4})  // main's uninterrupted run; the tolerance allows kernels that change their rounding
    EXPECT_NEAR(got.at(step), want[std::to_string(step)].get<double>(), 1e-6) << "step " << step;
  verify_checkpoint((out.path() / "ckpt_00000004.safetensors").string());  // written in today's format
}

TEST(CheckpointCompat, TruncatedNewestCheckpointFallsBackWithAWarning) {
  TempDir data, straight, cut;
  test_util::write_toy_shards(data.path(), 64, 2048, 16384);
  Trainer(legacy_options(data.path(), straight.path())).run();
  Trainer(legacy_options(data.path(), cut.path())).run();
  const fs::path newest = cut.path() / "ckpt_00000004.safetensors";
  fs::resize_file(newest, fs::file_size(newest) / 2);
  TrainOptions o = legacy_options(data.path(), cut.path());
  o.auto_resume = true;
  o.steps = 4;
  std::ostringstream log;
  TrainCallbacks cb;
  cb.log = &log;
  Trainer t(o, cb);
  EXPECT_EQ(t.step(), 2);
  t.run();
  EXPECT_NE(log.str().find("warning: skipping checkpoint " + newest.string() + " (step 4)"), std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find("resumed from " + (cut.path() / "ckpt_00000002.safetensors").string()), std::string::npos);
  const auto a = metric_losses(straight.path()), b = metric_losses(cut.path());
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (const auto& [step, loss] : a) EXPECT_EQ(b.at(step), loss) << "step " << step;
  verify_checkpoint(newest.string());  // written again
}

TEST(CheckpointCompat, ChecksumMismatchIsAnErrorNamingTheFile) {
  TempDir data, out;
  test_util::write_toy_shards(data.path(), 64, 2048, 16384);
  TrainOptions o = legacy_options(data.path(), out.path());
  o.steps = 2;
  Trainer(o).run();
  const fs::path only = out.path() / "ckpt_00000002.safetensors";
  {
    std::fstream f(only, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  o.resume = true;
  o.steps = 4;
  const std::string err = error_of([&] { Trainer t(o); });
  EXPECT_NE(err.find("--resume: no checkpoint in " + out.path().string() + " verifies"), std::string::npos) << err;
  EXPECT_NE(err.find("checksum mismatch in " + only.string() + ": expected xxh3-64:"), std::string::npos) << err;
  EXPECT_NE(err.find(", got xxh3-64:"), std::string::npos) << err;
}

// ---- SIGTERM to the command ----

fs::path blutrain_path() { return fs::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain"; }

// Starts `args` with stdout and stderr into `log`; returns its pid.
pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_status(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Waits until the run has logged `step` steps (or the process ended); false on timeout.
bool wait_for_step(const fs::path& run, int64_t step, pid_t pid) {
  for (int i = 0; i < 1200; ++i) {
    const auto l = metric_losses(run);
    if (!l.empty() && l.rbegin()->first >= step) return true;
    if (::waitpid(pid, nullptr, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

TEST(Signals, SigtermCheckpointsAndTheResumedRunIsBitExact) {
  if (!fs::exists(blutrain_path())) GTEST_SKIP() << "blutrain not built at " << blutrain_path();
  TempDir dir;
  test_util::write_toy_shards(dir.path(), 64, 2048, 16384);
  const auto cmd = [&](const std::string& out, int64_t steps, std::vector<std::string> extra = {}) {
    std::vector<std::string> c = {blutrain_path().string(), "train", "--train-pattern",
                                  (dir.path() / "toy_train_*.bin").string(), "--model", "tiny", "-B", "2", "-T", "16",
                                  "--schedule", "constant", "--warmup", "0", "--steps", std::to_string(steps), "--out",
                                  (dir.path() / out).string()};
    c.insert(c.end(), extra.begin(), extra.end());
    return c;
  };
  const pid_t pid = spawn(cmd("cut", 100000), dir.path() / "cut.log");
  ASSERT_TRUE(wait_for_step(dir.path() / "cut", 3, pid)) << read_text(dir.path() / "cut.log");
  ::kill(pid, SIGTERM);
  ASSERT_EQ(wait_status(pid), dist::kExitStoppedResumable) << read_text(dir.path() / "cut.log");
  const std::string log = read_text(dir.path() / "cut.log");
  const int64_t stopped = metric_losses(dir.path() / "cut").rbegin()->first;
  char name[64];
  std::snprintf(name, sizeof name, "ckpt_%08lld.safetensors", static_cast<long long>(stopped));
  EXPECT_NE(log.find("stopped at step " + std::to_string(stopped) + " of 100000 by SIGTERM"), std::string::npos) << log;
  EXPECT_NE(log.find("run the same command with --auto-resume"), std::string::npos) << log;
  verify_checkpoint((dir.path() / "cut" / name).string());

  // A rerun without a resume flag is refused and names --auto-resume; --auto-resume continues.
  const pid_t again = spawn(cmd("cut", stopped + 2), dir.path() / "again.log");
  EXPECT_EQ(wait_status(again), 1);
  EXPECT_NE(read_text(dir.path() / "again.log").find("pass --auto-resume to continue it"), std::string::npos)
      << read_text(dir.path() / "again.log");
  const pid_t resumed = spawn(cmd("cut", stopped + 2, {"--auto-resume"}), dir.path() / "resumed.log");
  ASSERT_EQ(wait_status(resumed), 0) << read_text(dir.path() / "resumed.log");
  const pid_t straight = spawn(cmd("straight", stopped + 2), dir.path() / "straight.log");
  ASSERT_EQ(wait_status(straight), 0) << read_text(dir.path() / "straight.log");
  const auto a = metric_losses(dir.path() / "straight"), b = metric_losses(dir.path() / "cut");
  ASSERT_EQ(a.size(), size_t(stopped + 2));
  ASSERT_EQ(b.size(), a.size());
  for (const auto& [step, loss] : a) EXPECT_EQ(b.at(step), loss) << "step " << step;
}

}  // namespace
}  // namespace blu::train
