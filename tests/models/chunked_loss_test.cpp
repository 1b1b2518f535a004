// The head's loss in row pieces (CausalLM::set_loss_chunks, ops/fused.h Note [Chunked loss]) on
// GPT-2 (padded vocabulary, tied head) and Llama (untied head), fp32 on the CPU:
// - the loss and every parameter's gradient match the whole logits' within fp32 rounding, for
//   pieces that split the rows evenly and not, and forward gives no logits;
// - without autograd (evaluation) the loss is the same and nothing is kept for a backward;
// - backward()'s own seed (exactly 1) is not multiplied in, with the same bits as a given 1;
// - the step's peak device memory falls by most of the logits' bytes (the CPU allocator plays the
//   device);
// - bad settings and tensor parallelism are refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string_view>
#include <tuple>

#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/ops/dispatch.h"
#include "common/tiny_gpt.h"

namespace blu::test {
namespace {

using models::CausalLM;

std::unique_ptr<CausalLM> make_model(const std::string& family, int64_t vocab = 0) {
  if (family == "gpt2") {
    models::GPTConfig c = tiny_gpt();
    if (vocab) c.vocab_size = vocab, c.padded_vocab_size = (vocab + 127) / 128 * 128;
    return std::make_unique<models::GPT>(c, 3);
  }
  models::LlamaConfig c = models::LlamaConfig::preset("tiny");
  if (vocab) c.vocab_size = vocab;
  return std::make_unique<models::Llama>(c, 3);
}

std::pair<Tensor, Tensor> batch(const CausalLM& m, int64_t B, int64_t T) {
  Generator g(9);
  Tensor idx = randint(0, m.vocab_size(), {B, T}, DType::i64, kCPU, &g);
  Tensor tg = randint(0, m.vocab_size(), {B, T}, DType::i64, kCPU, &g);
  // Two ignored positions (target -1): they count for nothing in the mean.
  std::vector<double> t = to_vector(tg);
  t[1] = -1, t[t.size() - 2] = -1;
  return {idx, from_vector(t, {B, T}, DType::i64)};
}

struct Grads {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

Grads loss_and_grads(CausalLM& m, const Tensor& idx, const Tensor& tg) {
  m.zero_grad();
  models::LMOutput out = m.forward(idx, tg);
  EXPECT_EQ(out.logits.defined(), m.loss_chunks() <= 1);
  out.loss.backward();
  Grads r{out.loss.item(), {}};
  for (auto& [name, p] : m.named_parameters()) r.grads.push_back(to_vector(p.grad()));
  return r;
}

class ChunkedLoss : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkedLoss, LossAndGradientsMatchTheWholeLogits) {
  auto m = make_model(GetParam());
  const auto [idx, tg] = batch(*m, 3, 7);  // 21 rows
  const Grads whole = loss_and_grads(*m, idx, tg);
  for (int64_t chunks : {2, 4, 21, 64}) {
    SCOPED_TRACE(GetParam() + ", " + std::to_string(chunks) + " pieces");
    m->set_loss_chunks(chunks);
    const Grads piece = loss_and_grads(*m, idx, tg);
    EXPECT_NEAR(piece.loss, whole.loss, 2e-6 * whole.loss);
    ASSERT_EQ(piece.grads.size(), whole.grads.size());
    for (size_t i = 0; i < whole.grads.size(); ++i) {
      double worst = 0, scale = 0;
      for (size_t j = 0; j < whole.grads[i].size(); ++j) {
        worst = std::max(worst, std::abs(piece.grads[i][j] - whole.grads[i][j]));
        scale = std::max(scale, std::abs(whole.grads[i][j]));
      }
      EXPECT_LE(worst, 1e-5 * scale + 1e-9) << "gradient of parameter " << i;
    }
  }
  m->set_loss_chunks(0);
  EXPECT_EQ(loss_and_grads(*m, idx, tg).loss, whole.loss);
}

// backward() with no gradient seeds the loss's with ones, exactly 1 (BackwardContext::grad_is_one):
// linear_cross_entropy's backward then returns the forward-made gradients unscaled — two multiplies
// fewer (x's, w's) — with the same bits as a backward given that gradient, which scales by it;
// fp32, and bf16 compute over fp32 masters (x's gradient through fp32 and back, w's widened).
TEST_P(ChunkedLoss, SeededBackwardSkipsTheScalingWithTheSameBits) {
  for (DType compute : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(GetParam() + ", compute " + std::string(dtype_name(compute)));
    auto run = [&](bool seeded, int64_t& muls) {
      auto m = make_model(GetParam());
      if (compute != DType::f32) m->set_compute_dtype(compute);
      m->set_loss_chunks(4);
      const auto [idx, tg] = batch(*m, 3, 7);
      models::LMOutput out = m->forward(idx, tg);
      muls = 0;
      const int obs = add_op_observer([&](const OpDef& op, auto, auto, const Attrs&) {
        const std::string_view name = op.name;
        muls += name == "mul" || name == "mul_" ? 1 : 0;
      });
      if (seeded) out.loss.backward();
      else out.loss.backward(ones_like(out.loss));
      remove_op_observer(obs);
      std::vector<Tensor> grads;
      for (auto& [name, p] : m->named_parameters()) grads.push_back(clone(p.grad()));
      return grads;
    };
    int64_t seeded_muls = 0, given_muls = 0;
    const std::vector<Tensor> a = run(true, seeded_muls), b = run(false, given_muls);
    EXPECT_EQ(given_muls - seeded_muls, 2) << given_muls << " multiplies given a gradient, " << seeded_muls << " seeded";
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].nbytes(), b[i].nbytes());
      EXPECT_EQ(std::memcmp(a[i].raw_data(), b[i].raw_data(), a[i].nbytes()), 0) << "gradient of parameter " << i;
    }
  }
}

TEST_P(ChunkedLoss, EvaluationWithoutAutogradGivesTheSameLoss) {
  auto m = make_model(GetParam());
  const auto [idx, tg] = batch(*m, 2, 9);
  NoGradGuard no_grad;
  const double whole = m->forward(idx, tg).loss.item();
  m->set_loss_chunks(4);
  const models::LMOutput out = m->forward(idx, tg);
  EXPECT_FALSE(out.logits.defined());
  EXPECT_FALSE(out.loss.requires_grad());
  EXPECT_NEAR(out.loss.item(), whole, 2e-6 * whole);
}

// Device bytes above the start during one forward and backward (gradients kept from a warm-up
// step, so each backward adds into them in place), for a vocabulary large beside the width, as a
// real model's is: the pieces' peak is below the whole logits' by most of the logits' bytes.
TEST_P(ChunkedLoss, StepPeakFallsByMostOfTheLogits) {
  auto m = make_model(GetParam(), 4000);
  Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
  std::tie(idx, tg) = batch(*m, 16, 16);  // 256 rows
  auto peak = [&](int64_t chunks) {
    m->set_loss_chunks(chunks);
    m->forward(idx, tg).loss.backward();  // warm-up: the gradient buffers exist
    Allocator& dev = cpu_allocator();
    const int64_t base = dev.stats().current_bytes;
    dev.reset_peak();
    Tensor loss = m->forward(idx, tg).loss;  // the logits dropped before backward, as the trainer does
    loss.backward();
    return dev.stats().peak_bytes - base;
  };
  const int64_t whole = peak(0), pieces = peak(8);
  const int64_t logits = 256 * m->output_weight().size(0) * 4;
  std::cout << GetParam() << ": step peak " << whole << " B with the whole logits (" << logits << " B), " << pieces
            << " B in 8 pieces\n";
  EXPECT_LT(pieces, whole - logits / 2);
}

TEST_P(ChunkedLoss, RefusesBadSettingsAndTensorParallelism) {
  auto m = make_model(GetParam());
  try {
    m->set_loss_chunks(-2);
    FAIL() << "negative chunks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss chunks must be >= 0"), std::string::npos) << e.what();
  }
  m->sharded.loss = [](const Tensor& logits, const Tensor& targets, int64_t) { return cross_entropy(logits, targets); };
  try {
    m->set_loss_chunks(4);
    FAIL() << "chunks accepted under a vocabulary-parallel loss";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor parallelism"), std::string::npos) << e.what();
  }
  EXPECT_EQ(m->loss_chunks(), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, ChunkedLoss, ::testing::Values("gpt2", "llama"));

}  // namespace
}  // namespace blu::test
