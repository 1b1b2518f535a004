// GEMM epilogues chosen by the compiler (compiler/epilogue.h, Note [GEMM epilogues]) and the
// check mode (CompileOptions::check, BLU_COMPILE_CHECK=1) on the CPU:
// - a model written plainly — `x + linear(relu(linear(x, w1) + b1), w2, b2)` — trained six steps
//   compiled: the pass folds both adds into their GEMMs (a residual, a bias), the two products get
//   no bytes in the plan (two buffers fewer, never a higher live peak), and losses and weights equal
//   eager's within fp32 rounding (the residual and bias are the GEMM's initial value, not a sum
//   after it: not bitwise);
// - the check mode runs each folded region against its ops run eagerly on the same inputs and
//   reports a difference at rounding level;
// - what is not folded: a product read by a second op, an add of another shape, a linear that has
//   a bias already (no second bias), a product that is a step output; and nothing with `add`
//   excluded (BLU_COMPILE_EXCLUDE, --compile-exclude);
// - a tanh GELU after a linear with its bias (`gelu = true` in the plain decoder): folded, bitwise
//   eager on the CPU; not folded for the exact GELU, without a bias, or without a backward;
// - the tiny GPT-2 and Llama pass their skip connections to the projections by hand, so the pass
//   finds no add there; GPT-2's GELU after c_fc folds, and so does c_fc's bias gradient into the
//   GELU's backward (on the CPU eager's kernels run, so its compiled step stays bitwise:
//   CompiledVsEager in compiler_test; on the GPU the fold's kernel gives eager's bits:
//   CudaElementwise.GeluAndBackwardSumsTheBiasGradientBitwise, CompilerCuda.CompiledStepIsGraph…).
// The GPU replay is CompilerCuda.GemmEpiloguesMatchEagerAndCheck.
// Run: ctest -R Epilogue, or build/tests/test_compiler --gtest_filter='*Epilogue*'.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "blu/blu.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/epilogue.h"
#include "blu/compiler/exclude.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "common/checks.h"
#include "common/plain_decoder.h"
#include "common/tiny_gpt.h"

namespace blu::compiler {
namespace {

using test::PlainDecoder;
constexpr int64_t kB = 2, kT = 8, kC = 16;

struct PlainRun {
  std::vector<double> losses;
  std::vector<Tensor> params;
  std::unique_ptr<CompiledStep> cs;
};

PlainRun train(const CompileOptions* opts, test::PlainDecoderSize size = {}) {
  PlainDecoder m(11, kCPU, size);
  PlainRun r;
  if (opts) r.cs = std::make_unique<CompiledStep>(*opts);
  Tensor idx = empty({m.n.B, m.n.T}, DType::i32), tg = empty({m.n.B, m.n.T}, DType::i32);
  for (int s = 0; s < 6; ++s) {
    {
      NoGradGuard ng;
      copy_(idx, m.batch(s).first);
      copy_(tg, m.batch(s).second);
    }
    Tensor loss;
    auto one = [&] { loss = m.step(idx, tg, 0.1); };
    if (r.cs)
      r.cs->run({idx, tg}, one);
    else
      one();
    r.losses.push_back(loss.item());
  }
  for (Tensor* p : m.params()) r.params.push_back(clone(p->detach()));
  return r;
}

TEST(Epilogue, PlainModelFoldsItsAddsIntoTheGemmsAndMatchesEager) {
  const PlainRun eager = train(nullptr);
  std::ostringstream log;
  CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  const PlainRun compiled = train(&o);
  ASSERT_EQ(compiled.cs->variants().size(), 1u) << log.str();
  const Variant& v = *compiled.cs->variants()[0];
  EXPECT_EQ(v.epilogues, 2) << log.str();
  EXPECT_NE(log.str().find("2 GEMM epilogues"), std::string::npos) << log.str();
  EXPECT_EQ(compiled.cs->counts().compiled, 5);
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_NEAR(compiled.losses[i], eager.losses[i], 1e-5 * std::abs(eager.losses[i])) << "step " << i + 1;
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_LT(max(abs(sub(compiled.params[i], eager.params[i]))).item(), 1e-5) << "parameter " << i;

  // The products are planned no bytes: two arena buffers fewer than without the pass.
  CompileOptions plain = o;
  plain.epilogues = false;
  std::ostringstream log2;
  plain.log_stream = &log2;
  const PlainRun unfolded = train(&plain);
  const MemoryPlan& with = v.runtime->plan();
  const MemoryPlan& without = unfolded.cs->variants()[0]->runtime->plan();
  EXPECT_EQ(unfolded.cs->variants()[0]->epilogues, 0);
  EXPECT_EQ(with.arena_buffers + 2, without.arena_buffers) << with.summary() << " | " << without.summary();
  EXPECT_LE(with.peak_live_bytes, without.peak_live_bytes) << with.summary() << " | " << without.summary();
  EXPECT_EQ(check_plan(v.runtime->graph(), with), "");
}

TEST(Epilogue, CheckModeReportsEachRegionAgainstEager) {
  std::ostringstream log;
  CompileOptions o;
  o.check = true;
  o.log_stream = &log;
  const PlainRun compiled = train(&o);
  const std::vector<RegionCheck>& checks = compiled.cs->region_checks();
  ASSERT_EQ(checks.size(), 2u) << log.str();
  for (const RegionCheck& c : checks) {
    EXPECT_EQ(c.ops.rfind("linear", 0), 0u) << c.ops;
    EXPECT_NE(c.ops.find("add"), std::string::npos) << c.ops;
    EXPECT_TRUE(std::isfinite(c.max_diff));
    EXPECT_LT(c.max_diff, 1e-5) << c.ops;
  }
  EXPECT_NE(log.str().find("compile: check: region"), std::string::npos) << log.str();
  // Check mode replays without CUDA graphs and changes nothing else: the losses are the ones of
  // the compiled run without it.
  CompileOptions plain;
  std::ostringstream log2;
  plain.log_stream = &log2;
  const PlainRun unchecked = train(&plain);
  EXPECT_EQ(compiled.losses, unchecked.losses);
}

// The captured step of `body` (run once eagerly first, as the compiled step's warm-up does).
Graph capture(const std::function<void()>& body) {
  body();
  Capture cap;
  body();
  return cap.finish();
}

TEST(Epilogue, WhatIsNotFolded) {
  manual_seed(3);
  const Tensor x = randn({kB, kT, kC}), w = randn({kC, kC}), b = randn({kC});
  const Tensor r = randn({kB, kT, kC}), r2 = randn({kB, kT, 1});
  Tensor kept;
  auto count = [&](const std::function<Tensor()>& f) {
    return epilogue_regions(capture([&] { kept = f(); })).size();
  };
  NoGradGuard ng;
  EXPECT_EQ(count([&] { return linear(x, w) + r; }), 1u);            // residual
  EXPECT_EQ(count([&] { return linear(x, w) + b; }), 1u);            // bias
  EXPECT_EQ(count([&] { return r + linear(x, w, b); }), 1u);         // residual on the left, after a bias
  EXPECT_EQ(count([&] { return linear(x, w, b) + b; }), 0u);         // a bias already
  EXPECT_EQ(count([&] { return linear(x, w) + r2; }), 0u);           // another shape
  EXPECT_EQ(count([&] {
              const Tensor y = linear(x, w);
              return (y + r) * y;                                       // the product read twice
            }),
            0u);
  set_excluded_ops({"add"});
  EXPECT_EQ(count([&] { return linear(x, w) + r; }), 0u);
  set_excluded_ops({});
}

// A GELU after a linear with its bias: one region {linear, views, gelu} writing the GELU and the
// product the GELU's gradient reads. On the CPU it runs eager's two kernels, so with the residual
// fold excluded the compiled run is bitwise eager; with it, both folds and rounding-level agreement.
TEST(Epilogue, GeluAfterALinearFoldsAndMatchesEager) {
  const test::PlainDecoderSize gelu_size{.layers = 2, .gelu = true};
  const PlainRun eager = train(nullptr, gelu_size);
  std::ostringstream log;
  CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  set_excluded_ops({"add"});
  const PlainRun gelu_only = train(&o, gelu_size);
  set_excluded_ops({});
  ASSERT_EQ(gelu_only.cs->variants().size(), 1u) << log.str();
  EXPECT_EQ(gelu_only.cs->variants()[0]->epilogues, 2) << log.str();
  EXPECT_EQ(gelu_only.losses, eager.losses);
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(gelu_only.params[i], eager.params[i])) << "parameter " << i;

  CompileOptions c;
  c.check = true;
  c.log_stream = &log;
  const PlainRun both = train(&c, gelu_size);
  EXPECT_EQ(both.cs->variants()[0]->epilogues, 4) << log.str();
  int gelus = 0;
  for (const RegionCheck& rc : both.cs->region_checks()) {
    gelus += rc.ops.find("gelu") != std::string::npos;
    EXPECT_LT(rc.max_diff, 1e-5) << rc.ops;
  }
  EXPECT_EQ(gelus, 2) << log.str();
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_NEAR(both.losses[i], eager.losses[i], 1e-5 * std::abs(eager.losses[i])) << "step " << i + 1;
}

TEST(Epilogue, WhatGeluIsNotFolded) {
  manual_seed(4);
  const Tensor x0 = randn({kB, kT, kC}), w = randn({kC, kC}), b = randn({kC});
  auto count = [&](const std::function<Tensor(const Tensor&)>& f) {
    return epilogue_regions(capture([&] {
             Tensor x = x0.detach();
             x.set_requires_grad();
             sum(f(x)).backward();
           }))
        .size();
  };
  EXPECT_EQ(count([&](const Tensor& x) { return gelu(linear(x, w, b), true); }), 1u);
  EXPECT_EQ(count([&](const Tensor& x) { return gelu(linear(x, w, b), false); }), 0u);  // erf: not cuBLASLt's
  EXPECT_EQ(count([&](const Tensor& x) { return gelu(linear(x, w), true); }), 0u);      // no bias
  EXPECT_EQ(count([&](const Tensor& x) {
              const Tensor y = linear(x, w, b);
              return gelu(y, true) * y;  // read again after the GELU: still one fold, the GEMM writes it
            }),
            1u);
  {
    NoGradGuard ng;  // nothing reads the product after the GELU: no auxiliary output to write
    EXPECT_EQ(epilogue_regions(capture([&] { (void)gelu(linear(x0, w, b), true); })).size(), 0u);
  }
  set_excluded_ops({"gelu"});
  EXPECT_EQ(count([&](const Tensor& x) { return gelu(linear(x, w, b), true); }), 0u);
  set_excluded_ops({});
}

TEST(Epilogue, HandFusedModelsHaveNothingToFold) {
  for (const std::string family : {"gpt2", "llama"}) {
    std::unique_ptr<models::CausalLM> m;
    if (family == "gpt2")
      m = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 7);
    else
      m = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
    dist::Strategy strat(*m, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    const auto [idx, tg] = PlainDecoder(1, kCPU).batch(0);
    const Tensor i2 = idx, t2 = tg;
    const Graph g = capture(
        [&] { (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{i2, t2}; }, 1e-3, 1.0); });
    int linears = 0;
    for (const Op& op : g.ops) linears += op.name == "linear";
    EXPECT_GT(linears, 0) << family;
    // No add to fold; GPT-2's MLP (c_fc, then gelu_linear: a tanh GELU and c_proj) has its GELU
    // folded into c_fc and c_fc's bias gradient into the GELU's backward, one each a layer.
    int adds = 0, gelus = 0, bias_grads = 0;
    for (const FusedRegion& r : epilogue_regions(g)) {
      const std::string& last = g.ops[size_t(r.ops.back())].name;
      (last == "gelu" ? gelus : last.starts_with("linear_weight_grad") ? bias_grads : adds) += 1;
    }
    const int layers = family == "gpt2" ? int(::blu::test::tiny_gpt().n_layer) : 0;
    EXPECT_EQ(adds, 0) << family;
    EXPECT_EQ(gelus, layers) << family;
    EXPECT_EQ(bias_grads, layers) << family;
    set_excluded_ops({"gelu_and_backward"});
    EXPECT_EQ(epilogue_regions(g).size(), size_t(layers)) << family;  // the GELU folds alone
    set_excluded_ops({});
  }
}

}  // namespace
}  // namespace blu::compiler
