// Split master weights (Note [Split masters], optim/master_split.h; Note [Split fp32],
// core/split_f32.h): the halves give every fp32 value back and the high half is its bf16 but on
// exact ties; AdamW's update of a split master is the fp32 master's update bit for bit; a bf16 run
// with split masters trains as the fp32-master run does, holds two bytes a split parameter less,
// and resumes from its checkpoints bit for bit, which move to and from fp32-master runs.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>

#include "blu/blu.h"
#include "blu/core/split_f32.h"
#include "blu/memory/device_pool.h"
#include "blu/offload/plan.h"
#include "blu/ops/optim.h"
#include "blu/train/trainer.h"
#include "common/checks.h"
#include "common/opinfo.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::test {
namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

void check_pattern(uint32_t u) {
  const float x = float_of(u);
  uint16_t hi, lo;
  split_f32(x, hi, lo);
  const float back = join_f32(hi, lo);
  if (std::isnan(x)) {
    ASSERT_TRUE(std::isnan(back)) << std::hex << u;
    return;
  }
  ASSERT_EQ(bits_of(back), u) << std::hex << "pattern 0x" << u;
  const bool tie = (u & 0xffffu) == 0x8000u;
  if (tie)  // the magnitude rounded up, whatever the parity
    ASSERT_EQ(hi, uint16_t((u >> 16) + 1)) << std::hex << u;
  else
    ASSERT_EQ(hi, bf16::round(x)) << std::hex << u;
}

TEST(SplitF32, HalvesGiveEveryValueBackAndTheHighHalfIsItsBf16) {
  // Every 65,521st pattern (a prime stride: every low half and exponent is met), every tie below
  // each high half, and the edges.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) check_pattern(uint32_t(u));
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    check_pattern(h << 16 | 0x8000u);
    check_pattern(h << 16 | 0x7fffu);
    check_pattern(h << 16 | 0x8001u);
    check_pattern(h << 16);
  }
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x007fffffu, 0x7f7fffffu, 0xff7fffffu,
                     0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7f7f8000u})
    check_pattern(u);
}

// Parameters, moments and copies built so that the fp32-master set and the split set start equal;
// a few parameter elements sit exactly on a bf16 tie.
struct Set {
  std::vector<Tensor> p, m, v, c, low;
};
Set make_set(uint64_t seed) {
  Generator gen(seed);
  Set s;
  for (const Shape& shape : std::vector<Shape>{{7, 5}, {13}, {37}, {1}, {0, 4}, {64, 3}}) {
    Tensor p = rnd(gen, shape, DType::f32);
    float* d = p.data<float>();
    for (int64_t i = 0; i < p.numel(); i += 5) d[i] = float_of((bits_of(d[i]) & 0xffff0000u) | 0x8000u);
    s.p.push_back(p);
    s.m.push_back(mul(rnd(gen, shape, DType::f32), 0.1));
    s.v.push_back(abs(mul(rnd(gen, shape, DType::f32), 0.01)));
  }
  return s;
}
// The split halves of `p` (f32, CPU, contiguous).
std::pair<Tensor, Tensor> halves(const Tensor& p) {
  Tensor hi = empty(p.shape(), DType::bf16), lo = empty({2 * p.numel()}, DType::u8);
  for (int64_t i = 0; i < p.numel(); ++i)
    split_f32(p.data<float>()[i], static_cast<uint16_t*>(hi.raw_data())[i], static_cast<uint16_t*>(lo.raw_data())[i]);
  return {hi, lo};
}
Tensor joined(const Tensor& hi, const Tensor& lo) {
  Tensor p = empty(hi.shape(), DType::f32);
  for (int64_t i = 0; i < p.numel(); ++i)
    p.data<float>()[i] = join_f32(static_cast<const uint16_t*>(hi.raw_data())[i], static_cast<const uint16_t*>(lo.raw_data())[i]);
  return p;
}

TEST(AdamWSplit, UpdateIsTheFp32MastersUpdateBitwise) {
  NoGradGuard ng;
  Set ref = make_set(3), split = make_set(3);
  for (size_t i = 0; i < split.p.size(); ++i) {
    ref.c.push_back(to_dtype(ref.p[i], DType::bf16));
    auto [hi, lo] = halves(split.p[i]);
    split.c.push_back(hi);
    split.low.push_back(lo);
  }
  Generator gen(17);
  for (int64_t step = 1; step <= 5; ++step) {
    std::vector<AdamWTensors> a, b;
    for (size_t i = 0; i < ref.p.size(); ++i) {
      const Tensor g = rnd(gen, ref.p[i].shape(), DType::f32);
      a.push_back({ref.p[i], g, ref.m[i], ref.v[i], ref.c[i]});
      b.push_back({split.p[i], g, split.m[i], split.v[i], split.c[i], split.low[i]});
    }
    // Step 3 clipped by the norm gate, step 4 skipped by a non-finite total.
    NormGate gate;
    if (step == 3) gate = {full({}, 400.0), 1.0};
    if (step == 4) gate = {full({}, INFINITY), 1.0};
    const AdamWStepArgs args{.lr = 3e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    adamw_step_(a, args, gate);
    adamw_step_(b, args, gate);
    for (size_t i = 0; i < ref.p.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(joined(split.c[i], split.low[i]), ref.p[i])) << "master " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(split.m[i], ref.m[i])) << "exp_avg " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(split.v[i], ref.v[i])) << "exp_avg_sq " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(split.c[i], halves(ref.p[i]).first)) << "copy " << i << " step " << step;
      EXPECT_TRUE(bitwise_equal(split.p[i], make_set(3).p[i])) << "the param handle is not touched";
    }
  }
  // The planted ties round away from zero in the split copy and to even in to_dtype's.
  int64_t ties = 0, differ = 0;
  for (size_t i = 0; i < ref.p.size(); ++i)
    for (int64_t k = 0; k < ref.p[i].numel(); ++k) {
      const uint16_t a = static_cast<const uint16_t*>(ref.c[i].raw_data())[k],
                     b = static_cast<const uint16_t*>(split.c[i].raw_data())[k];
      ties += (bits_of(ref.p[i].data<float>()[k]) & 0xffffu) == 0x8000u;
      differ += a != b;
    }
  EXPECT_LE(differ, ties);
}

TEST(AdamWSplit, RefusesBadHalves) {
  NoGradGuard ng;
  auto t = [](Shape s, DType d = DType::f32) { return zeros(s, d); };
  const AdamWStepArgs a{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1};
  expect_error([&] { adamw_step_({{t({3}), t({3}), t({3}), t({3}), Tensor(), t({6}, DType::u8)}}, a); },
               {"needs its compute copy"});
  expect_error([&] { adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::bf16), t({4}, DType::u8)}}, a); },
               {"low halves of tensor 0 must be contiguous u8 of 6 bytes"});
  expect_error([&] { adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::f16), t({6}, DType::u8)}}, a); },
               {"must be contiguous bf16"});
  expect_error(
      [&] {
        adamw_step_({{t({3}), t({3}), t({3}), t({3}), t({3}, DType::bf16), t({6}, DType::u8)},
                     {t({2}), t({2}), t({2}), t({2}), t({2}, DType::bf16)}},
                    a);
      },
      {"either all are or none"});
}

// --- whole runs (a device pool, so the peak is measured) ---

constexpr int64_t kVocab = 101;

train::TrainOptions pool_run(const TempDir& data, const std::filesystem::path& out) {
  return train::test_util::pool_run(data.path(), out, kVocab, "bf16");
}

using RunResult = train::test_util::PoolRunResult;
RunResult run(const train::TrainOptions& o, int64_t stop_at = 0) { return train::test_util::run_on_pool(o, stop_at); }

// Runs that differ only where a compute copy rounded an exact tie away from zero instead of to
// even (one element in 65,536: the tiny model's 25,472 split elements start with one, and each
// update makes new values), which AdamW's normalised steps then carry on, chaotically at this
// model's learning rate: the first loss within 1e-5, every loss within 0.2%. (The update itself is
// checked bit for bit above, and a split run against itself by its resume below.)
void expect_near_run(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  ASSERT_FALSE(a.losses.empty());
  EXPECT_NEAR(a.losses[0], b.losses[0], 1e-5 * std::abs(a.losses[0]));
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(a.losses[i], b.losses[i], 2e-3 * std::abs(a.losses[i])) << "step " << i + 1;
  ASSERT_EQ(a.weights.size(), b.weights.size());
}

TEST(SplitMasters, TrainLikeFp32MastersInTwoBytesLessAParameter) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult plain = run(pool_run(data, ""));
  train::TrainOptions so = pool_run(data, "");
  so.master_weights = "split";
  const RunResult split = run(so);
  expect_near_run(plain, split);
  int64_t n = 0;
  for (const std::vector<double>& w : plain.weights) n += int64_t(w.size());
  const int64_t embeddings = (kVocab + 32) * 32;  // wte (tied with the head) and wpe, looked up in fp32
  EXPECT_EQ(split.split, n - embeddings);
  EXPECT_EQ(plain.split, 0);
  EXPECT_NE(split.log.find("split master weights: " + std::to_string(n - embeddings)), std::string::npos) << split.log;
  // The steps' peak: 4 fp32 bytes gone, 2 low bytes made (each parameter's on a 64-byte boundary).
  EXPECT_NEAR(double(plain.step_peak - split.step_peak), 2.0 * double(split.split), 0.05 * 2.0 * double(split.split));
  std::printf("%lld of %lld parameter elements split: steps' peak %lld bytes against %lld\n", (long long)split.split,
              (long long)n, (long long)split.step_peak, (long long)plain.step_peak);
  // With a budget the planner counts the split parameters' 2 bytes less: its peak within 5% of the
  // steps', as for fp32 masters (tests/offload).
  so.gpu_memory_budget = 1.0;
  const RunResult planned = run(so);
  ASSERT_TRUE(planned.plan) << planned.log;
  EXPECT_FALSE(planned.plan->offload_state) << planned.log;
  EXPECT_NEAR(double(planned.step_peak), double(planned.plan->device_peak_bytes),
              0.05 * double(planned.plan->device_peak_bytes))
      << planned.log;
}

TEST(SplitMasters, PlanCountsTwoBytesLessForEachSplitElement) {
  offload::PlanInput in;
  in.param_elements = 1'000'000;
  in.compute_copy_bytes = 2;
  in.offload_state = "none";
  const offload::MemoryPlan whole = offload::plan_memory(in);
  in.split_elements = 600'000;
  const offload::MemoryPlan split = offload::plan_memory(in);
  EXPECT_EQ(whole.device_static_bytes - split.device_static_bytes, 1'200'000);
}

TEST(SplitMasters, ResumeIsBitwiseExactAndCheckpointsMoveToAndFromFp32Masters) {
  TempDir data, runs;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  train::TrainOptions o = pool_run(data, runs.path() / "straight");
  o.master_weights = "split";
  const RunResult straight = run(o);
  train::TrainOptions first = o;
  first.out = (runs.path() / "stopped").string();
  const RunResult stopped = run(first, 4);
  ASSERT_EQ(stopped.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(std::memcmp(&stopped.losses[i], &straight.losses[i], sizeof(double)), 0);
  train::TrainOptions second = first;
  second.resume = true;
  train::test_util::expect_continues(straight, run(second));
  // The checkpoint holds fp32 masters: resumed with fp32 masters, and an fp32-master checkpoint
  // resumed split, each continues within the ties' rounding of the straight run.
  for (const bool split_first : {true, false}) {
    SCOPED_TRACE(split_first ? "split, then fp32" : "fp32, then split");
    train::TrainOptions a = o;
    a.out = (runs.path() / (split_first ? "sf" : "fs")).string();
    a.master_weights = split_first ? "split" : "fp32";
    ASSERT_EQ(run(a, 4).losses.size(), 4u);
    train::TrainOptions b = a;
    b.resume = true;
    b.master_weights = split_first ? "fp32" : "split";
    const RunResult moved = run(b);
    ASSERT_EQ(moved.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_NEAR(moved.losses[i], straight.losses[4 + i], 2e-3 * straight.losses[4 + i]) << "step " << 5 + i;
  }
}

TEST(SplitMasters, RefusedWhereAdamWsOwnKernelDoesNotRunTheUpdate) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const auto refused = [&](const std::function<void(train::TrainOptions&)>& change, std::string part) {
    train::TrainOptions o = pool_run(data, "");
    o.master_weights = "split";
    change(o);
    expect_error([&] { train::Trainer t(o, {}); }, {part});
  };
  refused([](train::TrainOptions& o) { o.precision = "fp32"; }, "needs --precision bf16");
  refused([](train::TrainOptions& o) { o.precision = "fp16"; }, "got --precision fp16");
  refused([](train::TrainOptions& o) { o.optimizer = "sgd"; }, "--optimizer sgd");
  refused([](train::TrainOptions& o) { o.offload_state = "optimizer"; }, "--offload-state optimizer");
  refused([](train::TrainOptions& o) { o.master_weights = "half"; }, "--master-weights must be fp32 or split, got 'half'");
}

}  // namespace
}  // namespace blu::test
