// nn/module and nn/layers: registration order and dotted names, state dicts (round trip and the
// strict errors), train/eval, to(dtype), zero_grad; the GPT-2 presets' parameter counts.
#include <gtest/gtest.h>

#include "common/checks.h"
#include "common/opinfo.h"
#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/nn/layers.h"
#include "blu/ops/dispatch.h"

namespace blu::nn {
namespace {

using models::GPT;
using models::GPTConfig;
using models::KVCache;

class Tiny : public Module {
 public:
  Tiny() {
    register_parameter("scale", scale, ones({3}));
    fc = std::make_shared<Linear>(3, 2);
    register_module("fc", fc);
    register_buffer("steps", steps, zeros({1}, DType::i64));
    inner = std::make_shared<ModuleList<LayerNorm>>();
    inner->push_back(std::make_shared<LayerNorm>(2));
    inner->push_back(std::make_shared<LayerNorm>(2, /*bias=*/false));
    register_module("inner", inner);
    drop = std::make_shared<Dropout>(0.5);
    register_module("drop", drop);
  }
  Tensor scale, steps;
  std::shared_ptr<Linear> fc;
  std::shared_ptr<ModuleList<LayerNorm>> inner;
  std::shared_ptr<Dropout> drop;
};

std::vector<std::string> names(const NamedTensors& nt) {
  std::vector<std::string> out;
  for (auto& [n, _] : nt) out.push_back(n);
  return out;
}

void expect_throws_with(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Module, RegistrationOrderAndNames) {
  Tiny m;
  EXPECT_EQ(names(m.named_parameters()),
            (std::vector<std::string>{"scale", "fc.weight", "fc.bias", "inner.0.weight", "inner.0.bias",
                                      "inner.1.weight"}));
  EXPECT_EQ(names(m.named_buffers()), std::vector<std::string>{"steps"});
  EXPECT_EQ(names(m.state_dict()).back(), "steps");
  EXPECT_EQ(m.num_parameters(), 3 + 6 + 2 + 2 + 2 + 2);
  for (auto& [n, p] : m.named_parameters()) {
    EXPECT_TRUE(p.requires_grad()) << n;
    EXPECT_TRUE(p.is_leaf()) << n;
  }
  // Handles: the parameter list shares the module's tensors.
  EXPECT_TRUE(m.parameters()[1].is_same(m.fc->weight));
}

TEST(Module, StateDictRoundTrip) {
  Tiny a, b;
  Generator gen(3);
  for (auto& p : a.parameters()) init_normal_(p, 1.0, gen);
  {
    NoGradGuard ng;
    fill_(a.steps, 7);
  }
  b.load_state_dict(a.state_dict());
  auto sa = a.state_dict(), sb = b.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(to_vector(sa[i].second), to_vector(sb[i].second)) << sa[i].first;
    EXPECT_FALSE(sa[i].second.is_same(sb[i].second)) << "load copies values, it does not share tensors";
  }
  EXPECT_TRUE(b.fc->weight.requires_grad());
}

TEST(Module, StrictLoadErrorsChangeNothing) {
  Tiny m;
  const auto before = to_vector(m.fc->weight);
  auto st = m.state_dict();
  for (auto& [n, t] : st)
    if (is_floating(t.dtype())) t = add(t.detach(), 1.0);

  auto missing = st;
  missing.erase(missing.begin() + 1);
  expect_throws_with([&] { m.load_state_dict(missing); }, "missing 'fc.weight'");

  auto extra = st;
  extra.emplace_back("fc.extra", zeros({1}));
  expect_throws_with([&] { m.load_state_dict(extra); }, "unexpected 'fc.extra'");

  auto wrong = st;
  wrong[4].second = zeros({3});  // inner.0.bias is [2]
  expect_throws_with([&] { m.load_state_dict(wrong); }, "'inner.0.bias' has shape [3], expected [2]");

  auto twice = st;
  twice.push_back(st[0]);
  expect_throws_with([&] { m.load_state_dict(twice); }, "'scale' appears twice");

  EXPECT_EQ(to_vector(m.fc->weight), before);
}

TEST(Module, TrainEvalReachesEveryModule) {
  Tiny m;
  EXPECT_TRUE(m.is_training());
  EXPECT_TRUE(m.drop->is_training());
  m.eval();
  EXPECT_FALSE(m.is_training());
  EXPECT_FALSE(m.inner->is_training());
  EXPECT_FALSE((*m.inner)[1].is_training());
  Tensor x = ones({4, 8});
  EXPECT_TRUE(m.drop->forward(x).is_same(x)) << "dropout is the identity in eval mode";
  m.train();
  EXPECT_TRUE(m.drop->is_training());
}

TEST(Module, ToDtypeKeepsLeavesAndNames) {
  Tiny m;
  Tensor old = m.fc->weight;
  m.to(DType::f64);
  EXPECT_EQ(m.fc->weight.dtype(), DType::f64);
  EXPECT_FALSE(m.fc->weight.is_same(old));
  EXPECT_EQ(m.steps.dtype(), DType::i64) << "integer buffers are not cast";
  for (auto& [n, p] : m.named_parameters()) {
    EXPECT_EQ(p.dtype(), DType::f64) << n;
    EXPECT_TRUE(p.requires_grad() && p.is_leaf()) << n;
  }
  EXPECT_EQ(to_vector(m.fc->weight), to_vector(old));
  m.to(kCPU);  // no-op
  expect_throws_with([&] { m.to(DType::i32); }, "floating");
}

// Embedding's row sink: backward hands the output gradient and the ids to the sink; the weight
// gets only the gradients of its other uses; no sink under no-grad; removing it restores the
// usual gradient.
TEST(Module, EmbeddingRowSinkTakesTheRows) {
  nn::Embedding emb(5, 2);
  emb.weight = from_vector({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {5, 2});
  emb.weight.set_requires_grad(true);
  const Tensor idx = from_vector({3, 1, 3}, {3}, DType::i64);
  std::vector<double> ids, rows;
  emb.set_row_grad_sink([&](const Tensor& i, const Tensor& g) {
    ids = to_vector(i);
    rows = to_vector(g);
  });
  const Tensor y = emb.forward(idx);
  EXPECT_EQ(to_vector(y), (std::vector<double>{7, 8, 3, 4, 7, 8}));
  // A second, dense use of the weight (as a tied output layer would be).
  sum(add(mul(y, 2.0), sum(emb.weight))).backward();
  EXPECT_EQ(ids, (std::vector<double>{3, 1, 3}));
  EXPECT_EQ(rows, (std::vector<double>{2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(to_vector(emb.weight.grad()), std::vector<double>(10, 6.0));  // the dense use only: 6 = 3 rows · 2 cols
  {
    NoGradGuard no_grad;
    EXPECT_FALSE(emb.forward(idx).requires_grad());
  }
  emb.set_row_grad_sink({});
  EXPECT_FALSE(emb.has_row_grad_sink());
  emb.weight.set_grad(Tensor());
  sum(emb.forward(idx)).backward();
  EXPECT_EQ(to_vector(emb.weight.grad()), (std::vector<double>{0, 0, 1, 1, 0, 0, 2, 2, 0, 0}));
}

TEST(Module, ZeroGrad) {
  Tiny m;
  m.scale.set_grad(ones({3}));
  m.zero_grad();
  EXPECT_FALSE(m.scale.grad().defined());
}

TEST(Layers, InitNormalIsSeeded) {
  Linear a(4, 5), b(4, 5);
  Generator g1(11), g2(11);
  init_normal_(a.weight, 0.02, g1);
  init_normal_(b.weight, 0.02, g2);
  EXPECT_EQ(to_vector(a.weight), to_vector(b.weight));
  EXPECT_EQ(to_vector(a.bias), std::vector<double>(5, 0.0));
  EXPECT_TRUE(a.weight.requires_grad());
}

// Counts the "linear" ops dispatched while alive.
struct LinearCounter {
  int linears = 0;
  int handle;
  LinearCounter() {
    handle = add_op_observer([this](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
      linears += std::string_view(op.name) == "linear";
    });
  }
  ~LinearCounter() { remove_op_observer(handle); }
};

struct NotFusable : Linear {
  using Linear::Linear;
  bool fusable() const override { return false; }
};

// Note [Sibling linears]: q/k/v-like siblings (widths 8, 2, 2) as one GEMM give each layer's
// forward and the same gradients of x and of every weight; a layer with a bias or one that is not
// fusable makes each run its own forward.
TEST(Layers, SiblingLinearsAreOneGemmWithTheSeparateResults) {
  for (DType dt : {DType::f64, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    Linear q(6, 8, false), k(6, 2, false), v(6, 2, false);
    Generator g(3);
    for (Linear* l : {&q, &k, &v}) {
      if (dt == DType::f64) l->to(DType::f64);
      init_normal_(l->weight, 0.5, g);
    }
    const DType wt = dt == DType::f64 ? DType::f64 : DType::f32;
    Generator gx(4);
    const Tensor x0 = to_dtype(randn({3, 5, 6}, DType::f32, kCPU, &gx), dt);
    const Tensor dy = to_dtype(randn({3, 5, 12}, DType::f32, kCPU, &gx), dt);
    auto run = [&](bool fused) {
      for (Linear* l : {&q, &k, &v}) l->zero_grad();
      Tensor x = x0.detach().set_requires_grad(true);
      std::vector<Tensor> y;
      LinearCounter count;
      if (fused) {
        y = sibling_linears(x, {&q, &k, &v});
      } else {
        for (Linear* l : {&q, &k, &v}) y.push_back(l->forward(x));
      }
      EXPECT_EQ(count.linears, fused ? 1 : 3);
      std::vector<Tensor> out = y;
      for (size_t i = 0; i < 3; ++i)
        y[i] = sum(mul(y[i], narrow(dy, 2, i == 0 ? 0 : 6 + 2 * int64_t(i - 1), y[i].size(2))));
      add(add(y[0], y[1]), y[2]).backward();
      out.push_back(x.grad());
      for (Linear* l : {&q, &k, &v}) out.push_back(l->weight.grad());
      return out;
    };
    const std::vector<Tensor> fused = run(true);
    // f64: each weight owns a copy of its rows of the [12, 6] gradient. bf16: the rows of the fp32
    // gradient the GEMM made, kept as they are, filling it.
    size_t grad_bytes = 0;
    for (Linear* l : {&q, &k, &v}) {
      const Tensor gw = l->weight.grad();
      grad_bytes += gw.nbytes();
      if (l != &q) EXPECT_EQ(gw.storage() == q.weight.grad().storage(), dt == DType::bf16);
      if (dt == DType::f64) EXPECT_EQ(gw.storage()->nbytes(), gw.nbytes());
    }
    EXPECT_EQ(q.weight.grad().storage()->nbytes(), dt == DType::bf16 ? grad_bytes : q.weight.grad().nbytes());
    const std::vector<Tensor> plain = run(false);
    // bf16: the separate input gradient adds three 16-bit-rounded GEMM results, the fused one
    // rounds once: they differ by a few bf16 steps (2^-8 relative).
    for (size_t i = 0; i < fused.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(fused[i].dtype(), i >= 4 ? wt : dt) << "weight gradients in the master dtype";
      const double scale = to_vector(max(abs(to_dtype(plain[i], DType::f64))))[0];
      EXPECT_EQ(test::compare(fused[i], plain[i], (dt == DType::f64 ? 1e-12 : 1.0 / 64) * scale, 0.0), "");
    }
  }
  Linear a(4, 3, true), b(4, 2, false);
  NotFusable c(4, 2, false);
  const Tensor x = ones({2, 4});
  for (const std::vector<const Linear*>& group : {std::vector<const Linear*>{&a, &b}, {&b, &c}, {&b}}) {
    LinearCounter count;
    const std::vector<Tensor> y = sibling_linears(x, group);
    EXPECT_EQ(count.linears, int(group.size()));
    ASSERT_EQ(y.size(), group.size());
    for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i].shape(), Shape({2, group[i]->out_features}));
  }
}

// Counts the ops that make 16-bit weights: casts, the copies into compute copies, cats.
struct WeightOpCounter {
  int casts = 0, copies = 0, cats = 0;
  int handle;
  WeightOpCounter() {
    handle = add_op_observer([this](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
      const std::string_view name = op.name;
      casts += name == "cast";
      copies += name == "copy_";
      cats += name == "cat";
    });
  }
  ~WeightOpCounter() { remove_op_observer(handle); }
};

// Under mixed precision the siblings' compute copies are rows of one buffer (Note [Sibling
// linears]): the first forward casts each weight into it, later ones read it with no kernel, a
// write to one weight makes the next forward cast them all again, and a weight that takes no
// gradient makes the others copy their rows of it.
TEST(Layers, SiblingLinearsReadTheirComputeCopiesSideBySide) {
  Linear q(6, 8, false), k(6, 2, false), v(6, 2, false);
  Generator g(5);
  for (Linear* l : {&q, &k, &v}) init_normal_(l->weight, 0.5, g);
  const Tensor x = to_dtype(randn({4, 6}, DType::f32, kCPU, &g), DType::bf16);
  auto forward = [&](int want_copies) {
    WeightOpCounter count;
    std::vector<Tensor> y = sibling_linears(x, {&q, &k, &v});
    EXPECT_EQ(count.casts + count.cats, 0);
    EXPECT_EQ(count.copies, want_copies);
    const Tensor w = to_dtype(cat({q.weight, k.weight, v.weight}, 0), DType::bf16);
    EXPECT_TRUE(test::bitwise_equal(cat(y, 1), linear(x, w)));
    return y;
  };
  forward(3);
  forward(0);
  const Tensor first = q.compute_copy_of(q.weight)->tensor();
  {
    NoGradGuard no_grad;
    copy_(k.weight, mul(k.weight, 2.0));
  }
  forward(3);
  const Tensor again = q.compute_copy_of(q.weight)->tensor();
  EXPECT_NE(again.storage(), first.storage()) << "a new buffer: a graph that saved the old one keeps it";
  EXPECT_EQ(k.compute_copy_of(k.weight)->tensor().storage(), again.storage());
  v.weight.set_requires_grad(false);
  std::vector<Tensor> y = forward(0);
  sum(to_dtype(add(add(sum(y[0]), sum(y[1])), sum(y[2])), DType::f32)).backward();
  for (Linear* l : {&q, &k}) EXPECT_EQ(l->weight.grad().storage()->nbytes(), l->weight.grad().nbytes());
  EXPECT_FALSE(v.weight.grad().defined());
  // Compute copies off: a cat and a cast at every forward, and no copy is kept.
  for (Linear* l : {&q, &k, &v}) l->set_compute_copies(false);
  WeightOpCounter count;
  (void)sibling_linears(x, {&q, &k, &v});
  EXPECT_EQ(count.cats, 1);
  EXPECT_EQ(count.casts, 1);
  EXPECT_FALSE(q.compute_copy_of(q.weight));
}

TEST(GPTConfig, PresetsAndJson) {
  auto d12 = GPTConfig::preset("d12");
  EXPECT_EQ(d12.n_layer, 12);
  EXPECT_EQ(GPTConfig::preset("d48").n_embd, 1600);
  EXPECT_EQ(GPTConfig::from_json(d12.to_json()), d12);
  expect_throws_with([] { GPTConfig::preset("d13"); }, "unknown GPT-2 preset 'd13'");
  auto j = d12.to_json();
  j["extra"] = 1;
  expect_throws_with([&] { GPTConfig::from_json(j); }, "unknown key 'extra'");
  j = d12.to_json();
  j.erase("n_head");
  expect_throws_with([&] { GPTConfig::from_json(j); }, "missing key 'n_head'");
  auto bad = ::blu::test::tiny_gpt();
  bad.n_head = 5;
  expect_throws_with([&] { GPT m(bad); }, "not a multiple of n_head");
}

TEST(GPT, ParameterNamesFollowHuggingFace) {
  GPT m(::blu::test::tiny_gpt());
  auto n = names(m.named_parameters());
  std::vector<std::string> want = {"wte.weight", "wpe.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    for (const char* s : {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                          "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                          "mlp.c_proj.weight", "mlp.c_proj.bias"})
      want.push_back(p + s);
  }
  want.push_back("ln_f.weight");
  want.push_back("ln_f.bias");
  EXPECT_EQ(n, want);
  EXPECT_EQ(m.wte->weight.shape(), (Shape{128, 48}));
  EXPECT_EQ(m.h->size(), 2);
  EXPECT_EQ((*m.h)[0].attn->c_attn->weight.shape(), (Shape{144, 48}));
}

// GPT-2 124M has 124,439,808 parameters with its 50257-row wte; padding to 50304 rows adds
// 47·768 = 36,096. Counted without building the model (the d12 weights are half a gigabyte).
int64_t count_gpt_params(const GPTConfig& c) {
  const int64_t C = c.n_embd;
  const int64_t block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C);
  return c.padded_vocab_size * C + c.block_size * C + c.n_layer * block + 2 * C;
}

TEST(GPT, ParameterCounts) {
  EXPECT_EQ(count_gpt_params(GPTConfig::preset("d12")), 124'475'904);
  GPTConfig unpadded = GPTConfig::preset("d12");
  unpadded.padded_vocab_size = unpadded.vocab_size;
  EXPECT_EQ(count_gpt_params(unpadded), 124'439'808);
  // The model agrees with the formula (tiny builds in no time; d12 is built once, f32, ~0.5 GB).
  EXPECT_EQ(GPT(::blu::test::tiny_gpt()).num_parameters(), count_gpt_params(::blu::test::tiny_gpt()));
  EXPECT_EQ(GPT(GPTConfig::preset("d12")).num_parameters(), 124'475'904);
}

TEST(GPT, InitIsGpt2s) {
  auto cfg = ::blu::test::tiny_gpt();
  cfg.n_layer = 4;
  GPT a(cfg, 7), b(cfg, 7), c(cfg, 8);
  EXPECT_EQ(to_vector(a.wte->weight), to_vector(b.wte->weight)) << "same seed, same init";
  EXPECT_NE(to_vector(a.wte->weight), to_vector(c.wte->weight));
  auto stddev = [](const Tensor& t) {
    auto v = to_vector(t);
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s / double(v.size()));
  };
  EXPECT_NEAR(stddev(a.wpe->weight), 0.02, 0.002);
  EXPECT_NEAR(stddev((*a.h)[0].mlp->c_fc->weight), 0.02, 0.001);
  const double proj = 0.02 / std::sqrt(8.0);
  EXPECT_NEAR(stddev((*a.h)[1].mlp->c_proj->weight), proj, 0.1 * proj);
  EXPECT_NEAR(stddev((*a.h)[1].attn->c_proj->weight), proj, 0.1 * proj);
  EXPECT_EQ(to_vector((*a.h)[0].attn->c_attn->bias), std::vector<double>(144, 0.0));
  EXPECT_EQ(to_vector(a.ln_f->weight), std::vector<double>(48, 1.0));
  // Real rows random, padded rows zero.
  EXPECT_NEAR(stddev(narrow(a.wte->weight, 0, 0, 101)), 0.02, 0.002);
  EXPECT_EQ(to_vector(narrow(a.wte->weight, 0, 101, 27)), std::vector<double>(27 * 48, 0.0));
}

}  // namespace
}  // namespace blu::nn
