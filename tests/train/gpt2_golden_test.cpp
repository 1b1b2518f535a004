// GPT-2 training on the CPU against recorded losses (tests/train/data/gpt2_golden_dccd299.json,
// written by this test with BLU_RECORD_GOLDEN=<file> at dccd299, where the CPU kernels' GELU tanh and
// softmax exp became vectorised: against the recording made before the model interface existed,
// at 1ccd84e, its losses moved by at most 5.6e-8 relative, its gradient norms by 1.4e-7, and the
// validation losses not at all): every step's loss and gradient norm, and the final validation
// loss, must be bit for bit the recorded ones. Three runs cover what a refactoring of the model, the
// trainer or the strategies could change: fp32 AdamW with dropout and gradient accumulation, bf16
// compute over fp32 master weights, and SGD with momentum.
// OpenBLAS picks its kernels by CPU at run time, and its kernel families round differently. Forced
// with OPENBLAS_CORETYPE on one AMD EPYC (Zen 5, AVX-512): the SkylakeX kernels give the dccd299
// recording bit for bit; the Haswell and Zen kernels give another, the same for both,
// gpt2_golden_8ef74fd_avx2.json (recorded with BLU_RECORD_GOLDEN by 8ef74fd's build on an AMD
// EPYC with AVX2, ~1e-9 relative from dccd299); the Sandybridge kernels a third, not recorded.
// A machine is held to the recording of the family its OpenBLAS core belongs to; a core outside
// both families (or another BLAS, whose core reads "unknown") is held to dccd299.
// OpenBLAS also rounds by its thread count: the recordings are of two threads, and one thread
// (OMP_NUM_THREADS=1 or OPENBLAS_NUM_THREADS=1, as the sanitizer runs set) moves the gradient
// norms by ~1e-9 relative from the first step. The test runs OpenBLAS on two threads whatever
// the environment or the machine's cores.
// So that a change which moves the numbers is re-recorded for both families, not only for the
// machine it was made on, Gpt2Golden.EveryKernelFamilyThisCpuRuns runs the test again in a child
// process under each family the CPU can execute.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <sys/wait.h>
#include <vector>

#include "blu/train/trainer.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

// OpenBLAS's (the CPU backend's BLAS); weak, so another BLAS links too (its core reads "unknown").
extern "C" __attribute__((weak)) char* openblas_get_corename(void);
extern "C" __attribute__((weak)) int openblas_get_num_threads(void);
extern "C" __attribute__((weak)) void openblas_set_num_threads(int);

namespace blu::train {
namespace {

using test::TempDir;

constexpr int64_t kVocab = 101;

std::string blas_core() { return openblas_get_corename ? openblas_get_corename() : "unknown"; }

// The recording of the kernel family `core` belongs to (see the header comment).
std::string golden_path(const std::string& core) {
  const std::string dir = std::string(BLU_TEST_DIR) + "/train/data/";
  if (core == "Haswell" || core == "Zen") return dir + "gpt2_golden_8ef74fd_avx2.json";
  return dir + "gpt2_golden_dccd299.json";
}

// The exact bits of a double, as text (JSON numbers would round-trip too, but hex says "bitwise").
std::string bits(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(u));
  return buf;
}

struct GoldenRun {
  const char* name;
  const char* precision;
  const char* optimizer;
  double dropout;
  int64_t grad_accum;
};

constexpr GoldenRun kRuns[] = {
    {"fp32_adamw_dropout_accum", "fp32", "adamw", 0.1, 2},
    {"bf16_adamw", "bf16", "adamw", 0.0, 1},
    {"fp32_sgd", "fp32", "sgd", 0.0, 1},
};

nlohmann::json train(const GoldenRun& r) {
  TempDir data, out;
  test_util::write_toy_shards(data.path(), kVocab, 4096, 16384);
  TrainOptions o = test_util::toy_run(data.path(), out.path() / "run", kVocab, r.precision);
  o.model["padded_vocab_size"] = 128;
  o.model["n_layer"] = 2;
  o.model["n_head"] = 3;
  o.model["n_embd"] = 48;
  o.model["block_size"] = 32;
  o.model["dropout"] = r.dropout;
  o.optimizer = r.optimizer;
  o.batch_size = 3;
  o.seq_len = 24;
  o.grad_accum = r.grad_accum;
  o.steps = 10;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.seed = 7;
  o.val_batches = 3;
  nlohmann::json steps = nlohmann::json::array();
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) { steps.push_back({bits(s.loss), bits(s.grad_norm)}); };
  Trainer t(o, cb);
  const TrainSummary sum = t.run();
  return {{"steps", steps}, {"val_loss", bits(sum.final_val_loss)}};
}

// OpenBLAS on `n` threads until the end of the scope (nothing without OpenBLAS).
class BlasThreads {
 public:
  explicit BlasThreads(int n) {
    if (!openblas_get_num_threads || !openblas_set_num_threads) return;
    before_ = openblas_get_num_threads();
    openblas_set_num_threads(n);
  }
  ~BlasThreads() {
    if (before_ > 0) openblas_set_num_threads(before_);
  }

 private:
  int before_ = 0;
};

TEST(Gpt2Golden, LossesMatchTheRecording) {
  nlohmann::json got;
  {
    const BlasThreads two(2);  // the recordings' (see the header comment)
    for (const GoldenRun& r : kRuns) got[r.name] = train(r);
  }
  if (const char* rec = std::getenv("BLU_RECORD_GOLDEN"); rec && *rec) {
    std::ofstream(rec) << got.dump(1) << "\n";
    GTEST_SKIP() << "recorded to " << rec;
  }
  const std::string path = golden_path(blas_core());
  std::cout << "held to " << path << " (OpenBLAS core " << blas_core() << ")\n";
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "cannot read " << path;
  const nlohmann::json want = nlohmann::json::parse(in);
  for (const GoldenRun& r : kRuns) {
    SCOPED_TRACE(r.name);
    ASSERT_TRUE(want.contains(r.name));
    const auto& w = want[r.name];
    const auto& g = got[r.name];
    ASSERT_EQ(g["steps"].size(), w["steps"].size());
    for (size_t i = 0; i < w["steps"].size(); ++i) {
      EXPECT_EQ(g["steps"][i][0], w["steps"][i][0]) << "loss at step " << i + 1;
      EXPECT_EQ(g["steps"][i][1], w["steps"][i][1]) << "gradient norm at step " << i + 1;
    }
    EXPECT_EQ(g["val_loss"], w["val_loss"]);
  }
}

// One OpenBLAS core of each recorded family, with the instructions its kernels need.
struct KernelFamily {
  const char* core;
  bool runs_here;
};

TEST(Gpt2Golden, EveryKernelFamilyThisCpuRuns) {
  if (!openblas_get_corename) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  if (std::getenv("BLU_RECORD_GOLDEN")) GTEST_SKIP() << "recording";
  const KernelFamily families[] = {
      {"SkylakeX", __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")},
      {"Haswell", __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
  };
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  int ran = 0;
  for (const KernelFamily& f : families) {
    if (!f.runs_here) continue;
    SCOPED_TRACE(f.core);
    ++ran;
    const std::string cmd = "OPENBLAS_CORETYPE=" + std::string(f.core) + " '" + self +
                            "' --gtest_filter=Gpt2Golden.LossesMatchTheRecording 2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr) << cmd;
    std::string out;
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    const int status = ::pclose(p);
    // The child must have run the family asked for, not a fallback OpenBLAS chose.
    EXPECT_NE(out.find("(OpenBLAS core " + std::string(f.core) + ")"), std::string::npos) << out;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  }
  if (ran == 0) GTEST_SKIP() << "this CPU runs neither recorded kernel family";
}

}  // namespace
}  // namespace blu::train
