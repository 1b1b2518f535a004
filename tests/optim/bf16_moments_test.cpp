// AdamW's moments in bf16 (Note [Stochastic bf16 moments], core/round_stochastic.h): the rounding
// lands on one of the two bf16 neighbours, exactly on a bf16 value, and on average on the value;
// adamw_step with bf16 moments moves the parameter as the fp32 moments do on the step their
// values agree, and stores each moment as a neighbour of the fp32 one; the second moment decays
// over hundreds of steps where rounding to nearest would hold it still; a bf16 run trains as the
// fp32-moment run does in 4 bytes a parameter less, resumes bit for bit, loads the other dtype's
// checkpoints, and is refused with offloaded state.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "blu/blu.h"
#include "blu/core/round_stochastic.h"
#include "blu/offload/plan.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"
#include "blu/train/trainer.h"
#include "common/checks.h"
#include "common/opinfo.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::test {
namespace {

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float bf16_value(uint16_t h) { return float_of(uint32_t(h) << 16); }

TEST(StochasticBf16, LandsOnANeighbourAndIsUnbiased) {
  // Patterns between two bf16 values (positive, negative, tiny, near the top), and exact ones.
  for (uint32_t u : {0x3f8000a1u, 0x3f80c000u, 0xbf81ffffu, 0x00012345u, 0x7f7f1234u, 0x40490fdbu, 0xc2f6e979u}) {
    const float x = float_of(u);
    const uint16_t down = uint16_t(u >> 16), up = uint16_t(down + 1);  // the magnitude's neighbours
    const double frac = double(u & 0xffffu) / 65536.0;
    int64_t ups = 0;
    constexpr int64_t kDraws = 200000;
    for (int64_t k = 0; k < kDraws; ++k) {
      const uint16_t r = bf16_bits_sr(x, sr_key(k, uint32_t(k & 1)));
      ASSERT_TRUE(r == down || r == up) << std::hex << u << " gave " << r;
      ups += r == up;
    }
    // The share rounded up is the fraction, within 5 standard deviations of a binomial draw.
    const double sd = std::sqrt(frac * (1 - frac) / double(kDraws));
    EXPECT_NEAR(double(ups) / double(kDraws), frac, 5 * sd + 1e-9) << std::hex << "pattern 0x" << u;
    // So the mean of the rounded values is x.
    const double mean = (double(kDraws - ups) * bf16_value(down) + double(ups) * bf16_value(up)) / double(kDraws);
    EXPECT_NEAR(mean, double(x), 5 * sd * std::abs(double(bf16_value(up)) - bf16_value(down)) + 1e-30);
  }
  for (uint32_t key : {0u, 1u, 0xdeadbeefu}) {
    for (uint32_t u : {0x3f800000u, 0xbf800000u, 0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x42c80000u})
      EXPECT_EQ(bf16_bits_sr(float_of(u), key), uint16_t(u >> 16)) << std::hex << u;  // exact values stay
    EXPECT_EQ(bf16_bits_sr(float_of(0x7fc00001u), key), 0x7fc0);
    EXPECT_EQ(bf16_bits_sr(float_of(0xff800001u), key), 0x7fc0);  // a NaN with a low payload stays a NaN
  }
}

// The same first step from zero moments: the parameter moves exactly as with fp32 moments (the
// update reads the unrounded fp32 moments), and each stored moment is a bf16 neighbour of the
// fp32 one. Then, with the moments equal (the fp32 set loaded from the bf16 values), the next
// step's parameters agree again.
TEST(AdamWBf16Moments, StepMovesTheParameterAsFp32MomentsDo) {
  NoGradGuard ng;
  Generator gen(7);
  const std::vector<Shape> shapes = {{7, 5}, {13}, {64, 3}, {1}};
  std::vector<Tensor> p32, p16, m32, v32, m16, v16, g;
  for (const Shape& s : shapes) {
    p32.push_back(rnd(gen, s, DType::f32));
    p16.push_back(clone(p32.back()));
    m32.push_back(zeros(s, DType::f32));
    v32.push_back(zeros(s, DType::f32));
    m16.push_back(zeros(s, DType::bf16));
    v16.push_back(zeros(s, DType::bf16));
  }
  for (int64_t step = 1; step <= 2; ++step) {
    std::vector<AdamWTensors> a, b;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Tensor gi = rnd(gen, shapes[i], DType::f32);
      a.push_back({p32[i], gi, m32[i], v32[i]});
      b.push_back({p16[i], gi, m16[i], v16[i]});
    }
    const AdamWStepArgs args{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    adamw_step_(a, args);
    adamw_step_(b, args);
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(p16[i], p32[i])) << "param " << i << " step " << step;
      ASSERT_EQ(m16[i].dtype(), DType::bf16);
      for (const auto& [lo, hi] : {std::pair{m16[i], m32[i]}, std::pair{v16[i], v32[i]}}) {
        const uint16_t* h = static_cast<const uint16_t*>(lo.raw_data());
        const float* f = hi.data<float>();
        for (int64_t k = 0; k < lo.numel(); ++k) {
          const uint16_t down = uint16_t(bits_of(f[k]) >> 16);
          const bool exact = (bits_of(f[k]) & 0xffffu) == 0;
          EXPECT_TRUE(h[k] == down || (!exact && h[k] == down + 1)) << "tensor " << i << " element " << k;
        }
      }
      // Both sets carry on from the bf16 moments.
      copy_(m32[i], m16[i]);
      copy_(v32[i], v16[i]);
    }
  }
}

// v with g = 0 decays as beta2^t. With beta2 = 0.999 a step moves v by 0.1%, under half a bf16
// spacing: rounded to nearest v would stay where it began; rounded stochastically, 300 elements
// (their parameters distinct, so their roundings are) end, on average, within 1% of the exact decay
// after 700 steps.
TEST(AdamWBf16Moments, SecondMomentDecaysWhereNearestRoundingWouldStall) {
  NoGradGuard ng;
  Generator gen(11);
  const Tensor start = to_dtype(rnd_positive(gen, {300}, DType::f32, 0.5), DType::bf16);
  Tensor p = rnd(gen, {300}, DType::f32), g = zeros({300}, DType::f32);
  Tensor m = zeros({300}, DType::bf16), v = clone(start);
  EXPECT_EQ(bf16::round(float(bf16::from_bits(0x3f81)) * 0.999f), 0x3f81);  // nearest rounding stalls
  constexpr int64_t kSteps = 700;
  for (int64_t t = 1; t <= kSteps; ++t)
    adamw_step_({{p, g, m, v}}, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = t});
  const double decay = std::pow(0.999, double(kSteps));  // ≈ 0.496
  const Tensor v32 = to_dtype(v, DType::f32), s32 = to_dtype(start, DType::f32);
  double ratio = 0;
  for (int64_t i = 0; i < 300; ++i) ratio += double(v32.data<float>()[i]) / (double(s32.data<float>()[i]) * decay);
  ratio /= 300;
  std::printf("v / (v0 * 0.999^%lld), mean over 300 elements: %.5f\n", (long long)kSteps, ratio);
  EXPECT_NEAR(ratio, 1.0, 0.01) << "mean of v / (v0 * 0.999^" << kSteps << ")";
}

TEST(AdamWBf16Moments, RefusesMixedOrOtherMomentDtypes) {
  NoGradGuard ng;
  auto t = [](DType d = DType::f32) { return zeros({3}, d); };
  const AdamWStepArgs a{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1};
  expect_error([&] { adamw_step_({{t(), t(), t(DType::bf16), t()}}, a); },
               {"exp_avg_sq of tensor 0 must be bf16 as tensor 0's exp_avg is"});
  expect_error([&] { adamw_step_({{t(), t(), t(DType::bf16), t(DType::bf16)}, {t(), t(), t(), t()}}, a); },
               {"exp_avg of tensor 1 must be bf16"});
  expect_error([&] { adamw_step_({{t(), t(), t(DType::f16), t(DType::f16)}}, a); },
               {"exp_avg of tensor 0 must be f32 or bf16", "f16"});
  expect_error([&] { optim::make_adamw({}, {.state_dtype = DType::f16}); },
               {"AdamW: the moments' dtype must be f32 or bf16, got f16"});
}

// --- whole runs (a device pool, so the peak is measured) ---

constexpr int64_t kVocab = 101;

train::TrainOptions pool_run(const TempDir& data, const std::filesystem::path& out, const std::string& state) {
  train::TrainOptions o = train::test_util::pool_run(data.path(), out, kVocab, "bf16");
  o.adamw_state = state;
  return o;
}
using RunResult = train::test_util::PoolRunResult;
RunResult run(const train::TrainOptions& o, int64_t stop_at = 0) { return train::test_util::run_on_pool(o, stop_at); }

// The tiny model at lr 1e-2: bf16 moments differ from fp32 ones by their rounding (2^-9 of a value
// at most), which the normalised steps carry on; the losses stay within 1% over the run and the
// first is the same bits (nothing is rounded before the first update).
TEST(AdamWBf16Moments, RunTrainsAsFp32MomentsDoInFourBytesLessAParameter) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult f32 = run(pool_run(data, "", "f32")), b16 = run(pool_run(data, "", "bf16"));
  ASSERT_EQ(f32.losses.size(), b16.losses.size());
  EXPECT_EQ(b16.losses[0], f32.losses[0]);
  for (size_t i = 0; i < f32.losses.size(); ++i)
    EXPECT_NEAR(b16.losses[i], f32.losses[i], 1e-2 * f32.losses[i]) << "step " << i + 1;
  EXPECT_LT(b16.losses.back(), b16.losses.front());
  int64_t n = 0;
  for (const std::vector<double>& w : f32.weights) n += int64_t(w.size());
  // The steps' peak holds both moments: 8 bytes a parameter in fp32, 4 in bf16 (each tensor's on a
  // 64-byte boundary).
  EXPECT_NEAR(double(f32.step_peak - b16.step_peak), 4.0 * double(n), 0.05 * 4.0 * double(n));
  std::printf("%lld parameters: steps' peak %lld bytes with bf16 moments against %lld\n", (long long)n,
              (long long)b16.step_peak, (long long)f32.step_peak);
  // A budget is planned with 4 bytes of moments a parameter: the plan within 5% of the steps' peak.
  train::TrainOptions o = pool_run(data, "", "bf16");
  o.gpu_memory_budget = 1.0;
  const RunResult planned = run(o);
  ASSERT_TRUE(planned.plan) << planned.log;
  EXPECT_FALSE(planned.plan->offload_state) << planned.log;
  EXPECT_NEAR(double(planned.step_peak), double(planned.plan->device_peak_bytes),
              0.05 * double(planned.plan->device_peak_bytes))
      << planned.log;
}

TEST(AdamWBf16Moments, PlanCountsFourBytesOfMomentsAndNeverOffloadsThem) {
  offload::PlanInput in;
  in.param_elements = 1'000'000;
  in.compute_copy_bytes = 2;
  in.offload_state = "none";
  const offload::MemoryPlan f32 = offload::plan_memory(in);
  in.moment_bytes = 4;
  const offload::MemoryPlan b16 = offload::plan_memory(in);
  EXPECT_EQ(f32.device_static_bytes - b16.device_static_bytes, 4'000'000);
  // Under a budget only the device layout is a candidate: too small a budget names it alone.
  in.offload_state = "auto";
  in.device_budget = 4'000'000;
  const std::string err = error_of([&] { offload::plan_memory(in); });
  EXPECT_NE(err.find("everything on the device"), std::string::npos) << err;
  EXPECT_EQ(err.find("on the host"), std::string::npos) << err;
  in.offload_state = "optimizer";
  expect_error([&] { offload::plan_memory(in); }, {"--offload-state optimizer", "held on the device only"});
}

TEST(AdamWBf16Moments, ResumeIsBitwiseExactAndCheckpointsMoveBetweenMomentDtypes) {
  TempDir data, runs;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const RunResult straight = run(pool_run(data, runs.path() / "straight", "bf16"));
  train::TrainOptions first = pool_run(data, runs.path() / "stopped", "bf16");
  ASSERT_EQ(run(first, 4).losses.size(), 4u);
  train::TrainOptions second = first;
  second.resume = true;
  train::test_util::expect_continues(straight, run(second));
  // The other dtype's checkpoint loads converted (bf16 → f32 exactly, f32 → bf16 to nearest) when
  // the change is allowed: each continues within 1% of the straight run.
  for (const bool bf16_first : {true, false}) {
    SCOPED_TRACE(bf16_first ? "bf16, then f32" : "f32, then bf16");
    train::TrainOptions a = pool_run(data, runs.path() / (bf16_first ? "bf" : "fb"), bf16_first ? "bf16" : "f32");
    ASSERT_EQ(run(a, 4).losses.size(), 4u);
    train::TrainOptions b = a;
    b.resume = true;
    b.adamw_state = bf16_first ? "f32" : "bf16";
    expect_error([&] { run(b); }, {"adamw_state"});  // a trajectory change, refused unless allowed
    b.allow_changes = true;
    const RunResult moved = run(b);
    ASSERT_EQ(moved.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i)
      EXPECT_NEAR(moved.losses[i], straight.losses[4 + i], 1e-2 * straight.losses[4 + i]) << "step " << 5 + i;
  }
}

TEST(AdamWBf16Moments, RefusedWithOffloadedStateOrAnotherOptimizer) {
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 2048, 8192);
  const auto refused = [&](const std::function<void(train::TrainOptions&)>& change, std::string part) {
    train::TrainOptions o = pool_run(data, "", "bf16");
    change(o);
    expect_error([&] { train::Trainer t(o, {}); }, {part});
  };
  refused([](train::TrainOptions& o) { o.offload_state = "optimizer"; }, "--offload-state optimizer");
  refused([](train::TrainOptions& o) { o.optimizer = "sgd"; }, "--optimizer sgd");
  refused([](train::TrainOptions& o) { o.adamw_state = "f16"; }, "--adamw-state must be f32 or bf16, got 'f16'");
}

}  // namespace
}  // namespace blu::test
