// `blutrain train --compile` through the command line, against the same command without it:
// - ten steps of GPT-2 tiny and Llama tiny (AdamW, clipping at 1.0, a cosine lr with warm-up;
//   Llama with two micro-batches) log bitwise the eager losses and gradient norms, every step
//   after the warm-up runs compiled (the run's "compile" event in metrics.jsonl), and
//   --compile-log prints the graph, the memory plan and the compile time;
// - data parallelism over Gloo (`blutrain launch -n 2 -- blutrain train --dp 2 --zero Z
//   --compile`, Z = 0, 1, 2): the captured all-reduces / reduce-scatters / all-gathers replay and
//   the losses equal the eager dp run's bitwise;
// - a compiled run killed with SIGKILL at random moments and restarted with --auto-resume until
//   it finishes logs the uninterrupted compiled run's losses bit for bit;
// - ops named in --compile-exclude stay out of the arena (logged) and change no bit;
// - what the compiler does not support (pipelines, ZeRO-3, activation offload) is refused at start
//   with a message naming it; bf16 and fp16 (loss scaling on the device) compile, every region's
//   kernel builds and loads, and they match eager;
// - a --gpu-memory-budget under --compile is planned with the optimizer state on the device and
//   met against the compiled steps' peak; a budget only offload would meet, and --offload-state,
//   are refused by name;
// - --recompute selective, mlp, mlp:2, mlp-first:1, block:2 and block compile (the recomputed
//   forward is part of the captured backward) and match the eager run with the same setting
//   bitwise (the plan peaks are printed; at these tiny shapes the logits, not the activations,
//   make the peak);
// - --compile-remat (the compiler's own recompute) matches eager bitwise, alone and under ZeRO-1.
// Run: ctest -R CompileCli, or build-cpu/tests/test_compiler --gtest_filter='CompileCli*'.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "blu/data/shard.h"
#include "common/checks.h"
#include "dist/dist_test_util.h"
#include "train/train_test_util.h"

namespace blu::compiler {
namespace {

namespace fs = std::filesystem;
using dist::test::LaunchResult;
using dist::test::run_command;
using dist::test::TempDir;

fs::path blutrain() { return fs::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain"; }

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// step -> (loss, norm) of a run's metrics.jsonl, and its "compile" event (null when none).
struct Metrics {
  std::map<int64_t, std::pair<double, double>> steps;
  nlohmann::json compile;
};
Metrics read_metrics(const fs::path& run) {
  Metrics m;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;
    if (j.value("event", "") == "step")
      m.steps[j["step"].get<int64_t>()] = {j["loss"].get<double>(), j["norm"].get<double>()};
    if (j.value("event", "") == "compile") m.compile = j;
  }
  return m;
}

void expect_same_steps(const Metrics& eager, const Metrics& compiled, size_t steps, const std::string& what) {
  ASSERT_EQ(eager.steps.size(), steps) << what;
  ASSERT_EQ(compiled.steps.size(), steps) << what;
  for (const auto& [step, ln] : eager.steps) {
    EXPECT_EQ(compiled.steps.at(step).first, ln.first) << what << ": loss of step " << step;
    EXPECT_EQ(compiled.steps.at(step).second, ln.second) << what << ": gradient norm of step " << step;
  }
}

class CompileCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    // Ids below 101: both tiny models (GPT-2's 50257 ids, Llama tiny's 101) read them.
    write_shard(dir.path / "d_train_000000.bin", train::test_util::pattern_tokens(16384, 2, 101));
  }
  std::vector<std::string> train_cmd(const std::string& model, int steps, const std::string& run,
                                     std::vector<std::string> extra = {}) {
    std::vector<std::string> c = {blutrain().string(), "train", "--train-pattern", (dir.path / "d_train_*.bin").string(),
                                  "--model", model, "-B", "2", "-T", "16", "--steps", std::to_string(steps),
                                  "--optimizer", "adamw", "--schedule", "cosine", "--warmup", "3", "--lr", "3e-3",
                                  "--min-lr", "3e-4", "--grad-clip", "1.0", "--out", (dir.path / run).string()};
    c.insert(c.end(), extra.begin(), extra.end());
    return c;
  }
  LaunchResult run1(std::vector<std::string> cmd, std::vector<std::pair<std::string, std::string>> env = {}) {
    env.emplace_back("OMP_NUM_THREADS", "1");
    return run_command(1, std::move(cmd), std::move(env));
  }
  LaunchResult run_dp(int zero, int steps, const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", "2", "--"};
    const auto t = train_cmd("tiny", steps, run, {"--dp", "2", "--zero", std::to_string(zero)});
    cmd.insert(cmd.end(), t.begin(), t.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  }
  TempDir dir;
};

class CompileCliModels : public CompileCli, public ::testing::WithParamInterface<std::string> {};

TEST_P(CompileCliModels, TenStepsEqualEagerBitwise) {
  const std::string model = GetParam();
  // Llama over two micro-batches: four step inputs, the accumulation captured in one step.
  std::vector<std::string> extra;
  if (model != "tiny") extra = {"--grad-accum", "2"};
  const LaunchResult e = run1(train_cmd(model, 10, "eager", extra));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  extra.insert(extra.end(), {"--compile", "--compile-log"});
  const LaunchResult c = run1(train_cmd(model, 10, "compiled", extra));
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const Metrics me = read_metrics(dir.path / "eager"), mc = read_metrics(dir.path / "compiled");
  expect_same_steps(me, mc, 10, model);
  ASSERT_FALSE(mc.compile.is_null()) << c.out;
  EXPECT_EQ(mc.compile["compiled"], 9) << mc.compile.dump();
  EXPECT_EQ(mc.compile["eager"], 1) << mc.compile.dump();  // the warm-up step
  EXPECT_EQ(mc.compile["fallback"], 0) << mc.compile.dump();
  EXPECT_EQ(mc.compile["guard_failures"], 0) << mc.compile.dump();
  EXPECT_GT(mc.compile["graph_ops"].get<int64_t>(), 100);
  EXPECT_EQ(mc.compile["collectives"], 0) << mc.compile.dump();
  const std::string log = c.out + c.err;
  EXPECT_NE(log.find("compile: variant 1 for"), std::string::npos) << log;
  EXPECT_NE(log.find("compile: memory plan: peak"), std::string::npos) << log;
  EXPECT_NE(log.find("compile: compile time:"), std::string::npos) << log;
  EXPECT_NE(log.find("compiled steps: 9 compiled, 1 eager, 0 fallback, 0 guard failures"), std::string::npos) << log;
  EXPECT_EQ(log.find("refused: its kernel failed"), std::string::npos) << log;  // every emitted kernel builds
  EXPECT_EQ(me.compile, nlohmann::json()) << "the eager run wrote a compile event";
}

INSTANTIATE_TEST_SUITE_P(Compiler, CompileCliModels, ::testing::Values("tiny", "llama:tiny"),
                         [](const auto& info) { return info.param == "tiny" ? std::string("gpt2") : std::string("llama"); });

class CompileCliDp : public CompileCli, public ::testing::WithParamInterface<int> {};

TEST_P(CompileCliDp, GlooDataParallelEqualsEagerBitwise) {
  const int zero = GetParam();
  const LaunchResult e = run_dp(zero, 6, "eager");
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  const LaunchResult c = run_dp(zero, 6, "compiled", {"--compile", "--compile-log"});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const Metrics me = read_metrics(dir.path / "eager"), mc = read_metrics(dir.path / "compiled");
  expect_same_steps(me, mc, 6, "zero " + std::to_string(zero));
  ASSERT_FALSE(mc.compile.is_null()) << c.out;
  EXPECT_EQ(mc.compile["compiled"], 5) << mc.compile.dump() << c.out << c.err;
  EXPECT_EQ(mc.compile["fallback"], 0) << mc.compile.dump() << c.out << c.err;
  // The collectives are in the graph (DDP's bucket all-reduces, ZeRO's reduce-scatters and
  // all-gathers), replayed on the Gloo group.
  EXPECT_GT(mc.compile["collectives"].get<int64_t>(), 0) << mc.compile.dump();
  EXPECT_NE(c.out.find(" collective, "), std::string::npos) << c.out;
}

INSTANTIATE_TEST_SUITE_P(Compiler, CompileCliDp, ::testing::Values(0, 1, 2),
                         [](const auto& info) { return "zero" + std::to_string(info.param); });

// Starts `args` with stdout and stderr appended to `log`; returns its pid.
pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
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

TEST_F(CompileCli, KilledAtRandomMomentsResumesBitExactly) {
  const int steps = 20;
  const std::vector<std::string> flags = {"--compile", "--ckpt-every", "2", "--keep-last", "2"};
  const LaunchResult straight = run1(train_cmd("tiny", steps, "straight", flags));
  ASSERT_EQ(straight.status, 0) << straight.out << straight.err;
  // Each restart is killed at a random moment of its own run: once it has logged a random one of
  // the next three steps, plus a random fraction of a step (so inside a capture, a replay, a
  // checkpoint being written, or the start-up when that step is logged already), five times; the
  // sixth run finishes.
  const double step_s = straight.seconds / steps;
  std::mt19937 rng(20);
  std::vector<std::string> cut = train_cmd("tiny", steps, "cut", flags);
  cut.push_back("--auto-resume");
  const fs::path log = dir.path / "cut.log";
  int kills = 0, status = -1;
  for (int attempt = 0; attempt < 6; ++attempt) {
    const auto logged = read_metrics(dir.path / "cut").steps;
    const int64_t done = logged.empty() ? 0 : logged.rbegin()->first;
    const pid_t pid = spawn(cut, log);
    int st = 0;
    bool exited = false;
    if (attempt < 5 && done + 2 < steps) {
      const int64_t after = std::uniform_int_distribution<int64_t>(done, std::min<int64_t>(done + 3, steps - 2))(rng);
      const double extra = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * step_s;
      const auto t0 = std::chrono::steady_clock::now();
      for (;;) {  // until `after` steps are logged (at most a minute), or the run ends
        if (::waitpid(pid, &st, WNOHANG) == pid) {
          exited = true;
          break;
        }
        const auto now = read_metrics(dir.path / "cut").steps;
        if ((!now.empty() && now.rbegin()->first >= after) || after == done ||
            std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60))
          break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (!exited) {
        std::this_thread::sleep_for(std::chrono::duration<double>(extra));
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &st, 0);
        ++kills;
        continue;
      }
    }
    if (!exited) ::waitpid(pid, &st, 0);
    status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    break;
  }
  ASSERT_EQ(status, 0) << read_text(log);
  // Up to five kills are planned; a run can reach its end before the last one lands.
  EXPECT_GE(kills, 3) << read_text(log);
  const Metrics a = read_metrics(dir.path / "straight"), b = read_metrics(dir.path / "cut");
  ASSERT_EQ(a.steps.size(), size_t(steps));
  ASSERT_EQ(b.steps.size(), size_t(steps)) << read_text(log);
  for (const auto& [step, ln] : a.steps)
    EXPECT_EQ(b.steps.at(step).first, ln.first) << "loss of step " << step << " after " << kills << " kills";
  EXPECT_NE(read_text(log).find("resumed from"), std::string::npos);
}

TEST_F(CompileCli, HalfPrecisionEqualsEagerBitwise) {
  for (const std::string precision : {"bf16", "fp16"}) {
    const LaunchResult e = run1(train_cmd("tiny", 4, "eager_" + precision, {"--precision", precision}));
    ASSERT_EQ(e.status, 0) << e.out << e.err;
    const LaunchResult c =
        run1(train_cmd("tiny", 4, "compiled_" + precision, {"--precision", precision, "--compile", "--compile-log"}));
    ASSERT_EQ(c.status, 0) << c.out << c.err;
    const Metrics mc = read_metrics(dir.path / ("compiled_" + precision));
    expect_same_steps(read_metrics(dir.path / ("eager_" + precision)), mc, 4, precision);
    EXPECT_EQ(mc.compile["compiled"], 3) << precision << ": " << mc.compile.dump();
    // The 16-bit regions' kernels build and load (blu::bf16/f16 conversions inside the kernel).
    const std::string log = c.out + c.err;
    EXPECT_NE(log.find("compile: fusion: "), std::string::npos) << precision << ": " << log;
    EXPECT_EQ(log.find("refused: its kernel failed"), std::string::npos) << precision << ": " << log;
    // The fp16 loss scaler's update regions (comparisons choosing through where) have an emitter.
    EXPECT_EQ(log.find("without a CPU emitter"), std::string::npos) << precision << ": " << log;
  }
}

TEST_F(CompileCli, RecomputeCompilesAndEqualsEagerBitwise) {
  for (const std::string model : {"tiny", "llama:tiny"}) {
    const std::string tag = model == "tiny" ? "gpt2" : "llama";
    const LaunchResult plain = run1(train_cmd(model, 4, "plain_" + tag, {"--compile"}));
    ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
    const double plain_peak = read_metrics(dir.path / ("plain_" + tag)).compile["plan_peak_bytes"].get<double>();
    for (const std::string r : {"selective", "mlp", "mlp:2", "mlp-first:1", "block:2", "block"}) {
      std::string run = tag + "_" + r;
      std::replace(run.begin(), run.end(), ':', '_');
      const LaunchResult e = run1(train_cmd(model, 4, "eager_" + run, {"--recompute", r}));
      ASSERT_EQ(e.status, 0) << e.out << e.err;
      const LaunchResult c = run1(train_cmd(model, 4, "compiled_" + run, {"--recompute", r, "--compile"}));
      ASSERT_EQ(c.status, 0) << c.out << c.err;
      const Metrics mc = read_metrics(dir.path / ("compiled_" + run));
      expect_same_steps(read_metrics(dir.path / ("eager_" + run)), mc, 4, run);
      EXPECT_EQ(mc.compile["compiled"], 3) << run << ": " << mc.compile.dump();
      EXPECT_EQ(mc.compile["guard_failures"], 0) << run << ": " << mc.compile.dump();
      std::cout << run << ": plan peak " << mc.compile["plan_peak_bytes"].get<double>() << " B, without recompute "
                << plain_peak << " B\n";
    }
  }
  const LaunchResult off = run1(train_cmd("tiny", 2, "offload", {"--offload-activations", "--compile"}));
  EXPECT_NE(off.status, 0);
  EXPECT_NE((off.out + off.err).find("--compile: --offload-activations is not supported"), std::string::npos)
      << off.out << off.err;
}

// --master-weights split (optim/master_split.h): AdamW's split update is captured as its own
// kernel, so the compiled run is the eager one bit for bit, for both tiny models, and a resumed
// compiled run continues it. Refused with fp32 weights, where there are no bf16 copies to split.
TEST_F(CompileCli, SplitMastersCompileAndEqualEagerBitwise) {
  for (const std::string model : {"tiny", "llama:tiny"}) {
    const std::string tag = model == "tiny" ? "gpt2" : "llama";
    const std::vector<std::string> split = {"--precision", "bf16", "--master-weights", "split"};
    const LaunchResult e = run1(train_cmd(model, 6, "eager_split_" + tag, split));
    ASSERT_EQ(e.status, 0) << e.out << e.err;
    std::vector<std::string> compiled = split;
    compiled.push_back("--compile");
    const LaunchResult c = run1(train_cmd(model, 6, "compiled_split_" + tag, compiled));
    ASSERT_EQ(c.status, 0) << c.out << c.err;
    const Metrics mc = read_metrics(dir.path / ("compiled_split_" + tag));
    expect_same_steps(read_metrics(dir.path / ("eager_split_" + tag)), mc, 6, tag);
    EXPECT_EQ(mc.compile["compiled"], 5) << tag << ": " << mc.compile.dump();
    EXPECT_EQ(mc.compile["guard_failures"], 0) << tag << ": " << mc.compile.dump();
    EXPECT_NE((c.out + c.err).find("split master weights: "), std::string::npos) << c.out << c.err;
  }
  const LaunchResult bad = run1(train_cmd("tiny", 2, "split_fp32", {"--master-weights", "split"}));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE((bad.out + bad.err).find("--master-weights split keeps each fp32 master as its bf16 compute copy"),
            std::string::npos)
      << bad.out << bad.err;
}

// --compile-remat: the compiler's own recompute (compiler/remat.h). Bitwise the eager run, alone
// and under data parallelism with ZeRO-1 (its collectives stay where they were), with a lower
// plan peak than the plain compiled run's, its choices logged and recorded. Llama tiny: GPT-2
// tiny's peak here is its 50257-row embedding gradient after the activations are gone, which no
// recompute lowers (the pass then chooses nothing: CompiledVsEager covers GPT-2 at a vocabulary
// of 101).
TEST_F(CompileCli, CompilerChosenRecomputeEqualsEagerBitwise) {
  for (const std::string model : {"llama:tiny"}) {
    const std::string tag = "llama";
    const LaunchResult e = run1(train_cmd(model, 6, "eager_" + tag));
    ASSERT_EQ(e.status, 0) << e.out << e.err;
    const LaunchResult p = run1(train_cmd(model, 6, "plain_" + tag, {"--compile"}));
    ASSERT_EQ(p.status, 0) << p.out << p.err;
    const LaunchResult c = run1(train_cmd(model, 6, "remat_" + tag, {"--compile", "--compile-remat", "--compile-log"}));
    ASSERT_EQ(c.status, 0) << c.out << c.err;
    const Metrics mc = read_metrics(dir.path / ("remat_" + tag));
    expect_same_steps(read_metrics(dir.path / ("eager_" + tag)), mc, 6, tag);
    EXPECT_EQ(mc.compile["compiled"], 5) << mc.compile.dump();
    EXPECT_GT(mc.compile["remat_buffers"].get<int64_t>(), 0) << mc.compile.dump();
    EXPECT_LT(mc.compile["plan_peak_bytes"].get<double>(),
              read_metrics(dir.path / ("plain_" + tag)).compile["plan_peak_bytes"].get<double>());
    EXPECT_NE((c.out + c.err).find("compile: recompute: "), std::string::npos) << c.out << c.err;
  }
  // Under ZeRO-1 at B=2, T=16 the peak is the optimizer's; at B=8, T=64 it is the activations'.
  auto dp = [&](const std::string& run, std::vector<std::string> extra) {
    std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", "2", "--"};
    auto t = train_cmd("llama:tiny", 4, run, {"--dp", "2", "--zero", "1"});
    *(std::find(t.begin(), t.end(), "-B") + 1) = "8";
    *(std::find(t.begin(), t.end(), "-T") + 1) = "64";
    cmd.insert(cmd.end(), t.begin(), t.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  };
  const LaunchResult e = dp("dp_eager", {});
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  const LaunchResult c = dp("dp_remat", {"--compile", "--compile-remat"});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const Metrics mc = read_metrics(dir.path / "dp_remat");
  expect_same_steps(read_metrics(dir.path / "dp_eager"), mc, 4, "zero 1");
  EXPECT_GT(mc.compile["remat_buffers"].get<int64_t>(), 0) << mc.compile.dump();
  EXPECT_GT(mc.compile["collectives"].get<int64_t>(), 0) << mc.compile.dump();
  std::cout << "zero 1: " << mc.compile.dump() << "\n";
}

// --loss-chunks (ops/fused.h, Note [Chunked loss]): the compiled run equals the eager run with the
// same pieces bitwise, the plan's peak is below the compiled run with the whole logits, the losses
// stay near the whole logits', run.json records the setting, and a bad value is refused before
// anything is written.
TEST_F(CompileCli, ChunkedLossCompiledEqualsEagerWithALowerPeak) {
  // GPT-2 tiny (a vocabulary of 50257, padded to 50304) at 512 rows: its logits (100 MB in fp32)
  // are the largest buffer of the step, as a real model's are.
  auto cmd = [&](const std::string& run, std::vector<std::string> extra) {
    auto t = train_cmd("tiny", 5, run, std::move(extra));
    *(std::find(t.begin(), t.end(), "-B") + 1) = "8";
    *(std::find(t.begin(), t.end(), "-T") + 1) = "64";
    return t;
  };
  const LaunchResult whole = run1(cmd("whole", {"--compile"}));
  ASSERT_EQ(whole.status, 0) << whole.out << whole.err;
  const LaunchResult e = run1(cmd("pieces_eager", {"--loss-chunks", "4"}));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  const LaunchResult c = run1(cmd("pieces", {"--compile", "--loss-chunks", "4", "--ckpt-every", "2", "--keep-last", "5"}));
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const Metrics mw = read_metrics(dir.path / "whole"), mc = read_metrics(dir.path / "pieces");
  expect_same_steps(read_metrics(dir.path / "pieces_eager"), mc, 5, "loss chunks");
  EXPECT_EQ(mc.compile["compiled"], 4) << mc.compile.dump();
  EXPECT_LT(mc.compile["plan_peak_bytes"].get<double>(), mw.compile["plan_peak_bytes"].get<double>())
      << mc.compile.dump() << "\n" << mw.compile.dump();
  for (int64_t s = 1; s <= 5; ++s)
    EXPECT_NEAR(mc.steps.at(s).first, mw.steps.at(s).first, 1e-4 * mw.steps.at(s).first) << "step " << s;
  std::ifstream f(dir.path / "pieces" / "run.json");
  const nlohmann::json run = nlohmann::json::parse(f, nullptr, false);
  ASSERT_FALSE(run.is_discarded());
  EXPECT_EQ(run["options"].value("loss_chunks", 0), 4) << run.dump();
  std::cout << "plan peak " << mw.compile["plan_peak_bytes"] << " B with the whole logits, "
            << mc.compile["plan_peak_bytes"] << " B in 4 pieces\n";
  // Resumed from its step-2 checkpoint with no flag, the run takes --loss-chunks (and --compile)
  // from run.json and continues bit-exactly. (At this size OpenBLAS's sums over the four pieces
  // come out bitwise as over the whole, so the resume's own run.json record is what shows the
  // setting was taken.)
  fs::copy(dir.path / "pieces", dir.path / "resumed", fs::copy_options::recursive);
  int dropped = 0;
  for (const auto& e : fs::directory_iterator(dir.path / "resumed")) {
    const std::string name = e.path().filename().string();
    if (name.rfind("ckpt_", 0) == 0 && name.find("_2.") == std::string::npos &&
        name.find("00002") == std::string::npos) {
      fs::remove_all(e.path());
      ++dropped;
    }
  }
  ASSERT_GT(dropped, 0) << "no later checkpoint to drop";
  const LaunchResult r = run1({blutrain().string(), "train", "--out", (dir.path / "resumed").string(), "--auto-resume"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("resumed from"), std::string::npos) << r.out << r.err;
  const Metrics mr = read_metrics(dir.path / "resumed");
  for (int64_t s = 3; s <= 5; ++s) EXPECT_EQ(mr.steps.at(s).first, mc.steps.at(s).first) << "step " << s << " resumed";
  std::ifstream rf(dir.path / "resumed" / "run.json");
  const nlohmann::json resumed_run = nlohmann::json::parse(rf, nullptr, false);
  ASSERT_TRUE(resumed_run.contains("options")) << resumed_run.dump();
  EXPECT_EQ(resumed_run["options"].value("loss_chunks", 0), 4) << "the resume takes the run's pieces from run.json";
  const LaunchResult bad = run1(cmd("bad", {"--loss-chunks", "-1"}));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE((bad.out + bad.err).find("--loss-chunks must be >= 0"), std::string::npos) << bad.out << bad.err;
  EXPECT_FALSE(fs::exists(dir.path / "bad" / "run.json"));
}

// --loss-chunks under the layouts that keep the whole vocabulary on a rank (two Gloo ranks): DDP
// and ZeRO-2 (the tied embedding's rows exchanged apart, its head gradient now made in the
// forward) and a two-stage pipeline give the losses and gradient norms of the same layout with the
// whole logits within fp32 rounding; tensor parallelism refuses the flag by name.
TEST_F(CompileCli, ChunkedLossUnderDataParallelAndPipelineLayouts) {
  auto near = [&](const std::string& a, const std::string& b) {
    const Metrics ma = read_metrics(dir.path / a), mb = read_metrics(dir.path / b);
    ASSERT_EQ(ma.steps.size(), 4u) << a;
    ASSERT_EQ(mb.steps.size(), 4u) << b;
    for (const auto& [s, ln] : ma.steps) {
      EXPECT_NEAR(mb.steps.at(s).first, ln.first, 1e-5 * ln.first) << b << " step " << s;
      EXPECT_NEAR(mb.steps.at(s).second, ln.second, 1e-4 * ln.second) << b << " norm of step " << s;
    }
  };
  for (int zero : {0, 2}) {
    const std::string tag = "zero" + std::to_string(zero);
    ASSERT_EQ(run_dp(zero, 4, tag + "_whole").status, 0);
    const LaunchResult p = run_dp(zero, 4, tag + "_pieces", {"--loss-chunks", "4"});
    ASSERT_EQ(p.status, 0) << p.out << p.err;
    near(tag + "_whole", tag + "_pieces");
  }
  auto layout = [&](const std::string& run, const std::string& parallel, std::vector<std::string> extra) {
    std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", "2", "--"};
    const auto t = train_cmd("tiny", 4, run, {"--parallel", parallel});
    cmd.insert(cmd.end(), t.begin(), t.end());
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  };
  ASSERT_EQ(layout("pp_whole", "pipeline(2, micro=2)", {}).status, 0);
  const LaunchResult pp = layout("pp_pieces", "pipeline(2, micro=2)", {"--loss-chunks", "4"});
  ASSERT_EQ(pp.status, 0) << pp.out << pp.err;
  near("pp_whole", "pp_pieces");
  const LaunchResult tp = layout("tp_pieces", "split(2)", {"--loss-chunks", "4"});
  EXPECT_NE(tp.status, 0);
  EXPECT_NE((tp.out + tp.err).find("not supported under tensor parallelism"), std::string::npos) << tp.out << tp.err;
}

// A device budget under --compile: the plan keeps the optimizer state on the device (the compiler
// does not capture the offloaded update) and is met, against the compiled steps' peak on a device
// pool, with the eager run's losses; a budget only offload would meet is refused, naming the
// smallest that fits and --recompute; --offload-state is refused by name.
TEST_F(CompileCli, MemoryBudgetIsPlannedWithTheStateOnTheDevice) {
  const std::vector<std::string> budget = {"--device", "cpu:1", "--gpu-memory-budget", "1", "--log-every", "1"};
  const LaunchResult e = run1(train_cmd("llama:tiny", 4, "eager_budget", budget));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  std::vector<std::string> compiled = budget;
  compiled.push_back("--compile");
  const LaunchResult c = run1(train_cmd("llama:tiny", 4, "compiled_budget", compiled));
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const Metrics mc = read_metrics(dir.path / "compiled_budget");
  expect_same_steps(read_metrics(dir.path / "eager_budget"), mc, 4, "budget");
  EXPECT_EQ(mc.compile["compiled"], 3) << mc.compile.dump();
  const double planned = blu::test::planned_peak_bytes(c.out);
  ASSERT_GT(planned, 0) << c.out;
  const double peak = blu::test::metric_peak_bytes(dir.path / "compiled_budget");
  EXPECT_NEAR(peak, planned, 0.05 * planned) << c.out;
  EXPECT_EQ(c.out.find("optimizer state on the host"), std::string::npos) << c.out;
  std::printf("compiled under a budget: planned %.0f, steps' peak %.0f bytes\n", planned, peak);

  std::vector<std::string> small = {"--device", "cpu:1", "--gpu-memory-budget", "0.0001", "--compile"};
  const LaunchResult s = run1(train_cmd("llama:tiny", 2, "small_budget", small));
  EXPECT_NE(s.status, 0);
  EXPECT_NE((s.out + s.err).find("the smallest device budget that fits is"), std::string::npos) << s.out << s.err;
  EXPECT_NE((s.out + s.err).find("under --compile the optimizer state stays on the device"), std::string::npos)
      << s.out << s.err;
  const LaunchResult o = run1(train_cmd("llama:tiny", 2, "offload", {"--offload-state", "optimizer", "--compile"}));
  EXPECT_NE(o.status, 0);
  EXPECT_NE((o.out + o.err).find("--compile: optimizer state offload (--offload-state optimizer)"), std::string::npos)
      << o.out << o.err;
}

// A device budget under --compile --compile-remat counts the compiler's recompute: the planner
// captures one micro-batch's forward and backward (no kernel runs), lets the pass decide on it,
// and plans the compiled steps with what it takes off their peak, and the first, eager step with
// its activations whole but no optimizer state yet (the larger of the two). The plan is lower than
// without the pass, the steps' peak on a device pool within 5% of it; under a budget between the
// two plans, --recompute auto keeps `none` (counting only the eager probe it would recompute),
// runs inside the budget the pool enforces, and is the eager run bit for bit.
TEST_F(CompileCli, MemoryBudgetCountsTheCompilersRecompute) {
  auto cmd = [&](const std::string& run, std::vector<std::string> extra) {
    auto t = train_cmd("llama:tiny", 4, run, std::move(extra));
    *(std::find(t.begin(), t.end(), "-B") + 1) = "8";
    *(std::find(t.begin(), t.end(), "-T") + 1) = "64";
    t.insert(t.end(), {"--device", "cpu:1", "--log-every", "1", "--loss-chunks", "1"});
    return t;
  };
  const LaunchResult e = run1(cmd("eager", {}));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  const LaunchResult plain = run1(cmd("plain", {"--compile", "--gpu-memory-budget", "1"}));
  ASSERT_EQ(plain.status, 0) << plain.out << plain.err;
  const LaunchResult remat = run1(cmd("remat", {"--compile", "--compile-remat", "--gpu-memory-budget", "1"}));
  ASSERT_EQ(remat.status, 0) << remat.out << remat.err;
  const double planned_plain = blu::test::planned_peak_bytes(plain.out);
  const double planned_remat = blu::test::planned_peak_bytes(remat.out);
  ASSERT_GT(planned_remat, 0) << remat.out;
  EXPECT_LT(planned_remat, planned_plain) << remat.out;
  EXPECT_NE(remat.out.find(" the compiler recomputes, plus "), std::string::npos) << remat.out;
  const double peak_plain = blu::test::metric_peak_bytes(dir.path / "plain");
  const double peak_remat = blu::test::metric_peak_bytes(dir.path / "remat");
  EXPECT_NEAR(peak_remat, planned_remat, 0.05 * planned_remat) << remat.out;
  EXPECT_LT(peak_remat, peak_plain);
  expect_same_steps(read_metrics(dir.path / "eager"), read_metrics(dir.path / "remat"), 4, "remat under a budget");
  std::printf("planned %.0f / steps' peak %.0f bytes compiled, %.0f / %.0f with the compiler's recompute\n",
              planned_plain, peak_plain, planned_remat, peak_remat);

  const double budget = (planned_plain + planned_remat) / 2;
  const LaunchResult a = run1(cmd("auto", {"--compile", "--compile-remat", "--recompute", "auto", "--gpu-memory-budget",
                                           std::to_string(budget / 1073741824.0)}));
  ASSERT_EQ(a.status, 0) << a.out << a.err;
  EXPECT_NE(a.out.find("recompute auto: none (the least recompute that fits"), std::string::npos) << a.out;
  EXPECT_LE(blu::test::metric_peak_bytes(dir.path / "auto"), budget);
  expect_same_steps(read_metrics(dir.path / "eager"), read_metrics(dir.path / "auto"), 4, "auto under a budget");
  // Without the pass the same budget needs recompute.
  const LaunchResult n = run1(cmd("auto_plain", {"--compile", "--recompute", "auto", "--gpu-memory-budget",
                                                 std::to_string(budget / 1073741824.0)}));
  ASSERT_EQ(n.status, 0) << n.out << n.err;
  EXPECT_EQ(n.out.find("recompute auto: none ("), std::string::npos) << n.out;
}

TEST_F(CompileCli, ExcludedOpsStayOutOfTheArenaAndChangeNothingAndTyposAreRefused) {
  const LaunchResult e = run1(train_cmd("tiny", 4, "eager"));
  ASSERT_EQ(e.status, 0) << e.out << e.err;
  const LaunchResult c = run1(train_cmd("tiny", 4, "excluded", {"--compile", "--compile-log"}),
                              {{"BLU_COMPILE_EXCLUDE", "gelu, matmul,rms_norm"}});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  expect_same_steps(read_metrics(dir.path / "eager"), read_metrics(dir.path / "excluded"), 4, "excluded");
  const std::string log = c.out + c.err;
  EXPECT_NE(log.find("excluded from compilation: gelu ("), std::string::npos) << log;
  EXPECT_NE(log.find("rms_norm (no op of that name in this step)"), std::string::npos) << log;
  EXPECT_NE(log.find("excluded temporaries"), std::string::npos) << log;
  // The flag replaces the environment's list.
  const LaunchResult f = run1(train_cmd("tiny", 2, "flag", {"--compile", "--compile-log", "--compile-exclude", "gelu"}),
                              {{"BLU_COMPILE_EXCLUDE", "matmul"}});
  ASSERT_EQ(f.status, 0) << f.out << f.err;
  EXPECT_NE(f.out.find("excluded from compilation: gelu ("), std::string::npos) << f.out;
  EXPECT_EQ(f.out.find("matmul ("), std::string::npos) << f.out;
  // A name that is no op at all is a typo: refused, naming where it came from, before any step.
  const LaunchResult typo =
      run1(train_cmd("tiny", 2, "typo", {"--compile", "--compile-exclude", "gelu,gelu_bwd"}));
  EXPECT_NE(typo.status, 0);
  EXPECT_NE((typo.out + typo.err).find("--compile-exclude: 'gelu_bwd' is not an op's name"), std::string::npos)
      << typo.out << typo.err;
  EXPECT_FALSE(fs::exists(dir.path / "typo" / "metrics.jsonl"));
  const LaunchResult env_typo =
      run1(train_cmd("tiny", 2, "env_typo", {"--compile"}), {{"BLU_COMPILE_EXCLUDE", "no_such_op"}});
  EXPECT_NE(env_typo.status, 0);
  EXPECT_NE((env_typo.out + env_typo.err).find("BLU_COMPILE_EXCLUDE: 'no_such_op' is not an op's name"),
            std::string::npos)
      << env_typo.out << env_typo.err;
  // bench and compile read the same flag (compile first needs the fusion plugin: a build with MLIR).
  for (const char* sub : {"bench", "compile"}) {
    std::vector<std::string> c = {blutrain().string(), sub, "--model", "tiny", "-B", "2", "-T", "16", "--device", "cpu",
                                  "--compile-exclude", "gelu_bwd"};
    if (std::string(sub) == "bench") c.insert(c.end(), {"--compile", "--steps", "2"});
    const LaunchResult r = run1(c);
    const std::string said = r.out + r.err;
    if (std::string(sub) == "compile" && said.find("needs the fusion pass") != std::string::npos) continue;
    EXPECT_NE(r.status, 0) << sub;
    EXPECT_NE(said.find("--compile-exclude: 'gelu_bwd' is not an op's name"), std::string::npos) << sub << ": " << said;
  }
}

TEST_F(CompileCli, UnsupportedLayoutsAreRefusedByName) {
  std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", "2", "--"};
  const auto t = train_cmd("tiny", 2, "pp", {"--parallel", "pipeline(2, schedule=1f1b, micro=2)", "--compile"});
  cmd.insert(cmd.end(), t.begin(), t.end());
  const LaunchResult pp = run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  EXPECT_NE(pp.status, 0);
  EXPECT_NE((pp.out + pp.err).find("--compile: pipeline layouts"), std::string::npos) << pp.out << pp.err;
  EXPECT_FALSE(fs::exists(dir.path / "pp" / "metrics.jsonl"));
  std::vector<std::string> z3 = {blutrain().string(), "launch", "-n", "2", "--"};
  const auto t3 = train_cmd("tiny", 2, "z3", {"--dp", "2", "--zero", "3", "--compile"});
  z3.insert(z3.end(), t3.begin(), t3.end());
  const LaunchResult zero3 = run_command(1, z3, {{"OMP_NUM_THREADS", "1"}});
  EXPECT_NE(zero3.status, 0);
  EXPECT_NE((zero3.out + zero3.err).find("--compile: ZeRO-3 (--zero 3) is not supported"), std::string::npos)
      << zero3.out << zero3.err;
  for (const char* flag : {"--compile-log", "--compile-check"}) {
    const LaunchResult alone = run1(train_cmd("tiny", 2, "alone", {flag}));
    EXPECT_NE(alone.status, 0) << flag;
    EXPECT_NE((alone.out + alone.err).find("--compile-log, --compile-exclude, --compile-remat and --compile-check need --compile"),
              std::string::npos)
        << flag << ": " << alone.out << alone.err;
  }
}

}  // namespace
}  // namespace blu::compiler
