// nn/gpt forward paths: shapes and loss over the real vocabulary, the KV-cached path against the
// full forward at every position, generation (greedy is deterministic, seeded sampling
// reproducible, padded tokens never sampled), train/eval with dropout.
#include <gtest/gtest.h>

#include <cmath>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"

namespace blu::nn {
namespace {

using models::GPT;
using models::GPTConfig;
using models::KVCache;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto x = to_vector(a), y = to_vector(b);
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

Tensor tokens(const GPTConfig& c, int64_t B, int64_t T, uint64_t seed) {
  Generator g(seed);
  return randint(0, c.vocab_size, {B, T}, DType::i64, kCPU, &g);
}

TEST(GPT, ForwardShapesAndLoss) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg);
  Tensor idx = tokens(cfg, 2, 16, 1), tgt = tokens(cfg, 2, 16, 2);
  auto out = m.forward(idx, tgt);
  EXPECT_EQ(out.logits.shape(), (Shape{2, 16, 128}));
  ASSERT_TRUE(out.loss.defined());
  EXPECT_EQ(out.loss.dim(), 0);
  // At init the model is close to uniform over the real vocabulary.
  EXPECT_NEAR(out.loss.item(), std::log(101.0), 0.2);
  // The same loss by hand over the first vocab_size columns.
  Tensor ref = cross_entropy(reshape(contiguous(narrow(out.logits, -1, 0, 101)), {32, 101}), reshape(tgt, {32}));
  EXPECT_NEAR(out.loss.item(), ref.item(), 1e-6);
  EXPECT_FALSE(m.forward(idx).loss.defined());
  // Targets of -1 are ignored.
  Tensor some = from_vector(std::vector<double>(32, -1.0), {2, 16}, DType::i64);
  {
    NoGradGuard ng;
    copy_(narrow(some, 1, 0, 1), narrow(tgt, 1, 0, 1));
  }
  Tensor only_first = cross_entropy(reshape(contiguous(narrow(narrow(out.logits, 1, 0, 1), -1, 0, 101)), {2, 101}),
                                    reshape(contiguous(narrow(tgt, 1, 0, 1)), {2}));
  EXPECT_NEAR(m.forward(idx, some).loss.item(), only_first.item(), 1e-6);
}

TEST(GPT, PaddedRowsGetNoGradient) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg);
  auto out = m.forward(tokens(cfg, 2, 8, 3), tokens(cfg, 2, 8, 4));
  out.loss.backward();
  Tensor g = m.wte->weight.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_EQ(max_abs_diff(narrow(g, 0, 101, 27), zeros({27, 48})), 0.0);
  EXPECT_GT(max_abs_diff(narrow(g, 0, 0, 101), zeros({101, 48})), 0.0);
  for (auto& [n, p] : m.named_parameters()) EXPECT_TRUE(p.grad().defined()) << n;
}

TEST(GPT, RejectsBadInputs) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg);
  EXPECT_THROW(m.forward(tokens(cfg, 1, 17, 1)), Error);  // longer than block_size
  EXPECT_THROW(m.forward(zeros({1, 4})), Error);          // float ids
  EXPECT_THROW(m.forward(zeros({4}, DType::i64)), Error);  // not [B, T]
}

TEST(GPT, CachedLogitsMatchFullForwardAtEveryPosition) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg, 5);
  m.eval();
  NoGradGuard ng;
  Tensor idx = tokens(cfg, 2, 16, 9);
  Tensor full = m.forward(idx).logits;
  // A 5-token prompt in one causal pass, then one token at a time.
  KVCache cache;
  Tensor first = m.forward_cached(narrow(idx, 1, 0, 5), cache);
  EXPECT_EQ(cache.length(), 5);
  EXPECT_LT(max_abs_diff(first, narrow(full, 1, 0, 5)), 1e-5);
  for (int64_t t = 5; t < 16; ++t) {
    Tensor step = m.forward_cached(narrow(idx, 1, t, 1), cache);
    EXPECT_EQ(step.shape(), (Shape{2, 1, 128}));
    EXPECT_LT(max_abs_diff(step, narrow(full, 1, t, 1)), 1e-5) << "position " << t;
  }
  EXPECT_EQ(cache.length(), 16);
  EXPECT_THROW(m.forward_cached(narrow(idx, 1, 0, 1), cache), Error) << "past block_size";
  KVCache c2;
  m.forward_cached(narrow(idx, 1, 0, 2), c2);
  EXPECT_THROW(m.forward_cached(narrow(idx, 1, 2, 2), c2), Error) << "several positions after a cache";
}

TEST(GPT, GenerateGreedyIsDeterministicAndMatchesArgmax) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg, 5);
  Generator g1(1), g2(2);
  std::vector<int32_t> prompt = {3, 14, 15};
  auto a = m.generate(prompt, 10, 1.0, /*top_k=*/1, g1);
  auto b = m.generate(prompt, 10, 0.7, /*top_k=*/1, g2);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 10u);
  EXPECT_TRUE(m.is_training()) << "generate restores the training flag";
  // Greedy by hand with full forwards.
  std::vector<int32_t> seq = prompt;
  m.eval();
  NoGradGuard ng;
  for (int i = 0; i < 10; ++i) {
    std::vector<double> ids(seq.begin(), seq.end());
    Tensor logits = m.forward(from_vector(ids, {1, int64_t(ids.size())}, DType::i64)).logits;
    Tensor last = narrow(select(select(logits, 0, 0), 0, logits.size(1) - 1), 0, 0, cfg.vocab_size);
    seq.push_back(int32_t(argmax(last, 0).item()));
  }
  EXPECT_EQ(std::vector<int32_t>(seq.begin() + 3, seq.end()), a);
}

TEST(GPT, GenerateSamplesReproduciblyAndPastBlockSize) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg, 5);
  Generator g1(42), g2(42);
  auto a = m.generate({1, 2}, 30, 1.0, 0, g1);  // 32 tokens > block_size 16: the window slides
  auto b = m.generate({1, 2}, 30, 1.0, 0, g2);
  EXPECT_EQ(a, b);
  for (int32_t t : a) EXPECT_LT(t, cfg.vocab_size) << "a padded token was sampled";
  Generator g3(7);
  auto k3 = m.generate({1, 2}, 20, 1.5, 3, g3);
  EXPECT_EQ(k3.size(), 20u);
  EXPECT_THROW(m.generate({}, 1, 1.0, 0, g3), Error);
  EXPECT_THROW(m.generate({500}, 1, 1.0, 0, g3), Error);
}

TEST(GPT, DropoutFollowsTrainEval) {
  auto cfg = ::blu::test::tiny_gpt();
  cfg.dropout = 0.5;
  GPT m(cfg, 5);
  Tensor idx = tokens(cfg, 1, 8, 1);
  NoGradGuard ng;
  Tensor t1 = m.forward(idx).logits, t2 = m.forward(idx).logits;
  EXPECT_GT(max_abs_diff(t1, t2), 1e-4) << "training mode draws fresh masks";
  m.eval();
  Tensor e1 = m.forward(idx).logits, e2 = m.forward(idx).logits;
  EXPECT_EQ(max_abs_diff(e1, e2), 0.0);
  GPTConfig nodrop = cfg;
  nodrop.dropout = 0.0;
  GPT ref(nodrop, 5);
  EXPECT_EQ(max_abs_diff(e1, ref.forward(idx).logits), 0.0) << "eval mode is dropout-free";
}

TEST(GPT, ToDouble) {
  auto cfg = ::blu::test::tiny_gpt();
  GPT m(cfg, 5);
  NoGradGuard ng;
  Tensor idx = tokens(cfg, 1, 8, 1);
  Tensor f32 = m.forward(idx).logits;
  m.to(DType::f64);
  Tensor f64 = m.forward(idx).logits;
  EXPECT_EQ(f64.dtype(), DType::f64);
  EXPECT_LT(max_abs_diff(f32, f64), 1e-5);
}

}  // namespace
}  // namespace blu::nn
