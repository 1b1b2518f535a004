// Optimizers without PyTorch: schedules at their key steps, state round trips that continue
// bitwise, strict state loading, grouping, argument checks, and clipping's edge cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "blu/blu.h"
#include "blu/optim/optimizer.h"
#include "common/opinfo.h"
#include "common/checks.h"

namespace blu::test {
namespace {

using optim::LRSchedule;
using optim::ParamGroup;

TEST(LRSchedule, KeyStepsCosine) {
  const LRSchedule s{.kind = LRSchedule::Kind::cosine, .max_lr = 6e-4, .min_lr = 6e-5, .warmup_steps = 10,
                     .total_steps = 110};
  EXPECT_DOUBLE_EQ(s.at(0), 6e-4 / 10);   // warmup starts above 0
  EXPECT_DOUBLE_EQ(s.at(4), 6e-4 * 5 / 10);
  EXPECT_DOUBLE_EQ(s.at(9), 6e-4);        // warmup ends at max
  EXPECT_DOUBLE_EQ(s.at(10), 6e-4);       // decay starts at max
  EXPECT_DOUBLE_EQ(s.at(60), (6e-4 + 6e-5) / 2);  // midpoint of the cosine
  EXPECT_NEAR(s.at(109), 6e-5 + 0.5 * (1 + std::cos(std::numbers::pi * 99 / 100)) * (6e-4 - 6e-5), 1e-18);
  EXPECT_DOUBLE_EQ(s.at(110), 6e-5);      // end
  EXPECT_DOUBLE_EQ(s.at(1000), 6e-5);     // and after
  for (int64_t i = 10; i < 110; ++i) EXPECT_LE(s.at(i + 1), s.at(i)) << i;
}

TEST(LRSchedule, KeyStepsLinearAndConstant) {
  LRSchedule s{.kind = LRSchedule::Kind::linear, .max_lr = 1.0, .min_lr = 0.0, .warmup_steps = 4, .total_steps = 8};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_DOUBLE_EQ(s.at(6), 0.5);
  EXPECT_DOUBLE_EQ(s.at(8), 0.0);
  s.kind = LRSchedule::Kind::constant;
  EXPECT_DOUBLE_EQ(s.at(1), 0.5);  // warmup applies to every kind
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_DOUBLE_EQ(s.at(100), 1.0);
  s.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(s.at(0), 1.0);
  // No decay span (total <= warmup): min_lr right after warmup.
  LRSchedule t{.kind = LRSchedule::Kind::cosine, .max_lr = 1.0, .min_lr = 0.1, .warmup_steps = 5, .total_steps = 5};
  EXPECT_DOUBLE_EQ(t.at(4), 1.0);
  EXPECT_DOUBLE_EQ(t.at(5), 0.1);
}

TEST(LRSchedule, Parse) {
  EXPECT_EQ(LRSchedule::parse("cosine"), LRSchedule::Kind::cosine);
  EXPECT_EQ(LRSchedule::parse("linear"), LRSchedule::Kind::linear);
  EXPECT_EQ(LRSchedule::parse("constant"), LRSchedule::Kind::constant);
  EXPECT_NE(error_of([] { LRSchedule::parse("cosin"); }).find("unknown learning-rate schedule 'cosin'"),
            std::string::npos);
}

// A small problem: named parameters, two groups, one parameter that never gets a gradient.
struct Problem {
  nn::NamedTensors params;
  explicit Problem(uint64_t seed) {
    Generator gen(seed);
    for (auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {"h.0.weight", {6, 4}}, {"h.0.bias", {4}}, {"h.1.weight", {4, 3}}, {"unused", {2}}}) {
      Tensor p = rnd(gen, shape, DType::f32);
      p.set_requires_grad(true);
      params.emplace_back(name, p);
    }
  }
  // An independent copy with the same values.
  Problem(const Problem& o, int) {
    for (auto& [name, p] : o.params) {
      Tensor c = clone(p.detach());
      c.set_requires_grad(true);
      params.emplace_back(name, c);
    }
  }
  std::vector<ParamGroup> groups() const { return optim::decay_groups(params, 0.1); }
  void set_grads(Generator& gen) const {
    for (auto [name, p] : params) {  // handles: copies share the tensor
      p.zero_grad();
      if (name != "unused") p.set_grad(rnd(gen, p.shape(), DType::f32));
    }
  }
};

TEST(Optim, DecayGroupsSplitByRank) {
  Problem pb(1);
  auto g = pb.groups();
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].weight_decay, 0.1);
  EXPECT_EQ(g[1].weight_decay, 0.0);
  ASSERT_EQ(g[0].params.size(), 2u);
  EXPECT_EQ(g[0].params[0].first, "h.0.weight");
  EXPECT_EQ(g[0].params[1].first, "h.1.weight");
  ASSERT_EQ(g[1].params.size(), 2u);
  EXPECT_EQ(g[1].params[0].first, "h.0.bias");
}

// Runs 3 steps, saves the state, and checks that a fresh optimizer loaded with it continues
// exactly as the original over 4 more steps (bitwise parameters and state).
void check_round_trip(const std::function<std::unique_ptr<optim::Optimizer>(std::vector<ParamGroup>)>& make) {
  Problem a(7);
  auto opt_a = make(a.groups());
  Generator grads(11);
  for (int i = 0; i < 3; ++i) {
    a.set_grads(grads);
    opt_a->set_lr(1e-2 * (i + 1));
    opt_a->step();
  }
  // Save: deep copies, as a checkpoint file would hold.
  nn::NamedTensors saved;
  for (auto& [name, t] : opt_a->state()) saved.emplace_back(name, clone(t));
  Problem b(a, 0);
  auto opt_b = make(b.groups());
  opt_b->load_state(saved);
  EXPECT_EQ(opt_b->steps(), 3);
  ASSERT_EQ(opt_b->state().size(), saved.size());
  Generator grads_b = grads;
  for (int i = 3; i < 7; ++i) {
    a.set_grads(grads);
    b.set_grads(grads_b);
    opt_a->set_lr(1e-2 * (i + 1));
    opt_b->set_lr(1e-2 * (i + 1));
    opt_a->step();
    opt_b->step();
  }
  for (size_t i = 0; i < a.params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(a.params[i].second, b.params[i].second)) << a.params[i].first;
  auto sa = opt_a->state(), sb = opt_b->state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(bitwise_equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
}

TEST(Optim, AdamWStateRoundTripContinuesBitwise) {
  check_round_trip([](std::vector<ParamGroup> g) { return optim::make_adamw(std::move(g), {}); });
}
TEST(Optim, SGDStateRoundTripContinuesBitwise) {
  check_round_trip(
      [](std::vector<ParamGroup> g) { return optim::make_sgd(std::move(g), {.momentum = 0.9, .nesterov = true}); });
}

TEST(Optim, AdamWStateNamesAndSkippedParameters) {
  Problem pb(3);
  auto opt = optim::make_adamw(pb.groups(), {});
  EXPECT_EQ(opt->state().size(), 1u);  // just "step" before any update
  Generator gen(5);
  pb.set_grads(gen);
  const Tensor unused_before = clone(pb.params[3].second.detach());
  opt->step();
  auto st = opt->state();
  std::vector<std::string> names;
  for (auto& [n, t] : st) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"step", "exp_avg.h.0.weight", "exp_avg_sq.h.0.weight",
                                             "step.h.0.weight", "exp_avg.h.1.weight", "exp_avg_sq.h.1.weight",
                                             "step.h.1.weight", "exp_avg.h.0.bias", "exp_avg_sq.h.0.bias",
                                             "step.h.0.bias"}));
  EXPECT_EQ(st[0].second.dtype(), DType::i64);
  EXPECT_EQ(st[0].second.dim(), 0);
  EXPECT_EQ(st[0].second.item(), 1);
  EXPECT_TRUE(bitwise_equal(pb.params[3].second, unused_before));  // no grad: untouched, no decay
}

// Note [Optimizer state in one buffer]: each moment of every parameter updated in a step is a
// view into one allocation, on a 64-byte boundary, none overlapping; a loaded state is laid out
// the same way, and a parameter whose first gradient comes later gets state of its own.
TEST(Optim, AdamWMomentsLiveInOneAllocation) {
  auto check_packed = [](const nn::NamedTensors& st, size_t expect_each) {
    for (const char* kind : {"exp_avg.", "exp_avg_sq."}) {
      std::vector<Tensor> ts;
      for (auto& [n, t] : st)
        if (n.rfind(kind, 0) == 0) ts.push_back(t);
      ASSERT_EQ(ts.size(), expect_each) << kind;
      std::vector<std::pair<int64_t, int64_t>> spans;
      for (const Tensor& t : ts) {
        EXPECT_EQ(t.storage().get(), ts[0].storage().get()) << kind << " in more than one allocation";
        EXPECT_TRUE(t.is_contiguous());
        EXPECT_EQ(t.offset() % 16, 0) << kind << " view at element " << t.offset();  // 64 bytes
        spans.emplace_back(t.offset(), t.offset() + t.numel());
      }
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << kind;
      EXPECT_NE(ts[0].storage().get(), nullptr);
    }
  };
  Problem pb(3);
  auto opt = optim::make_adamw(pb.groups(), {});
  Generator gen(5);
  pb.set_grads(gen);
  opt->step();
  check_packed(opt->state(), 3);
  nn::NamedTensors saved;
  for (auto& [n, t] : opt->state()) saved.emplace_back(n, clone(t));
  Problem fresh_pb(3);
  auto fresh = optim::make_adamw(fresh_pb.groups(), {});
  fresh->load_state(saved);
  check_packed(fresh->state(), 3);
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(bitwise_equal(fresh->state()[i].second, saved[i].second));
  // "unused" gets its first gradient now: its moments are made then, the others stay where they are.
  const Tensor before = opt->state()[1].second;
  for (auto [name, p] : pb.params) p.set_grad(rnd(gen, p.shape(), DType::f32));
  opt->step();
  EXPECT_EQ(opt->state().size(), 1u + 3 * 4);
  EXPECT_EQ(opt->state()[1].second.storage().get(), before.storage().get());
}

TEST(Optim, StrictLoadRefusesAndChangesNothing) {
  Problem pb(3);
  auto opt = optim::make_adamw(pb.groups(), {});
  Generator gen(5);
  pb.set_grads(gen);
  opt->step();
  const nn::NamedTensors good = opt->state();
  auto clone_state = [&] {
    nn::NamedTensors s;
    for (auto& [n, t] : good) s.emplace_back(n, clone(t));
    return s;
  };
  Problem fresh_pb(3);
  auto fresh = optim::make_adamw(fresh_pb.groups(), {});
  auto expect_refused = [&](const nn::NamedTensors& s, const std::string& want) {
    const std::string err = error_of([&] { fresh->load_state(s); });
    EXPECT_NE(err.find(want), std::string::npos) << "error was: " << err;
    EXPECT_EQ(fresh->steps(), 0);
    EXPECT_EQ(fresh->state().size(), 1u);
  };
  {
    auto s = clone_state();
    s.erase(s.begin());
    expect_refused(s, "missing 'step'");
  }
  {
    auto s = clone_state();
    s.erase(s.begin() + 2);  // exp_avg_sq.h.0.weight
    expect_refused(s, "missing 'exp_avg_sq.h.0.weight'");
  }
  {
    auto s = clone_state();
    s.emplace_back("exp_avg.h.9.weight", zeros({2}));
    expect_refused(s, "no parameter named 'h.9.weight'");
  }
  {
    auto s = clone_state();
    s.emplace_back("momentum_buffer.h.0.bias", zeros({4}));
    expect_refused(s, "unexpected entry 'momentum_buffer.h.0.bias'");
  }
  {
    auto s = clone_state();
    s[1].second = zeros({4, 6});
    expect_refused(s, "'exp_avg.h.0.weight' has shape [4, 6], but parameter 'h.0.weight' has shape [6, 4]");
  }
  {
    auto s = clone_state();
    s[0].second = full({}, -1, DType::i64);
    expect_refused(s, "'step': expected a non-negative whole number");
  }
  // And the good state loads (values copied: later changes to the source do not leak in).
  auto s = clone_state();
  fresh->load_state(s);
  EXPECT_EQ(fresh->steps(), 1);
  fill_(s[1].second, 42.0);
  EXPECT_TRUE(bitwise_equal(fresh->state()[1].second, good[1].second));
}

TEST(Optim, SGDWithoutMomentumHasNoBuffers) {
  Problem pb(3);
  auto opt = optim::make_sgd(pb.groups(), {.lr = 0.1});
  Generator gen(5);
  pb.set_grads(gen);
  const Tensor w = clone(pb.params[0].second.detach()), g = clone(pb.params[0].second.grad());
  opt->step();
  EXPECT_EQ(opt->state().size(), 1u);
  // p -= lr * (g + wd * p)
  EXPECT_EQ(compare(pb.params[0].second, w - (g + w * 0.1) * 0.1, 1e-7, 1e-6), "");
  nn::NamedTensors bad = {{"step", full({}, 1, DType::i64)}, {"momentum_buffer.h.0.bias", zeros({4})}};
  EXPECT_NE(error_of([&] { opt->load_state(bad); }).find("unexpected entry 'momentum_buffer.h.0.bias'"),
            std::string::npos);
}

TEST(Optim, RefusesNonF32ParametersAndBadOptions) {
  Tensor p = zeros({3}, DType::bf16);
  p.set_requires_grad(true);
  std::vector<ParamGroup> g{{.params = {{"w", p}}}};
  EXPECT_NE(error_of([&] { optim::make_adamw(g, {}); }).find("parameter 'w' is bf16"), std::string::npos);
  Tensor q = zeros({3});
  q.set_requires_grad(true);
  std::vector<ParamGroup> dup{{.params = {{"w", q}, {"w", q}}}};
  EXPECT_NE(error_of([&] { optim::make_sgd(dup, {}); }).find("appears twice"), std::string::npos);
  std::vector<ParamGroup> ok{{.params = {{"w", q}}}};
  EXPECT_NE(error_of([&] { optim::make_adamw(ok, {.beta2 = 1.0}); }).find("beta2"), std::string::npos);
  EXPECT_NE(error_of([&] { optim::make_sgd(ok, {.nesterov = true}); }).find("nesterov needs momentum"),
            std::string::npos);
}

TEST(Optim, ZeroGradClearsGradients) {
  Problem pb(3);
  auto opt = optim::make_adamw(pb.groups(), {});
  Generator gen(5);
  pb.set_grads(gen);
  opt->zero_grad();
  for (auto& [n, p] : pb.params) EXPECT_FALSE(p.grad().defined()) << n;
}

TEST(ClipGradNorm, ExactSmallCaseAndNoClipBelowMax) {
  Tensor a = zeros({2}), b = zeros({1});
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  a.set_grad(from_vector({3, 0}, {2}));
  b.set_grad(from_vector({4}, {1}));
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm({a, b}, 10.0), 5.0);
  EXPECT_EQ(to_vector(a.grad()), (std::vector<double>{3, 0}));  // 10/5 > 1: untouched
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm({a, b}, 1.0), 5.0);
  const float s = float(1.0 / (5.0 + 1e-6));  // the scale, rounded to the grads' fp32
  EXPECT_EQ(to_vector(a.grad())[0], double(3.0f * s));
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm({}, 1.0), 0.0);
}

TEST(ClipGradNorm, NonFiniteNormIsReportedNotApplied) {
  Tensor a = zeros({2});
  a.set_requires_grad(true);
  a.set_grad(from_vector({1, INFINITY}, {2}));
  EXPECT_TRUE(std::isinf(optim::clip_grad_norm({a}, 1.0)));
  EXPECT_EQ(to_vector(a.grad())[0], 1.0);
  a.set_grad(from_vector({1, NAN}, {2}));
  EXPECT_TRUE(std::isnan(optim::clip_grad_norm({a}, 1.0)));
  EXPECT_EQ(to_vector(a.grad())[0], 1.0);
}

}  // namespace
}  // namespace blu::test
