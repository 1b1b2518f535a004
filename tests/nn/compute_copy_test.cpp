// Compute copies (Note [Compute copies], nn/compute_copy.h): a forward reuses each parameter's
// 16-bit copy and casts only when the parameter was written since (load_state_dict, copy_, an SGD
// step, to()); AdamW leaves every copy equal to to_dtype(param) and current; gradients still
// reach the fp32 parameters; and bf16/f16 GPT training gives the same losses and weights bit for
// bit with copies on as with the plain per-forward casts (copies off); so does Llama training, whose
// sibling projections read their copies as rows of one buffer (Note [Sibling linears]).
#include <gtest/gtest.h>

#include <cstring>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/ops/dispatch.h"
#include "blu/optim/optimizer.h"
#include "common/checks.h"

namespace blu::nn {
namespace {

using models::GPT;
using models::GPTConfig;
using models::KVCache;

using test::bitwise_equal;

// Counts the "cast" ops dispatched while alive.
struct CastCounter {
  int casts = 0, aliases = 0;
  int handle;
  CastCounter() {
    handle = add_op_observer([this](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
      casts += std::string_view(op.name) == "cast";
      aliases += std::string_view(op.name) == "cast_with_copy";
    });
  }
  ~CastCounter() { remove_op_observer(handle); }
};

Tensor input(int64_t n, int64_t c, DType dt, uint64_t seed) {
  Generator g(seed);
  return to_dtype(randn({n, c}, DType::f32, kCPU, &g), dt);
}

TEST(ComputeCopy, ForwardCastsOnlyWhenTheParameterWasWritten) {
  Linear lin(5, 3);
  Generator gen(1);
  init_normal_(lin.weight, 0.5, gen);
  const Tensor x = input(4, 5, DType::bf16, 2);
  auto forward_casts = [&] {
    int casts = 0;
    Tensor y;
    {
      CastCounter cc;
      y = lin.forward(x);
      casts = cc.casts;
      EXPECT_EQ(cc.aliases, 2);
    }
    EXPECT_EQ(y.dtype(), DType::bf16);
    // The same values as the plain cast path.
    EXPECT_TRUE(bitwise_equal(y, linear(x, to_dtype(lin.weight, DType::bf16), to_dtype(lin.bias, DType::bf16))));
    return casts;
  };
  EXPECT_EQ(forward_casts(), 2);  // first use: weight and bias cast once
  EXPECT_EQ(forward_casts(), 0);  // reused
  {
    NoGradGuard ng;
    copy_(narrow(lin.weight, 0, 1, 1), full({1, 5}, 2.0));  // an in-place write through a view
  }
  EXPECT_EQ(forward_casts(), 1);  // only the weight is re-cast
  EXPECT_EQ(forward_casts(), 0);
  NamedTensors sd;
  for (auto& [name, t] : lin.state_dict()) sd.emplace_back(name, mul(t, 3.0));
  lin.load_state_dict(sd);
  EXPECT_EQ(forward_casts(), 2);  // both were written by load_state_dict
  // An fp32 forward never touches the copies.
  CastCounter cc;
  (void)lin.forward(input(4, 5, DType::f32, 3));
  EXPECT_EQ(cc.casts + cc.aliases, 0);
}

TEST(ComputeCopy, GradientsReachTheF32Parameters) {
  for (bool copies : {true, false}) {
    Linear lin(5, 3);
    Generator gen(4);
    init_normal_(lin.weight, 0.5, gen);
    lin.set_compute_copies(copies);
    lin.forward(input(4, 5, DType::bf16, 5));  // makes the copies
    const Tensor y = lin.forward(input(4, 5, DType::bf16, 5));
    sum(to_dtype(y, DType::f32)).backward();
    ASSERT_TRUE(lin.weight.grad().defined());
    EXPECT_EQ(lin.weight.grad().dtype(), DType::f32);
    EXPECT_EQ(lin.bias.grad().dtype(), DType::f32);
    EXPECT_EQ(lin.compute_copies().size(), 2u);
    EXPECT_EQ(lin.compute_copies()[0].second->tensor().defined(), copies);
  }
}

TEST(ComputeCopy, ModuleToAndSwitchingOffDropCopies) {
  Linear lin(3, 2);
  lin.forward(input(1, 3, DType::bf16, 6));
  auto c = lin.compute_copies()[0].second;
  ASSERT_TRUE(c->tensor().defined());
  EXPECT_TRUE(c->current(lin.weight));
  lin.to(DType::f64);  // new parameter tensors: the copies go
  EXPECT_FALSE(c->tensor().defined());
  const Tensor y = lin.forward(input(1, 3, DType::bf16, 6));
  EXPECT_TRUE(bitwise_equal(c->tensor(), to_dtype(lin.weight, DType::bf16)));
  EXPECT_TRUE(c->current(lin.weight));
  lin.set_compute_copies(false);
  EXPECT_FALSE(c->tensor().defined());
  lin.forward(input(1, 3, DType::bf16, 6));
  EXPECT_FALSE(c->tensor().defined());
  Tensor stranger = zeros({2, 3});
  try {
    lin.cast_param(stranger, DType::bf16);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a parameter of this module"), std::string::npos);
  }
}

// A tiny GPT (or Llama) trained a few steps in `dtype` compute; returns the losses, leaves the model.
struct TrainRun {
  std::unique_ptr<models::CausalLM> model;
  std::vector<double> losses;
};
TrainRun train(DType dtype, bool copies, bool adamw, int steps, bool check_copies = false, bool llama = false) {
  TrainRun r;
  const GPTConfig cfg = ::blu::test::tiny_gpt();
  if (llama)
    r.model = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
  else
    r.model = std::make_unique<GPT>(cfg, 7);
  r.model->set_compute_dtype(dtype);
  r.model->set_compute_copies(copies);
  auto groups = optim::decay_groups(r.model->named_parameters(), 0.1);
  auto opt = adamw ? optim::make_adamw(groups, {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8})
                   : optim::make_sgd(groups, {.lr = 3e-2, .momentum = 0.9});
  opt->attach_compute_copies(r.model->compute_copies());
  Generator data(11);
  const auto params = r.model->parameters();
  for (int s = 0; s < steps; ++s) {
    const Tensor idx = randint(0, r.model->vocab_size(), {2, 16}, DType::i64, kCPU, &data);
    const Tensor tgt = randint(0, r.model->vocab_size(), {2, 16}, DType::i64, kCPU, &data);
    opt->zero_grad();
    const models::LMOutput out = r.model->forward(idx, tgt);
    r.losses.push_back(out.loss.item());
    out.loss.backward();
    optim::clip_grad_norm(params, 1.0);
    opt->step();
    if (!check_copies) continue;
    for (const auto& [p, c] : r.model->compute_copies()) {
      if (!c->tensor().defined()) continue;  // wte/wpe as embeddings are read in fp32
      // AdamW wrote every copy in its pass: current, and equal to the cast. SGD did not: stale.
      EXPECT_EQ(c->current(p), adamw);
      if (adamw) {
        EXPECT_TRUE(bitwise_equal(c->tensor(), to_dtype(p, dtype)));
      }
    }
  }
  return r;
}

TEST(ComputeCopy, GptTrainingIsBitwiseTheSameWithAndWithoutCopies) {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (bool adamw : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (adamw ? " adamw" : " sgd"));
      const TrainRun on = train(dt, true, adamw, 4, true), off = train(dt, false, adamw, 4);
      ASSERT_EQ(on.losses.size(), off.losses.size());
      for (size_t i = 0; i < on.losses.size(); ++i) EXPECT_EQ(on.losses[i], off.losses[i]) << "step " << i;
      const NamedTensors a = on.model->named_parameters(), b = off.model->named_parameters();
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].second, b[i].second)) << a[i].first;
      const GPT fresh(::blu::test::tiny_gpt(), 7);  // it trains: the weights moved
      EXPECT_FALSE(bitwise_equal((*dynamic_cast<GPT&>(*on.model).h)[0].mlp->c_fc->weight, (*fresh.h)[0].mlp->c_fc->weight));
    }
  }
}

// Llama's q/k/v and gate/up run as one GEMM each over their compute copies kept side by side
// (Note [Sibling linears]): training is bitwise that of per-forward casts and concatenations.
TEST(ComputeCopy, LlamaTrainingIsBitwiseTheSameWithAndWithoutCopies) {
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    const TrainRun on = train(DType::bf16, true, adamw, 4, true, true), off = train(DType::bf16, false, adamw, 4, false, true);
    ASSERT_EQ(on.losses.size(), off.losses.size());
    for (size_t i = 0; i < on.losses.size(); ++i) EXPECT_EQ(on.losses[i], off.losses[i]) << "step " << i;
    const NamedTensors a = on.model->named_parameters(), b = off.model->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].second, b[i].second)) << a[i].first;
    // The copies of one layer's q, k and v are adjacent rows of one buffer, AdamW kept them so.
    auto& attn = *(*dynamic_cast<models::Llama&>(*on.model).model->layers)[0].self_attn;
    const auto cq = attn.q_proj->compute_copy_of(attn.q_proj->weight), ck = attn.k_proj->compute_copy_of(attn.k_proj->weight),
               cv = attn.v_proj->compute_copy_of(attn.v_proj->weight);
    ASSERT_TRUE(cq && ck && cv);
    EXPECT_EQ(cq->tensor().storage(), cv->tensor().storage());
    EXPECT_EQ(ck->tensor().offset(), cq->tensor().offset() + cq->tensor().numel());
    EXPECT_EQ(cv->tensor().offset(), ck->tensor().offset() + ck->tensor().numel());
  }
}

TEST(ComputeCopy, AfterAdamWTheForwardCastsNoParameter) {
  TrainRun r = train(DType::bf16, true, true, 2);
  Generator data(3);
  const Tensor idx = randint(0, 101, {2, 16}, DType::i64, kCPU, &data);
  NoGradGuard ng;
  CastCounter on;
  const Tensor logits_on = r.model->forward(idx).logits;
  const int casts_on = on.casts, aliases_on = on.aliases;
  r.model->set_compute_copies(false);
  CastCounter off;
  const Tensor logits_off = r.model->forward(idx).logits;
  EXPECT_TRUE(bitwise_equal(logits_on, logits_off));
  EXPECT_EQ(aliases_on, 2 * (4 * 2 + 2 * 2) + 2 + 1);  // 2 blocks of 4 Linear + 2 LayerNorm; ln_f; wte
  EXPECT_EQ(off.aliases, 0);
  EXPECT_EQ(off.casts - casts_on, aliases_on);  // every weight came from its copy: no cast
}

TEST(ComputeCopy, Fp32ModeMakesNoCopies) {
  TrainRun r = train(DType::f32, true, true, 2);
  for (const auto& [p, c] : r.model->compute_copies()) EXPECT_FALSE(c->tensor().defined());
  const Linear lin(2, 2);
  EXPECT_TRUE(lin.cast_param(lin.weight, DType::f32).is_same(lin.weight));
}

}  // namespace
}  // namespace blu::nn
