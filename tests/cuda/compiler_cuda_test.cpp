// The compiled step on the GPU (compiler/runtime.h): the tiny GPT-2 trained with SGD at a constant
// lr, compiled, replays each step as exactly one CUDA graph launch over the fixed arena, and its
// losses and weights equal the eager run's bit for bit (same kernels, same order).
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='CompilerCuda*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <sstream>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/core/exec_context.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "common/checks.h"
#include "common/tiny_gpt.h"

namespace blu {
namespace {

const Device kGPU("cuda:0");

struct Result {
  std::vector<double> losses;
  std::vector<Tensor> params;  // on the CPU
};

Result train(bool compiled, compiler::RuntimeStats* stats, int64_t* compiled_steps) {
  cuda::Stream stream;
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
  models::GPT model(test::tiny_gpt(), 7);
  model.to(kGPU);
  dist::Strategy strat(model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.name = "sgd", .lr = 1e-2});
  const int64_t B = 2, T = 16;
  // One pair of input tensors, refilled every step: the graph's input addresses stay fixed.
  Tensor idx = empty({B, T}, DType::i32, kGPU), tg = empty({B, T}, DType::i32, kGPU);
  std::ostringstream log;
  compiler::CompileOptions o;
  o.log_stream = &log;
  compiler::CompiledStep cs(o);
  Result r;
  for (int s = 0; s < 6; ++s) {
    {
      NoGradGuard ng;
      copy_(idx, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
      copy_(tg, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
    }
    dist::StepValues v;
    auto step = [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-2, 1.0); };
    if (compiled)
      cs.run({idx, tg}, step);
    else
      step();
    r.losses.push_back(strat.read(v, false).loss);
  }
  BLU_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  for (const Tensor& p : model.parameters()) r.params.push_back(to_device(p.detach(), kCPU));
  if (compiled) {
    EXPECT_EQ(cs.counts().guard_failures, 0) << log.str();
    EXPECT_EQ(cs.variants().size(), 1u);
    if (!cs.variants().empty()) *stats = cs.variants()[0]->runtime->stats();
    *compiled_steps = cs.counts().compiled;
  }
  return r;
}

TEST(CompilerCuda, CompiledStepIsOneGraphLaunchAndMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  manual_seed(5);
  compiler::RuntimeStats unused;
  int64_t n0 = 0;
  const Result eager = train(false, &unused, &n0);
  manual_seed(5);
  compiler::RuntimeStats stats;
  int64_t n = 0;
  const Result compiled = train(true, &stats, &n);
  EXPECT_EQ(n, 5);  // step 1 is the eager warm-up
  EXPECT_EQ(stats.graph_launches, n) << "each compiled step is one cudaGraphLaunch";
  EXPECT_GE(stats.graph_captures, 1);
  EXPECT_LE(stats.graph_captures, n);
  ASSERT_EQ(eager.losses.size(), compiled.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(eager.losses[i], compiled.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(eager.params[i], compiled.params[i])) << "parameter " << i;
}

}  // namespace
}  // namespace blu
