// Offload of AdamW's state on the CPU build, with the "device" a budgeted pool cpu:1 separate from
// the host (memory/device_pool.h): the threaded host AdamW against the reference kernel bit for
// bit; the pool's budget and its out-of-memory report by category; training with the state
// offloaded (update on the host, and streamed through the device in chunks) giving the plain run's
// losses and weights bit for bit, fp32 and bf16; the pool's peak against the plan; the planner's
// early error when nothing fits; exact resume of an offloaded run.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <random>
#include <sstream>
#include <vector>

#include "blu/core/exec_context.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/strategy.h"
#include "blu/memory/device_pool.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/offload/host_adamw.h"
#include "blu/offload/plan.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/train/run_record.h"
#include "blu/train/trainer.h"
#include "common/checks.h"
#include "common/tiny_gpt.h"
#include "data/data_test_util.h"
#include "offload/overlap_run.h"
#include "train/train_test_util.h"

namespace blu::offload {
namespace {

using test::TempDir;

Tensor random_tensor(int64_t n, std::mt19937& rng, float scale) {
  Tensor t = empty({n}, DType::f32, kCPU);
  std::normal_distribution<float> d(0.f, scale);
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = d(rng);
  return t;
}

Tensor copy_of(const Tensor& t) {
  Tensor c = empty(t.shape(), t.dtype(), t.device());
  std::memcpy(c.raw_data(), t.raw_data(), t.nbytes());
  return c;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// Fresh random parameters, gradients and moments; three steps of the host AdamW and of the
// reference kernel (adamw_step_ on the CPU), compared byte for byte, with each compute-copy dtype
// and with the gradient clipped by a gate.
void check_host_adamw(DType copy_dtype, bool with_copy, double max_norm) {
  std::mt19937 rng(7);
  const int64_t n = 100003;  // several chunks and a ragged tail
  Tensor p = random_tensor(n, rng, 1.f), m = random_tensor(n, rng, 0.01f);
  Tensor v = random_tensor(n, rng, 0.01f);
  for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);
  Tensor p2 = copy_of(p), m2 = copy_of(m), v2 = copy_of(v);
  Tensor c = with_copy ? empty({n}, copy_dtype, kCPU) : Tensor();
  Tensor c2 = with_copy ? empty({n}, copy_dtype, kCPU) : Tensor();
  NoGradGuard no_grad;
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor g = random_tensor(n, rng, 0.5f);
    const Tensor total = sum_squares({g});
    const NormGate gate{total, max_norm};
    adamw_step_({{p, g, m, v, c}}, {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step},
                gate);
    const auto k = AdamWCoefficients::make(3e-3, 0.9, 0.95, 1e-8, 0.1, step);
    const auto d = GateDecision::from_total(*total.data<double>(), max_norm);
    adamw_host_update(p2.data<float>(), g.data<float>(), m2.data<float>(), v2.data<float>(),
                      with_copy ? static_cast<uint16_t*>(c2.raw_data()) : nullptr, copy_dtype, n, k, d, 2);
    ASSERT_TRUE(same_bytes(p, p2)) << "parameters differ at step " << step;
    ASSERT_TRUE(same_bytes(m, m2)) << "exp_avg differs at step " << step;
    ASSERT_TRUE(same_bytes(v, v2)) << "exp_avg_sq differs at step " << step;
    if (with_copy) {
      ASSERT_TRUE(same_bytes(c, c2)) << "compute copy differs at step " << step;
    }
  }
}

TEST(HostAdamW, MatchesReferenceKernelBitwise) { check_host_adamw(DType::bf16, false, INFINITY); }
TEST(HostAdamW, MatchesReferenceKernelBitwiseBf16Copy) { check_host_adamw(DType::bf16, true, INFINITY); }
TEST(HostAdamW, MatchesReferenceKernelBitwiseF16CopyClipped) { check_host_adamw(DType::f16, true, 0.5); }

// The host's gradient accumulation and sum of squares (gradients on the host): the add rounds as
// one fp32 add per element, and the sum does not depend on the number of threads. Fresh random
// data over several chunks, checked against a scalar loop and a long double sum.
TEST(HostAdamW, AccumulationAndSumOfSquaresAreThreadIndependent) {
  const int64_t n = 300000;  // five chunks, the last partial
  const Tensor a = randn({n}, DType::f32), b = randn({n}, DType::f32);
  std::vector<float> acc(a.data<float>(), a.data<float>() + n), want(acc);
  for (int64_t i = 0; i < n; ++i) want[size_t(i)] = want[size_t(i)] + b.data<float>()[i];
  add_host(acc.data(), b.data<float>(), n, 3);
  EXPECT_EQ(std::memcmp(acc.data(), want.data(), size_t(n) * sizeof(float)), 0);
  const double one = sum_squares_host(acc.data(), n, 1), three = sum_squares_host(acc.data(), n, 3);
  EXPECT_EQ(std::memcmp(&one, &three, sizeof(double)), 0);
  long double exact = 0;  // the higher-precision reference
  for (float x : acc) exact += (long double)x * (long double)x;
  EXPECT_NEAR(one, double(exact), 1e-12 * double(exact));
}

TEST(HostAdamW, NonFiniteGateSkips) {
  const auto d = GateDecision::from_total(INFINITY, 1.0);
  EXPECT_TRUE(d.skip);
  std::vector<float> p{1.f}, g{1.f}, m{0.f}, v{0.f};
  adamw_host_update(p.data(), g.data(), m.data(), v.data(), nullptr, DType::bf16, 1,
                    AdamWCoefficients::make(1e-3, 0.9, 0.95, 1e-8, 0.1, 1), d);
  EXPECT_EQ(p[0], 1.f);
  EXPECT_EQ(m[0], 0.f);
}

TEST(DevicePool, SeparateFromHostAndBudgeted) {
  DevicePool& pool = device_pool(3);
  pool.set_budget(0);
  const int64_t host_before = cpu_allocator().stats().current_bytes;
  const int64_t before = pool.stats().current_bytes;
  {
    Tensor a = empty({1000}, DType::f32, Device("cpu:3"));
    EXPECT_EQ(a.device(), Device(DeviceType::cpu, 3));
    EXPECT_EQ(pool.stats().current_bytes - before, 4032);  // 4000 rounded up to 64
    EXPECT_EQ(cpu_allocator().stats().current_bytes, host_before);
    Tensor h = to_device(a, kCPU);  // an explicit copy across
    EXPECT_EQ(h.device(), kCPU);
    test::expect_error([&] { add(a, h); }, {"different devices", "cpu:3"});
  }
  EXPECT_EQ(pool.stats().current_bytes, before);
}

TEST(DevicePool, OutOfMemoryNamesCategoriesAndWhatFits) {
  DevicePool& pool = device_pool(4);
  const Device dev("cpu:4");
  pool.set_budget(1 << 20);  // 1 MiB
  Tensor w = empty({64 * 1024}, DType::f32, dev);  // 256 KiB
  tag_memory(w, MemoryCategory::parameters, "h.0.mlp.c_fc.weight");
  Tensor m = empty({96 * 1024}, DType::f32, dev);  // 384 KiB
  tag_memory(m, MemoryCategory::optimizer_state, "exp_avg.h.0.mlp.c_fc.weight");
  Tensor a = empty({32 * 1024}, DType::f32, dev);  // 128 KiB, untagged: activations
  try {
    Tensor big = empty({128 * 1024}, DType::f32, dev);  // 512 KiB: over the budget
    FAIL() << "allocated past the budget";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    for (const char* want : {"cpu:4: out of memory", "parameters: 256.00 KiB", "optimizer state: 384.00 KiB",
                             "activations: 128.00 KiB", "largest live tensors", "exp_avg.h.0.mlp.c_fc.weight",
                             "--gpu-memory-budget", "--offload-state optimizer", "enough for this request"})
      EXPECT_NE(msg.find(want), std::string::npos) << "missing '" << want << "' in:\n" << msg;
    EXPECT_EQ(e.report().by_category[size_t(MemoryCategory::optimizer_state)], 384 * 1024);
    EXPECT_EQ(e.report().largest.front().tag.label, "exp_avg.h.0.mlp.c_fc.weight");
  }
  pool.set_budget(0);
  Tensor fits = empty({128 * 1024}, DType::f32, dev);  // no budget: fits
}

// --- training on the device pool ---

constexpr int64_t kVocab = 256;

train::TrainOptions pool_run(const TempDir& data, const std::filesystem::path& out, const std::string& precision,
                             int64_t vocab = kVocab) {
  train::TrainOptions o = train::test_util::pool_run(data.path(), out, vocab, precision);
  o.offload_chunk = 3000;  // several chunks, pieces split across parameters
  return o;
}

using RunResult = train::test_util::PoolRunResult;
// stop_at > 0: stopped after that step the way Ctrl-C stops the CLI (flag → checkpoint).
RunResult run(const train::TrainOptions& o, int64_t stop_at = 0) { return train::test_util::run_on_pool(o, stop_at); }

void expect_same_run(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)), 0)
        << "step " << i + 1 << ": " << a.losses[i] << " vs " << b.losses[i];
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i)
    EXPECT_EQ(std::memcmp(a.weights[i].data(), b.weights[i].data(), a.weights[i].size() * sizeof(double)), 0)
        << "tensor " << i;
}

void check_offload_matches_plain(const std::string& precision) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult plain = run(pool_run(data, "", precision));
  ASSERT_EQ(plain.losses.size(), 8u);
  EXPECT_LT(plain.losses.back(), plain.losses.front());  // the run learns
  for (const char* update : {"cpu", "gpu"}) {
    SCOPED_TRACE(std::string("--offload-update ") + update);
    train::TrainOptions o = pool_run(data, "", precision);
    o.offload_state = "optimizer";
    o.offload_update = update;
    const RunResult off = run(o);
    ASSERT_TRUE(off.plan && off.plan->offload_state) << off.log;
    EXPECT_EQ(update_name(off.plan->update), std::string(update));
    expect_same_run(plain, off);
    // The state left the device: the pool's peak dropped by about the moments' 8 bytes per parameter.
    EXPECT_LT(off.pool_peak, plain.pool_peak);
    EXPECT_NE(off.log.find("memory plan: optimizer state on the host"), std::string::npos) << off.log;
  }
}

TEST(Offload, TrainsLikePlainRunBitwiseFp32) { check_offload_matches_plain("fp32"); }
TEST(Offload, TrainsLikePlainRunBitwiseBf16) { check_offload_matches_plain("bf16"); }

// The training steps' peak against the plan, with gradient accumulation (pool_run: 2 micro-batches,
// so the second runs beside the first's gradients: the probe runs both).
TEST(Offload, OffloadedPeakWithinFivePercentOfPlan) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    train::TrainOptions o = pool_run(data, "", precision);
    o.offload_state = "optimizer";
    const RunResult r = run(o);
    ASSERT_TRUE(r.plan);
    EXPECT_NEAR(double(r.step_peak), double(r.plan->device_peak_bytes), 0.05 * double(r.plan->device_peak_bytes)) << r.log;
    std::printf("%s, state offloaded: planned %lld, steps' peak %lld bytes\n", precision,
                (long long)r.plan->device_peak_bytes, (long long)r.step_peak);
  }
}

// The predicted step with the host update behind the next forward: compute + update, less the
// first micro-batch's forward (a third of its forward and backward) or the update, the smaller —
// not under ZeRO (state_shards > 1) or when the overlap is off.
TEST(Offload, PlanHidesTheFirstForwardOfTheHostUpdate) {
  PlanInput in;
  in.param_elements = 100'000'000;
  in.compute_copy_bytes = 2;
  in.offload_state = "master";
  in.offload_update = "cpu";
  in.micro_batches = 2;
  in.compute_seconds = 0.6;
  in.host_adamw_elements_per_s = 1e9;  // 100 ms of update
  in.transfer_bytes_per_s = 1e11;
  in.offload.overlap_forward = true;  // --offload-overlap
  MemoryPlan p = plan_memory(in);
  ASSERT_TRUE(p.masters_on_host && p.update == UpdateOn::cpu) << p.text;
  EXPECT_DOUBLE_EQ(p.update_seconds, 0.1);
  EXPECT_DOUBLE_EQ(p.hidden_update_seconds, 0.1);  // 0.6 / 2 / 3 = 0.1 of forward
  EXPECT_DOUBLE_EQ(p.step_seconds, 0.6);
  EXPECT_NE(p.text.find("100 ms of it behind the next step's first forward"), std::string::npos) << p.text;
  in.micro_batches = 8;  // 25 ms of forward hide 25 of the 100
  p = plan_memory(in);
  EXPECT_DOUBLE_EQ(p.hidden_update_seconds, 0.025);
  EXPECT_DOUBLE_EQ(p.step_seconds, 0.675);
  in.offload.overlap_forward = false;
  p = plan_memory(in);
  EXPECT_EQ(p.hidden_update_seconds, 0);
  EXPECT_DOUBLE_EQ(p.step_seconds, 0.7);
  EXPECT_EQ(p.text.find("behind"), std::string::npos) << p.text;
}

// The compiler's recompute (ActivationPlan::compiled_saving) lowers the compiled steps' peak; the
// first step runs eager before AdamW has made its moments (8 bytes per element), with every
// activation or, probed apart, with the warm-up's, so the plan's peak is the larger of the two, and
// a budget is checked against it.
TEST(Offload, PlanCountsTheCompilersRecomputeAndTheFirstEagerStep) {
  PlanInput in;
  in.param_elements = 1000;  // fp32: 4 bytes of parameter and 8 of moments each; the probe counts the gradients
  in.grads_in_activations = true;
  in.offload_state = "none";
  in.activations.device_bytes = 10'000;
  EXPECT_EQ(plan_memory(in).device_peak_bytes, 22'000);
  in.activations.compiled_saving = 3'000;  // compiled 19,000; first step 4,000 + 10,000
  MemoryPlan p = plan_memory(in);
  EXPECT_EQ(p.device_peak_bytes, 19'000) << p.text;
  EXPECT_NE(p.text.find("compiled steps: 9.77 KiB of activations eager, less 2.93 KiB the compiler recomputes, plus "
                        "0 B of the arena's packing"),
            std::string::npos)
      << p.text;
  in.activations.compiled_saving = 9'000;  // compiled 13,000: the first step's 14,000 binds
  EXPECT_EQ(plan_memory(in).device_peak_bytes, 14'000);
  in.device_budget = 13'999;
  test::expect_error([&] { plan_memory(in); }, {"9.77 KiB activations eager, 1000 B compiled",
                                                "the smallest device budget that fits is 13.67 KiB"});
  // The arena's packing gaps add to the compiled steps: 13,000 + 2,000 now binds.
  in.activations.compiled_excess = 2'000;
  in.device_budget = 0;
  EXPECT_EQ(plan_memory(in).device_peak_bytes, 15'000);
  in.activations.compiled_excess = 0;
  // Headroom (on a GPU, 2% of the budget kept free): 14,000 bytes need a budget of 14,286.
  in.device_headroom = 0.02;
  in.device_budget = 14'285;
  test::expect_error([&] { plan_memory(in); }, {"(2% of it kept free)", "fits is 13.95 KiB"});
  in.device_budget = 14'286;
  p = plan_memory(in);
  EXPECT_EQ(p.device_peak_bytes, 14'000);
  EXPECT_NE(p.text.find("2% of it kept free"), std::string::npos) << p.text;
  // The warm-up probed apart, every block recomputed (Note [The warm-up step recomputes every
  // block]): the first step needs 4,000 + 2,000, below the compiled steps' 13,000, which bind.
  in.device_headroom = 0;
  in.device_budget = 0;
  in.activations.warmup_bytes = 2'000;
  p = plan_memory(in);
  EXPECT_EQ(p.device_peak_bytes, 13'000);
  EXPECT_NE(p.text.find("the first step runs eager with every block recomputed (1.95 KiB of activations), before the "
                        "optimizer state is made, at 5.86 KiB"),
            std::string::npos)
      << p.text;
}

TEST(Offload, PlanKeepsStateOnDeviceWhenItFitsAndPredictsPeak) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  train::TrainOptions o = pool_run(data, "", "fp32");
  o.gpu_memory_budget = 1.0;  // plenty
  const RunResult r = run(o);
  ASSERT_TRUE(r.plan);
  EXPECT_FALSE(r.plan->offload_state) << r.log;
  EXPECT_EQ(r.plan->device_bytes_per_param, 12.0);  // parameters and moments; gradients counted with activations
  EXPECT_NEAR(double(r.step_peak), double(r.plan->device_peak_bytes), 0.05 * double(r.plan->device_peak_bytes)) << r.log;
  std::printf("state on the device: planned %lld, steps' peak %lld bytes\n", (long long)r.plan->device_peak_bytes,
              (long long)r.step_peak);
}

// A training step that runs out of the device pool: parameters (and their compute copies),
// gradients and AdamW's moments are counted as such, not as activations, and the message names the
// offload layouts.
TEST(Offload, OutOfMemoryInTrainingCountsParametersAndGradients) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  train::TrainOptions o = pool_run(data, "", "bf16");
  o.steps = 1;
  const RunResult full = run(o);  // the step's peak without a budget
  device_pool(1).set_budget(0);
  train::Trainer t(o, {});
  const int64_t live = device_pool(1).stats().current_bytes;
  int64_t params = 0;
  for (const Tensor& p : t.model().parameters()) params += int64_t(p.nbytes());
  ASSERT_LT(live, full.step_peak);
  device_pool(1).set_budget(live + (full.step_peak - live) * 95 / 100);  // short at the first update
  try {
    t.run();
    device_pool(1).set_budget(0);
    FAIL() << "trained within a budget below its peak";
  } catch (const OutOfMemoryError& e) {
    device_pool(1).set_budget(0);
    const MemoryReport& r = e.report();
    EXPECT_GE(r.by_category[size_t(MemoryCategory::parameters)], params) << e.what();  // fp32 and copies
    EXPECT_GT(r.by_category[size_t(MemoryCategory::gradients)], 0) << e.what();
    // The step's peak is the first update, where AdamW makes its moments, one allocation each
    // (Note [Optimizer state in one buffer]): the first is there, tagged, when the second does not fit.
    EXPECT_GT(r.by_category[size_t(MemoryCategory::optimizer_state)], 0) << e.what();
    for (const char* want : {"optimizer state  AdamW exp_avg", "--offload-state optimizer", "parameters  wte.weight",
                             "gradients"})
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << "missing '" << want << "' in:\n" << e.what();
  }
}

TEST(Offload, BudgetPicksOffloadAndTooSmallBudgetFailsEarly) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  // What a plain run needs, then a budget between the offloaded and the plain layout's needs.
  train::TrainOptions probe = pool_run(data, "", "fp32");
  probe.offload_state = "none";
  probe.steps = 1;
  const RunResult p = run(probe);
  ASSERT_TRUE(p.plan);
  const int64_t plain_need = p.plan->device_peak_bytes;
  train::TrainOptions o = pool_run(data, "", "fp32");
  o.gpu_memory_budget = double(plain_need - 20000) / double(int64_t(1) << 30);
  const RunResult r = run(o);
  ASSERT_TRUE(r.plan);
  EXPECT_TRUE(r.plan->offload_state) << r.log;
  EXPECT_LE(r.pool_peak, plain_need - 20000);  // ran inside the budget the pool enforced

  train::TrainOptions tiny = pool_run(data, "", "fp32");
  tiny.gpu_memory_budget = 1e-6;  // ~1 KiB: nothing fits
  std::ostringstream log;
  test::expect_error([&] { train::Trainer t(tiny, {.log = &log}); },
                     {"no memory layout fits", "everything on the device", "optimizer state on the host",
                      "the smallest device budget that fits is", "--gpu-memory-budget"});
}

// A --recompute auto run of `o` under a budget of `budget` bytes: it plans, its plan and the pool's
// peak stay within the budget, its steps' peak within 5% of the plan, and it trains as `plain`.
RunResult run_auto_under(train::TrainOptions o, int64_t budget, const RunResult& plain) {
  o.recompute = "auto";
  o.gpu_memory_budget = double(budget) / double(int64_t(1) << 30);
  RunResult r = run(o);
  EXPECT_TRUE(r.plan) << r.log;
  if (!r.plan) return r;
  EXPECT_LE(r.plan->device_peak_bytes, budget);
  EXPECT_LE(r.pool_peak, budget);
  EXPECT_NEAR(double(r.step_peak), double(r.plan->device_peak_bytes), 0.05 * double(r.plan->device_peak_bytes)) << r.log;
  expect_same_run(plain, r);
  return r;
}

// --recompute auto: the planner probes none, the MLP on the first ⌈L/4⌉, ⌈L/2⌉, ⌈3L/4⌉, L-1 blocks
// (here, L = 2: mlp-first:1), selective, block:4, selective+block:4, mlp, block:2,
// selective+block:2, selective+mlp, block in turn and keeps the first whose plan fits (here, under
// a budget between none's and mlp-first:1's, mlp-first:1), the optimizer state on
// the device before any offload; the run is the chosen setting's run (recompute changes no
// arithmetic: the plain run's losses and weights), its peak within 5% of the plan and under the
// budget. A budget nothing fits names every setting tried
// with the smallest budget each needs; auto without a budget is refused.
TEST(Offload, RecomputeAutoPicksTheLeastThatFits) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  auto planned = [&](const char* recompute) {
    train::TrainOptions o = pool_run(data, "", "fp32");
    o.gpu_memory_budget = 1.0;
    o.recompute = recompute;
    const RunResult r = run(o);
    EXPECT_TRUE(r.plan && !r.plan->offload_state) << r.log;
    return r;
  };
  const RunResult none = planned("none"), some_mlp = planned("mlp-first:1");
  const int64_t need_none = none.plan->device_peak_bytes, need_mlp = some_mlp.plan->device_peak_bytes;
  ASSERT_LT(need_mlp, need_none);
  const int64_t budget = (need_none + need_mlp) / 2;
  const RunResult r = run_auto_under(pool_run(data, "", "fp32"), budget, none);
  ASSERT_TRUE(r.plan) << r.log;
  EXPECT_NE(r.log.find("recompute auto: mlp-first:1 (the least recompute that fits with the optimizer state on the device)"),
            std::string::npos) << r.log;
  EXPECT_FALSE(r.plan->offload_state) << r.log;
  std::printf("recompute auto under %lld bytes: mlp-first:1, planned %lld, steps' peak %lld (none needs %lld)\n",
              (long long)budget, (long long)r.plan->device_peak_bytes, (long long)r.step_peak, (long long)need_none);

  train::TrainOptions tiny = pool_run(data, "", "fp32");
  tiny.recompute = "auto";
  tiny.gpu_memory_budget = 1e-6;
  std::ostringstream log;
  test::expect_error([&] { train::Trainer t(tiny, {.log = &log}); },
                     {"--recompute auto: no recompute setting fits", "--recompute none, --offload-state none",
                      "--recompute mlp-first:1, --offload-state none", "--recompute mlp-first:1, --offload-state auto",
                      "--recompute selective+block:4, --offload-state none",
                      "--recompute selective+block:2, --offload-state auto", "--recompute block, --offload-state auto",
                      "--recompute block, --offload-activations, --offload-state auto",
                      "the smallest device budget that fits is"});
  train::TrainOptions unbounded = pool_run(data, "", "fp32");
  unbounded.recompute = "auto";
  test::expect_error([&] { train::Trainer t(unbounded, {.log = &log}); },
                     {"--recompute auto picks the least recompute that fits a --gpu-memory-budget"});
}

// Between two steps of the ladder: with 8 blocks auto probes mlp-first at 2, 4, 6 and 7 blocks.
// Under a budget between what mlp-first:2 and mlp-first:3 need, 2 does not fit and 4 does; halving
// the blocks between them finds 3, which the run then takes (bitwise the plain run: recompute
// changes no arithmetic). Under one between 3's and 4's, 3 is probed last and does not fit: 4 is
// probed again and taken.
TEST(Offload, RecomputeAutoHalvesBetweenTheLaddersSteps) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const auto deep = [&] {
    train::TrainOptions o = pool_run(data, "", "fp32");
    o.model["n_layer"] = 8;
    o.loss_chunks = 1;  // the logits whole: only the recompute settings are probed
    return o;
  };
  const auto planned = [&](const char* recompute) {
    train::TrainOptions o = deep();
    o.gpu_memory_budget = 1.0;
    o.recompute = recompute;
    const RunResult r = run(o);
    EXPECT_TRUE(r.plan && !r.plan->offload_state) << r.log;
    return r;
  };
  const RunResult none = planned("none"), two = planned("mlp-first:2"), three = planned("mlp-first:3"),
                  four = planned("mlp-first:4");
  const int64_t need2 = two.plan->device_peak_bytes, need3 = three.plan->device_peak_bytes,
                need4 = four.plan->device_peak_bytes;
  ASSERT_LT(need3, need2);
  ASSERT_LT(need4, need3);
  const RunResult r = run_auto_under(deep(), (need2 + need3) / 2, none);
  EXPECT_NE(r.log.find("recompute auto: mlp-first:4 fits and mlp-first:2 does not; between them 3 fits\n"),
            std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("recompute auto: mlp-first:3 (the least recompute that fits with the optimizer state on the "
                       "device)"),
            std::string::npos)
      << r.log;
  const RunResult r4 = run_auto_under(deep(), (need3 + need4) / 2, none);
  EXPECT_NE(r4.log.find("recompute auto: mlp-first:4 fits and mlp-first:2 does not; between them 3 does not\n"),
            std::string::npos)
      << r4.log;
  EXPECT_NE(r4.log.find("recompute auto: mlp-first:4 (the least"), std::string::npos) << r4.log;
  std::printf("recompute auto between the ladder's steps: mlp-first:2 needs %lld bytes, 3 %lld, 4 %lld\n",
              (long long)need2, (long long)need3, (long long)need4);
}

// --recompute auto with --loss-chunks unset: each setting is followed by the same with the head's
// loss in 4, then 8 row pieces (Note [Chunked loss]), cheaper than any recompute. With a vocabulary
// wide enough for the logits to matter, a budget between what the plain step and 4 pieces need
// takes 4 pieces without recompute, and one between what 4 and 8 pieces need takes 8; each run is
// the explicit `--loss-chunks N` run bit for bit, inside the budget, and run.json records N (a
// resume takes it). A given --loss-chunks 1 keeps the logits whole: auto recomputes instead, and
// the run is the plain one. A run whose first candidate fits records 1, so its resume keeps the
// logits whole too.
TEST(Offload, PlanCountsTheScratchWorkspaceItFindsHeld) {
  // The scratch workspace keeps its block once grown (on a GPU cuBLASLt's and flash attention's
  // scratch, tens of MiB): a probe after another (--recompute auto's later candidates) finds it
  // held before it starts, and every step holds it at its peak, so the plan must count it.
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  train::TrainOptions o = pool_run(data, "", "fp32");
  o.gpu_memory_budget = 1.0;  // roomy: the plan is made and kept
  // A workspace of this test's own (the thread's default one stays as other tests left it).
  const Device dev("cpu:1");
  Workspace scratch(dev);
  ExecContextGuard own(ExecContext{dev, nullptr, &scratch});
  const RunResult a = run(o);
  const int64_t held_a = int64_t(scratch.block_bytes());
  constexpr int64_t kGrown = int64_t(8) << 20;
  scratch.reserve(size_t(int64_t(scratch.capacity()) + kGrown));
  const int64_t added = int64_t(scratch.block_bytes()) - held_a;
  const RunResult b = run(o);
  ASSERT_TRUE(a.plan && b.plan) << a.log << b.log;
  std::printf("workspace %lld -> %lld B; planned peak %lld -> %lld B, steps' peak %lld -> %lld B\n", (long long)held_a,
              (long long)scratch.capacity(), (long long)a.plan->device_peak_bytes, (long long)b.plan->device_peak_bytes,
              (long long)a.step_peak, (long long)b.step_peak);
  EXPECT_EQ(b.step_peak - a.step_peak, added) << "the grown workspace is in the steps' peak";
  EXPECT_EQ(b.plan->device_peak_bytes - a.plan->device_peak_bytes, added) << "and in the plan";
  expect_same_run(a, b);
}

TEST(Offload, RecomputeAutoTakesTheLossInPiecesBeforeRecompute) {
  constexpr int64_t kWide = 2048;
  TempDir data, out4, out8, out_whole, out_roomy;
  train::test_util::write_toy_shards(data.path(), kWide, 2048, 8192);
  const auto wide = [&](const std::filesystem::path& out, int64_t loss_chunks) {
    train::TrainOptions o = pool_run(data, out, "fp32", kWide);
    o.batch_size = 4;  // 128 rows a micro-batch: the logits 4x the head's weight gradient, which the pieces hold
    o.seq_len = 32;
    o.steps = 4;
    o.loss_chunks = loss_chunks;
    return o;
  };
  const auto need = [&](int64_t loss_chunks) {
    train::TrainOptions o = wide("", loss_chunks);
    o.gpu_memory_budget = 1.0;
    const RunResult r = run(o);
    EXPECT_TRUE(r.plan && !r.plan->offload_state) << r.log;
    return r.plan ? r.plan->device_peak_bytes : 0;
  };
  const int64_t need_none = need(0), need4 = need(4), need8 = need(8);
  ASSERT_LT(need4, need_none);
  ASSERT_LT(need8, need4);
  std::printf("planned peak: whole logits %lld, in 4 pieces %lld, in 8 pieces %lld bytes\n", (long long)need_none,
              (long long)need4, (long long)need8);
  const auto recorded = [](const TempDir& out) {
    return train::recorded_options(out.path().string()).value("loss_chunks", int64_t(0));
  };
  const auto picked = [](const RunResult& r) {
    const size_t at = r.log.find("recompute auto: ");
    return at == std::string::npos ? std::string() : r.log.substr(at, r.log.find(" (", at) - at);
  };

  const RunResult r4 = run_auto_under(wide(out4.path(), 0), (need_none + need4) / 2, run(wide("", 4)));
  EXPECT_EQ(picked(r4), "recompute auto: none, --loss-chunks 4") << r4.log;
  EXPECT_EQ(recorded(out4), 4);
  const int64_t budget8 = (need4 + need8) / 2;
  const RunResult r8 = run_auto_under(wide(out8.path(), 0), budget8, run(wide("", 8)));
  EXPECT_EQ(picked(r8), "recompute auto: none, --loss-chunks 8") << r8.log;
  EXPECT_EQ(recorded(out8), 8);

  const RunResult plain = run(wide("", 0));
  const RunResult whole = run_auto_under(wide(out_whole.path(), 1), budget8, plain);
  EXPECT_EQ(whole.log.find("--loss-chunks"), std::string::npos) << whole.log;
  EXPECT_NE(picked(whole), "") << whole.log;
  EXPECT_EQ(recorded(out_whole), 1);
  std::printf("under %lld bytes with --loss-chunks 1: %s\n", (long long)budget8, picked(whole).c_str());

  const RunResult roomy = run_auto_under(wide(out_roomy.path(), 0), need_none + 1024, plain);
  EXPECT_EQ(picked(roomy), "recompute auto: none") << roomy.log;
  EXPECT_EQ(recorded(out_roomy), 1);
}

// --recompute auto after whole-block recompute: the block inputs it keeps, offloaded to host
// memory. Under a budget below what whole-block recompute needs with the optimizer state offloaded,
// and above what it needs with its kept activations offloaded too, auto takes that candidate; the
// run is the plain run (offload and recompute change no arithmetic), its peak within 5% of the plan
// and under the budget.
TEST(Offload, RecomputeAutoOffloadsBlockInputsAfterBlockRecompute) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  // Six blocks of 32 positions: in the backward a block's input and the next one's (fetched ahead)
  // are on the device, the other four on the host.
  const auto deep = [](train::TrainOptions o) {
    o.model["n_layer"] = 6;
    o.seq_len = 32;
    o.steps = 4;
    return o;
  };
  auto need = [&](bool offload_activations) {
    train::TrainOptions o = deep(pool_run(data, "", "fp32"));
    o.gpu_memory_budget = 1.0;
    o.recompute = "block";
    o.offload_state = "optimizer";
    o.offload_update = "cpu";  // (the update streamed through the device adds its chunks' staging)
    o.offload_activations = offload_activations;
    const RunResult r = run(o);
    EXPECT_TRUE(r.plan && r.plan->offload_state) << r.log;
    return r.plan ? r.plan->device_peak_bytes : 0;
  };
  const int64_t kept = need(false), offloaded = need(true);
  ASSERT_LT(offloaded, kept);
  const RunResult plain = run(deep(pool_run(data, "", "fp32")));
  train::TrainOptions o = deep(pool_run(data, "", "fp32"));
  o.offload_update = "cpu";
  const int64_t budget = (kept + offloaded) / 2;
  const RunResult r = run_auto_under(o, budget, plain);
  ASSERT_TRUE(r.plan) << r.log;
  EXPECT_NE(r.log.find("recompute auto: block, --offload-activations (the least recompute that fits)"),
            std::string::npos)
      << r.log;
  EXPECT_TRUE(r.plan->offload_state) << r.log;
  std::printf("recompute auto under %lld bytes: block with its kept activations offloaded, planned %lld, steps' peak "
              "%lld (kept on the device it needs %lld)\n",
              (long long)budget, (long long)r.plan->device_peak_bytes, (long long)r.step_peak, (long long)kept);
}

// The fp32 masters on the host too (Note [Masters on the host]): the same arithmetic, so the same
// run bit for bit, with the released parameters' 4 bytes per element off the device.
TEST(Offload, MastersOnHostTrainLikePlainRunBitwise) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult plain = run(pool_run(data, "", "bf16"));
  train::TrainOptions opt = pool_run(data, "", "bf16");
  opt.offload_state = "optimizer";
  opt.offload_update = "cpu";
  const RunResult state = run(opt);
  train::TrainOptions mo = pool_run(data, "", "bf16");
  mo.offload_state = "master";
  const RunResult masters = run(mo);
  ASSERT_TRUE(masters.plan && masters.plan->masters_on_host && masters.plan->offload_state) << masters.log;
  EXPECT_NE(masters.log.find("memory plan: optimizer state and fp32 master weights on the host, update on the cpu"),
            std::string::npos)
      << masters.log;
  expect_same_run(plain, masters);
  // --offload-overlap: the blocks' update behind the next forward, the same run, the same peak.
  mo.offload_overlap = true;
  const RunResult behind = run(mo);
  expect_same_run(plain, behind);
  EXPECT_EQ(behind.step_peak, masters.step_peak);
  EXPECT_NE(behind.log.find("of it behind the next step's first forward"), std::string::npos) << behind.log;
  // Every parameter but the two embeddings (looked up in fp32) left the device.
  int64_t n = 0;
  for (const std::vector<double>& w : plain.weights) n += int64_t(w.size());
  const int64_t embeddings = (kVocab + 32) * 32;  // wte (tied with the head) and wpe, n_embd 32
  EXPECT_EQ(masters.released, n - embeddings);
  EXPECT_EQ(state.released, 0);
  // The training steps' peak: the released fp32 bytes below the optimizer-offload run's, and the plan
  // within 5%.
  EXPECT_NEAR(double(state.step_peak - masters.step_peak), 4.0 * double(masters.released),
              0.05 * 4.0 * double(masters.released));
  EXPECT_NEAR(double(masters.step_peak), double(masters.plan->device_peak_bytes),
              0.05 * double(masters.plan->device_peak_bytes))
      << masters.log;
  std::printf("bf16, %lld of %lld parameter elements released: steps' peak %lld bytes (optimizer offload %lld, "
              "plain %lld), planned %lld\n",
              (long long)masters.released, (long long)n, (long long)masters.step_peak, (long long)state.step_peak,
              (long long)plain.step_peak, (long long)masters.plan->device_peak_bytes);
}

// And their gradients (Note [Gradients on the host]): without clipping the same run bit for bit
// (the norm's sum runs in another order, so with clipping the clip factor may differ in its last
// bits: then within 1e-6), with the released parameters' first micro-batch gradients off the device.
TEST(Offload, GradientsOnHostTrainLikePlainRun) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  for (const double clip : {0.0, 1.0}) {
    SCOPED_TRACE(clip == 0 ? "no clipping" : "clipping at 1");
    train::TrainOptions po = pool_run(data, "", "bf16");
    po.grad_clip = clip;
    po.grad_accum = 3;  // the third micro-batch lands while the second's may still wait to be added
    const RunResult plain = run(po);
    train::TrainOptions mo = po;
    mo.offload_state = "master";
    const RunResult masters = run(mo);
    train::TrainOptions go = po;
    go.offload_state = "master+grads";
    const RunResult grads = run(go);
    ASSERT_TRUE(grads.plan && grads.plan->grads_on_host && grads.plan->masters_on_host) << grads.log;
    EXPECT_NE(grads.log.find("memory plan: optimizer state, fp32 master weights and their gradients on the host"),
              std::string::npos)
        << grads.log;
    if (clip == 0) {
      expect_same_run(plain, grads);
    } else {
      ASSERT_EQ(grads.losses.size(), plain.losses.size());
      for (size_t i = 0; i < plain.losses.size(); ++i)
        EXPECT_NEAR(grads.losses[i], plain.losses[i], 1e-6 * std::abs(plain.losses[i])) << "step " << i + 1;
    }
    // The first micro-batch's gradients of the released parameters are on the host, not on the
    // device beside the second's backward.
    EXPECT_EQ(grads.released, masters.released);
    EXPECT_LT(double(grads.step_peak), double(masters.step_peak) - 3.0 * double(grads.released)) << grads.log;
    EXPECT_NEAR(double(grads.step_peak), double(grads.plan->device_peak_bytes),
                0.1 * double(grads.plan->device_peak_bytes))
        << grads.log;
    std::printf("bf16, gradients on the host too: steps' peak %lld bytes (masters %lld, plain %lld), planned %lld\n",
                (long long)grads.step_peak, (long long)masters.step_peak, (long long)plain.step_peak,
                (long long)grads.plan->device_peak_bytes);
  }
}

TEST(Offload, MastersOnHostRefusedWithoutCompute16BitCopies) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  train::TrainOptions o = pool_run(data, "", "fp32");
  o.offload_state = "master";
  std::ostringstream log;
  test::expect_error([&] { train::Trainer t(o, {.log = &log}); },
                     {"--offload-state master", "--precision bf16 or fp16"});
  train::TrainOptions g = pool_run(data, "", "bf16");
  g.offload_state = "master";
  g.offload_update = "gpu";
  test::expect_error([&] { train::Trainer t(g, {.log = &log}); }, {"--offload-state master", "--offload-update gpu"});
}

// A budget that only the masters' layout fits: auto takes it, and says so.
TEST(Offload, BudgetTakesMastersOnHostOnlyWhenNothingElseFits) {
  PlanInput in;
  in.param_elements = 1000000;
  in.resident_elements = 100000;
  in.compute_copy_bytes = 2;
  in.grads_in_activations = true;
  in.activations.device_bytes = 4000000;  // the gradients among them
  in.device_budget = 6200000 + 400000 + 2000000;  // masters: activations + 2 B copies + 4 B resident
  const MemoryPlan p = plan_memory(in);
  EXPECT_TRUE(p.masters_on_host && p.offload_state) << p.text;
  EXPECT_EQ(p.device_static_bytes, 2000000 + 400000);
  EXPECT_EQ(p.host_bytes, 12 * 1000000);  // master and moments; the gradients pass through the ring
  EXPECT_NE(p.text.find("fp32 master weights on the host"), std::string::npos) << p.text;
  in.device_budget += 4 * 1000000;  // now the optimizer state alone fits: preferred
  const MemoryPlan q = plan_memory(in);
  EXPECT_TRUE(q.offload_state && !q.masters_on_host) << q.text;
  in.device_budget = 6000000;  // less than activations and copies: nothing fits, each layout named
  test::expect_error([&] { plan_memory(in); },
                     {"no memory layout fits", "optimizer state and fp32 master weights on the host", "--gpu-memory-budget"});
  // Where the masters on the host are not implemented (a tensor-parallel shard), auto never tries
  // them and asking for them is refused by name.
  in.masters_allowed = false;
  in.device_budget = 6200000 + 400000 + 2000000;
  try {
    (void)plan_memory(in);
    ADD_FAILURE() << "a budget only the masters fit was planned without them";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no memory layout fits"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("master weights"), std::string::npos) << e.what();
  }
  in.offload_state = "master";
  test::expect_error([&] { plan_memory(in); }, {"--offload-state master is implemented for data parallelism"});
}

using train::test_util::expect_continues;

// --- the update behind the next forward (Note [Update behind the forward]) ---

// The worker is held 40 ms before each block, so the next forward reaches every block's hook
// before its parameters are updated: the run must still be the plain one bit for bit (the hooks
// wait), and step() must return before the worker reaches block 1 (the update runs behind it).
TEST(Offload, UpdateBehindForwardWaitsForEachBlock) {
  for (const char* state : {"optimizer", "master"}) {
    SCOPED_TRACE(std::string("--offload-state ") + state);
    const StrategyRun plain = strategy_run(Device(DeviceType::cpu, 1), state, false, nullptr);
    const StrategyRun behind = strategy_run(Device(DeviceType::cpu, 1), state, true, [](int64_t, size_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
    });
    ASSERT_EQ(plain.losses.size(), behind.losses.size());
    for (size_t i = 0; i < plain.losses.size(); ++i)
      EXPECT_EQ(std::memcmp(&plain.losses[i], &behind.losses[i], sizeof(double)), 0)
          << "step " << i + 1 << ": " << plain.losses[i] << " vs " << behind.losses[i];
    ASSERT_EQ(plain.weights.size(), behind.weights.size());
    for (size_t i = 0; i < plain.weights.size(); ++i)
      EXPECT_EQ(plain.weights[i], behind.weights[i]) << "tensor " << i;
    ASSERT_EQ(behind.at_block1.size(), 4u);
    for (size_t i = 0; i < 4; ++i)  // the worker reaches block 1 at least 40 ms after it starts
      EXPECT_LT(behind.returned[i], behind.at_block1[i]) << "step " << i + 1 << " returned after its update";
  }
}

// What the worker throws reaches the caller at the next forward's wait, and the optimizer can
// still be destroyed.
TEST(Offload, UpdateBehindForwardReportsWorkerErrors) {
  try {
    strategy_run(Device(DeviceType::cpu, 1), "optimizer", true, [](int64_t update, size_t block) {
      if (update == 1 && block == 1) throw std::runtime_error("worker failed at block 1");
    });
    FAIL() << "the worker's error was lost";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("worker failed at block 1"), std::string::npos) << e.what();
  }
}

TEST(Offload, ResumeIsBitwiseExact) {
  TempDir data, runs;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  for (const std::string update : {"cpu", "gpu", "master", "master+grads"}) {
    SCOPED_TRACE(update);
    const bool masters = update.starts_with("master");
    train::TrainOptions o = pool_run(data, runs.path() / ("a" + update), "bf16");
    o.offload_state = masters ? update : "optimizer";
    o.offload_update = masters ? "cpu" : update;
    const RunResult straight = run(o);

    train::TrainOptions first = o;
    first.out = (runs.path() / ("b" + update)).string();
    const RunResult stopped = run(first, 4);
    ASSERT_EQ(stopped.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(std::memcmp(&stopped.losses[i], &straight.losses[i], sizeof(double)), 0);
    train::TrainOptions second = first;
    second.resume = true;
    const RunResult rest = run(second);
    expect_continues(straight, rest);
  }
}

// A checkpoint moves between a plain run and one with its masters on the host, both ways: resumed
// under the other, it continues with the uninterrupted plain run's losses and weights.
TEST(Offload, MastersOnHostCheckpointsMoveToAndFromPlainRuns) {
  TempDir data, runs;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult straight = run(pool_run(data, runs.path() / "straight", "bf16"));
  for (const bool master_first : {true, false}) {
    SCOPED_TRACE(master_first ? "master, then plain" : "plain, then master");
    train::TrainOptions first = pool_run(data, runs.path() / (master_first ? "mp" : "pm"), "bf16");
    first.offload_state = master_first ? "master" : "none";
    const RunResult stopped = run(first, 4);
    ASSERT_EQ(stopped.losses.size(), 4u);
    train::TrainOptions second = first;
    second.resume = true;
    second.offload_state = master_first ? "none" : "master";
    const RunResult rest = run(second);
    expect_continues(straight, rest);
  }
}

}  // namespace
}  // namespace blu::offload
