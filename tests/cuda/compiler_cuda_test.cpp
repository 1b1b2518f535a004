// The compiled step on the GPU (compiler/runtime.h):
// - the tiny GPT-2 trained with SGD at a constant lr, compiled, replays each step as CUDA graph
//   launches only (one per segment of launches) over the fixed arena, and its losses and weights equal the eager run's bit
//   for bit (same kernels, same order);
// - the same with AdamW and an lr that changes every step: AdamW's step count and the lr are host
//   scalars passed to its kernels, so its launches run directly and the rest of the step is
//   replayed from graphs recorded by the first three compiled steps, never again (Note [Graph
//   segments], compiler/runtime.h) — still bitwise eager;
// - the memory plan's peak against the caching allocator's peak (bytes as requested) during a
//   replayed step, and against the device memory the driver reports in use (cudaMemGetInfo,
//   from a baseline taken after the CUDA context and cuBLAS exist): both within 3%.
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='CompilerCuda*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <sstream>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/core/exec_context.h"
#include "blu/dist/strategy.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/models/gpt2/gpt2.h"
#include "common/checks.h"
#include "common/plain_decoder.h"
#include "common/tiny_gpt.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::kGPU;

struct Result {
  std::vector<double> losses;
  std::vector<Tensor> params;  // on the CPU
  // Compiled: its variant's runtime counters, GEMM epilogue regions and recompute summary; the
  // steps compiled and the guard failures that fell back.
  compiler::RuntimeStats stats;
  int epilogues = 0;
  std::string remat;
  int64_t compiled_steps = 0, fallback = 0;
  std::string log;  // the compile log
  std::vector<std::string> guard_failures;
};

struct TrainRun {
  std::string optimizer = "sgd";
  std::function<double(int)> lr_of = [](int) { return 1e-2; };
  bool remat = false;
  DType compute = DType::f32;
  double dropout = 0.0;
  int steps = 6;
  // Step s's loss from the model and its batch; null: the strategy's own forward of the batch
  // (and then no guard may fail).
  std::function<Tensor(int s, models::GPT& model, const Tensor& idx, const Tensor& tg)> loss;
};

// `run.steps` steps of the tiny GPT-2, eager or compiled.
Result train(bool compiled, const TrainRun& run = {}) {
  cuda::Stream stream;
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
  models::GPTConfig cfg = test::tiny_gpt();
  cfg.dropout = run.dropout;
  models::GPT model(cfg, 7);
  model.to(kGPU);
  if (run.compute != DType::f32) model.set_compute_dtype(run.compute);
  dist::Strategy strat(model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.name = run.optimizer, .lr = 1e-2});
  const int64_t B = 2, T = 16;
  // One pair of input tensors, refilled every step: the graph's input addresses stay fixed.
  Tensor idx = empty({B, T}, DType::i32, kGPU), tg = empty({B, T}, DType::i32, kGPU);
  std::ostringstream log;
  compiler::CompileOptions o;
  o.log_stream = &log;
  o.log = true;
  o.remat = run.remat;
  compiler::CompiledStep cs(o);
  Result r;
  for (int s = 0; s < run.steps; ++s) {
    {
      NoGradGuard ng;
      copy_(idx, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
      copy_(tg, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
    }
    dist::StepValues v;
    const double lr = run.lr_of(s);
    auto step = [&] {
      if (run.loss)
        v = strat.step(1, [&](int64_t) { return run.loss(s, model, idx, tg); }, lr, 1.0);
      else
        v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, lr, 1.0);
    };
    if (compiled)
      cs.run({idx, tg}, step);
    else
      step();
    r.losses.push_back(strat.read(v, false).loss);
  }
  BLU_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  for (const Tensor& p : model.parameters()) r.params.push_back(to_device(p.detach(), kCPU));
  if (compiled) {
    if (!run.loss) {
      EXPECT_EQ(cs.counts().guard_failures, 0) << log.str();
    }
    for (const std::string& f : cs.guard_failures()) std::cout << "guard: " << f << "\n";
    EXPECT_EQ(cs.variants().size(), 1u);
    if (!cs.variants().empty()) {
      r.stats = cs.variants()[0]->runtime->stats();
      r.remat = cs.variants()[0]->remat;
      r.epilogues = cs.variants()[0]->epilogues;
    }
    r.compiled_steps = cs.counts().compiled;
    r.fallback = cs.counts().fallback;
    r.log = log.str();
    r.guard_failures = cs.guard_failures();
  }
  return r;
}

// Losses and parameters bit for bit.
void expect_bitwise(const Result& eager, const Result& compiled) {
  ASSERT_EQ(eager.losses.size(), compiled.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(eager.losses[i], compiled.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(eager.params[i], compiled.params[i])) << "parameter " << i;
}

TEST(CompilerCuda, CompiledStepIsGraphLaunchesAndMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  manual_seed(5);
  const Result eager = train(false);
  manual_seed(5);
  const Result compiled = train(true);
  const compiler::RuntimeStats& stats = compiled.stats;
  const int64_t n = compiled.compiled_steps;
  EXPECT_EQ(n, 5);  // step 1 is the eager warm-up
  // A GELU epilogue and a bias-gradient fold a layer (compiler/epilogue.h), the fold's kernel
  // summing in the weight gradient's own order: still bitwise eager.
  EXPECT_EQ(compiled.epilogues, 2 * test::tiny_gpt().n_layer);
  // Every launch in a graph: a step is one graph launch per segment of at most 64 launches.
  EXPECT_EQ(stats.direct_launches, 0);
  EXPECT_GE(stats.segments, 1);
  EXPECT_EQ(stats.graph_launches, n * stats.segments);
  EXPECT_GE(stats.steps_recorded, 1);
  EXPECT_LE(stats.steps_recorded, n);
  // Note [Speculative start]: every compiled step after the first launches its first segments
  // before its capture, and each capture confirms them (no launch twice).
  EXPECT_EQ(stats.speculated_steps, n - 1);
  EXPECT_GE(stats.speculated_segments, stats.speculated_steps);
  EXPECT_EQ(stats.speculation_misses, 0);
  // The compile log says how long the prefix is and where and why it ends.
  const size_t at = compiled.log.find("speculative start: ");
  ASSERT_NE(at, std::string::npos) << compiled.log;
  std::cout << compiled.log.substr(at, compiled.log.find('\n', at) - at) << "\n";
  EXPECT_EQ(compiled.log.find("speculative start: nothing"), std::string::npos) << compiled.log;
  expect_bitwise(eager, compiled);
}

TEST(CompilerCuda, AdamWWithAChangingLrRecordsTwiceAndMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const TrainRun run{.optimizer = "adamw", .lr_of = [](int s) { return 3e-3 * (1.0 - 0.1 * s); }};
  manual_seed(5);
  const Result eager = train(false, run);
  manual_seed(5);
  const Result compiled = train(true, run);
  const compiler::RuntimeStats& stats = compiled.stats;
  const int64_t n = compiled.compiled_steps;
  EXPECT_EQ(n, 5);
  // The step count and the lr change every step: the second compiled step records the segment
  // that holds AdamW's launches again, and from the third on they run directly and the graphs
  // around them are replayed as recorded.
  std::cout << "graph launches " << stats.graph_launches << ", direct launches " << stats.direct_launches
            << ", segments " << stats.segments << ", recordings " << stats.graph_captures << " in "
            << stats.steps_recorded << " steps\n";
  EXPECT_LE(stats.steps_recorded, 3);
  EXPECT_GT(stats.direct_launches, 0);
  EXPECT_EQ(stats.direct_launches % (n - 2), 0);
  EXPECT_GE(stats.segments, 1);
  expect_bitwise(eager, compiled);
}

// Note [Speculative start] when the prefix launched before the capture is wrong: with dropout,
// the second streamed step's prefix holds the dropout launches recorded with the previous step's
// Philox offsets (a miss: the confirmed segments run again, the rest as recorded anew, and from
// then on the prefix ends before the first dropout); and a step whose capture leaves the compiled
// structure at its first op (a copy of the tokens, step 6) or between forward and backward (step
// 8, the loss times 1) — what ran ahead of the capture was only the arena's, and the step runs
// unplanned. Every run is bitwise the eager one.
TEST(CompilerCuda, SpeculativeStartMissesAndDivergencesMatchEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const bool diverge : {false, true}) {
    SCOPED_TRACE(diverge ? "diverging steps" : "dropout");
    TrainRun run{.optimizer = "adamw", .lr_of = [](int) { return 3e-3; }, .dropout = diverge ? 0.0 : 0.1, .steps = 9};
    run.loss = [diverge](int s, models::GPT& model, const Tensor& idx, const Tensor& tg) {
      const Tensor tokens = diverge && s == 5 ? clone(idx) : idx;
      Tensor loss = model.forward(tokens, tg).loss;
      return diverge && s == 7 ? mul(loss, 1.0) : loss;
    };
    manual_seed(11);
    const Result eager = train(false, run);
    manual_seed(11);
    const Result compiled = train(true, run);
    const compiler::RuntimeStats& st = compiled.stats;
    std::cout << "speculated steps " << st.speculated_steps << " (" << st.speculated_segments << " segments), misses "
              << st.speculation_misses << ", fallbacks " << compiled.fallback << "\n";
    if (diverge) {
      EXPECT_EQ(compiled.fallback, 2);
      // Step 6 leaves at its first op, with the prefix launched and not confirmed; step 8 after it.
      ASSERT_EQ(compiled.guard_failures.size(), 2u);
      EXPECT_NE(compiled.guard_failures[0].find("unconfirmed: the whole step runs unplanned"), std::string::npos)
          << compiled.guard_failures[0];
      EXPECT_NE(compiled.guard_failures[1].find("of its launches had run, the rest runs unplanned"), std::string::npos)
          << compiled.guard_failures[1];
      EXPECT_EQ(st.speculation_misses, 0);
      EXPECT_EQ(st.speculated_steps, 5);  // steps 3-9 but the two after a fallback's
    } else {
      EXPECT_EQ(compiled.fallback, 0);
      EXPECT_EQ(st.speculation_misses, 1);
      EXPECT_EQ(st.speculated_steps, 7);  // steps 3-9
    }
    expect_bitwise(eager, compiled);
  }
}

// GEMM epilogues chosen by the compiler (compiler/epilogue.h) on the GPU: the plain decoder's
// residual and bias adds run as cuBLASLt epilogues inside the recorded graphs; its losses equal
// eager's within fp32 rounding, and the check mode (which replays without graphs) reports both
// regions at rounding level against their eager ops.
std::vector<double> train_plain(compiler::CompiledStep* cs, test::PlainDecoderSize size = {},
                                DType dtype = DType::f32) {
  cuda::Stream stream;
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
  test::PlainDecoder m(11, kGPU, size, dtype);
  Tensor idx = empty({m.n.B, m.n.T}, DType::i32, kGPU), tg = empty({m.n.B, m.n.T}, DType::i32, kGPU);
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) {
    {
      NoGradGuard ng;
      copy_(idx, to_device(m.batch(s).first, kGPU));
      copy_(tg, to_device(m.batch(s).second, kGPU));
    }
    Tensor loss;
    auto one = [&] { loss = m.step(idx, tg, 0.1); };
    if (cs)
      cs->run({idx, tg}, one);
    else
      one();
    losses.push_back(to_device(loss, kCPU).item());
  }
  return losses;
}

TEST(CompilerCuda, GemmEpiloguesMatchEagerAndCheck) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<double> eager = train_plain(nullptr);
  std::ostringstream log;
  compiler::CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  compiler::CompiledStep cs(o);
  const std::vector<double> compiled = train_plain(&cs);
  ASSERT_EQ(cs.variants().size(), 1u) << log.str();
  EXPECT_EQ(cs.variants()[0]->epilogues, 2) << log.str();
  EXPECT_GT(cs.variants()[0]->runtime->stats().graph_launches, 0);
  for (size_t i = 0; i < eager.size(); ++i)
    EXPECT_NEAR(compiled[i], eager[i], 1e-5 * std::abs(eager[i])) << "step " << i + 1;
  compiler::CompileOptions c;
  c.check = true;
  c.log_stream = &log;
  compiler::CompiledStep checked(c);
  const std::vector<double> again = train_plain(&checked);
  ASSERT_EQ(checked.region_checks().size(), 2u) << log.str();
  for (const compiler::RegionCheck& rc : checked.region_checks()) {
    std::cout << "check: region " << rc.region << " (" << rc.ops << "): max |diff| " << rc.max_diff << "\n";
    EXPECT_TRUE(std::isfinite(rc.max_diff)) << rc.ops;
    EXPECT_LT(rc.max_diff, 1e-4) << rc.ops;
  }
  EXPECT_EQ(again, compiled);
}

// The GELU epilogue on the GPU: in bf16 one GEMM (cuBLASLt's GELU_AUX_BIAS) writes the GELU and
// the product, which the GELU's gradient reads; the GELU of the unrounded sum differs from eager's
// GELU of the rounded product by rounding (the check mode reports it per region). In fp32 the
// region runs eager's two kernels: with the residual fold excluded, bitwise eager.
TEST(CompilerCuda, GeluEpilogueMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const test::PlainDecoderSize size{.C = 32, .layers = 2, .gelu = true};
  {
    const std::vector<double> eager = train_plain(nullptr, size, DType::bf16);
    std::ostringstream log;
    compiler::CompileOptions c;
    c.check = true;
    c.log_stream = &log;
    compiler::CompiledStep checked(c);
    const std::vector<double> compiled = train_plain(&checked, size, DType::bf16);
    ASSERT_EQ(checked.variants().size(), 1u) << log.str();
    EXPECT_EQ(checked.variants()[0]->epilogues, 4) << log.str();
    int gelus = 0;
    for (const compiler::RegionCheck& rc : checked.region_checks()) {
      std::cout << "bf16 check: region " << rc.region << " (" << rc.ops << "): max |diff| " << rc.max_diff << "\n";
      gelus += rc.ops.find("gelu") != std::string::npos;
      EXPECT_LT(rc.max_diff, 0.07) << rc.ops;  // a few bf16 ulps of values up to ~4
    }
    EXPECT_EQ(gelus, 2);
    for (size_t i = 0; i < eager.size(); ++i)
      EXPECT_NEAR(compiled[i], eager[i], 2e-2 * std::abs(eager[i])) << "bf16 step " << i + 1;
  }
  {
    const std::vector<double> eager = train_plain(nullptr, size, DType::f32);
    std::ostringstream log;
    compiler::CompileOptions o;
    o.log_stream = &log;
    compiler::set_excluded_ops({"add"});
    compiler::CompiledStep cs(o);
    const std::vector<double> compiled = train_plain(&cs, size, DType::f32);
    compiler::set_excluded_ops({});
    ASSERT_EQ(cs.variants().size(), 1u) << log.str();
    EXPECT_EQ(cs.variants()[0]->epilogues, 2) << log.str();
    EXPECT_EQ(compiled, eager);
    // The excluded adds' outputs live outside the arena, each freed after its last launch (those
    // launches run outside the CUDA graphs), every compiled step.
    const compiler::Runtime& rt = *cs.variants()[0]->runtime;
    EXPECT_GT(rt.plan().excluded_buffers, 0) << log.str();
    EXPECT_EQ(rt.stats().released, rt.plan().excluded_buffers * rt.stats().steps) << log.str();
    EXPECT_GT(rt.stats().direct_launches, 0);
    EXPECT_GT(rt.stats().graph_launches, 0);
  }
}

// The compiler's own recompute (compiler/remat.h) on the GPU, replayed from CUDA graphs with
// AdamW and a changing lr: fp32 bitwise eager (the recompute runs the same kernel on the same
// inputs); bf16 — whose attention backward accumulates with atomics, so two eager runs differ in
// the last bits — within 1e-2 of the eager losses.
TEST(CompilerCuda, RecomputeChosenByTheCompilerMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const auto lr_of = [](int s) { return 3e-3 * (1.0 - 0.1 * s); };
  for (DType compute : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(compute));
    manual_seed(5);
    const Result eager = train(false, TrainRun{.optimizer = "adamw", .lr_of = lr_of, .compute = compute});
    manual_seed(5);
    const Result compiled = train(true, TrainRun{.optimizer = "adamw", .lr_of = lr_of, .remat = true, .compute = compute});
    const std::string& summary = compiled.remat;
    std::cout << dtype_name(compute) << ": " << summary << "\n";
    EXPECT_EQ(compiled.compiled_steps, 5);
    EXPECT_NE(summary.find("buffers recomputed"), std::string::npos);
    EXPECT_EQ(summary.find("0 buffers"), std::string::npos) << summary;
    for (size_t i = 0; i < eager.losses.size(); ++i) {
      if (compute == DType::f32)
        EXPECT_EQ(eager.losses[i], compiled.losses[i]) << "step " << i + 1;
      else
        EXPECT_NEAR(eager.losses[i], compiled.losses[i], 1e-2) << "step " << i + 1;
    }
    if (compute == DType::f32) {
      for (size_t i = 0; i < eager.params.size(); ++i)
        EXPECT_TRUE(test::bitwise_equal(eager.params[i], compiled.params[i])) << "parameter " << i;
    }
  }
}

size_t device_used_bytes() {
  size_t free = 0, total = 0;
  BLU_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total - free;
}

// Note [Plan against the device]: GPT-2 d12 at B=4, T=256, AdamW. The baseline is taken after the
// CUDA context, the stream and cuBLAS exist (a matmul ran, in a workspace of its own that is gone
// by then, so the step's workspace is counted on both sides) and the cache is empty; the model,
// the optimizer state and the eager warm-up step follow; after the first compiled step the cache is
// emptied (what the eager warm-up left cached goes back), and the next compiled step is measured.
// What the step holds then is the plan (arena, held buffers, step outputs) plus the context's
// workspace; the allocator rounds every block (512 B, large segments to 2 MiB) and the driver adds
// the CUDA graph's own memory — the 3% bound is what the issue asks of the plan.
TEST(CompilerCuda, PlanPeakWithinThreePercentOfTheAllocatorAndTheDevice) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  cuda::Stream stream;
  {
    Workspace first(kGPU);
    ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &first});
    const Tensor a = randn({256, 256}, DType::f32, kGPU);
    (void)to_vector(sum(matmul(a, a)));  // cuBLAS and its handle exist
  }
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::empty_cache();
  const size_t used0 = device_used_bytes();
  models::GPTConfig cfg = models::GPTConfig::preset("d12");
  cfg.block_size = 256;
  models::GPT model(cfg, 7);
  model.to(kGPU);
  dist::Strategy strat(model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-4});
  const int64_t B = 4, T = 256;
  Tensor idx = empty({B, T}, DType::i32, kGPU), tg = empty({B, T}, DType::i32, kGPU);
  compiler::CompiledStep cs;
  cs.set_named(compiler::BufferKind::parameter, model.named_parameters());
  Allocator& alloc = allocator_for(kGPU);
  int64_t alloc_peak = 0;
  size_t device_used = 0;
  for (int s = 0; s < 4; ++s) {
    {
      NoGradGuard ng;
      copy_(idx, to_device(randint(0, cfg.vocab_size, {B, T}, DType::i32, kCPU), kGPU));
      copy_(tg, to_device(randint(0, cfg.vocab_size, {B, T}, DType::i32, kCPU), kGPU));
    }
    if (s == 3) {
      BLU_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      cuda::empty_cache();
      alloc.reset_peak();
    }
    dist::StepValues v;
    cs.run({idx, tg}, [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 3e-4, 1.0); });
    if (s == 3) {
      BLU_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      alloc_peak = alloc.stats().peak_bytes;
      device_used = device_used_bytes() - used0;
    }
    (void)strat.read(v, false);
  }
  ASSERT_EQ(cs.counts().compiled, 3);
  const compiler::MemoryPlan& plan = cs.variants()[0]->runtime->plan();
  const double expected = double(plan.peak_bytes() + ws.capacity());
  const double alloc_ratio = double(alloc_peak) / expected, device_ratio = double(device_used) / expected;
  std::cout << "plan: " << plan.summary() << " + workspace " << compiler::format_bytes(ws.capacity())
            << "\ncaching allocator peak (requested) " << compiler::format_bytes(size_t(alloc_peak)) << ", ratio "
            << alloc_ratio << "; reserved " << compiler::format_bytes(size_t(alloc.stats().reserved_bytes))
            << "\ndevice in use over the baseline " << compiler::format_bytes(device_used) << ", ratio "
            << device_ratio << std::endl;
  EXPECT_NEAR(alloc_ratio, 1.0, 0.03) << plan.summary();
  // What the driver reports: 1.026 of the plan and the workspace on an H200 (2026-12-01). It holds
  // because the held buffers leave no slack in the allocator's segments: AdamW's moments are one allocation
  // each (Note [Optimizer state in one buffer]), mid-size tensors (the parameters, the gradients)
  // share 20 MiB segments (Note [Caching allocator]), and the arena has a segment of its own.
  EXPECT_NEAR(device_ratio, 1.0, 0.03) << plan.summary();
}

}  // namespace
}  // namespace blu
