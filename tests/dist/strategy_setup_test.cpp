// What dist::Strategy does at set-up before the first step: Note [Compute copies laid out first]
// (dist/strategy.cpp).
#include <gtest/gtest.h>

#include "blu/blu.h"
#include "blu/dist/strategy.h"
#include "blu/models/llama/llama.h"
#include "common/tiny_gpt.h"

namespace blu::dist {
namespace {

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor x = contiguous(a), y = contiguous(b);
  return std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// A bf16 model's compute copies exist once its Strategy is made, each the cast the first forward
// would have made, and the set-up draws nothing from the default generator (its forward is in
// eval mode); the model is left in training mode. In fp32 nothing is made.
TEST(StrategySetup, SixteenBitComputeCopiesAreMadeBeforeTheFirstStep) {
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt");
    std::unique_ptr<models::CausalLM> model;
    if (llama) model = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 3);
    else model = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 3);
    model->train();
    model->set_compute_dtype(DType::bf16);
    for (const auto& [p, c] : model->compute_copies()) ASSERT_FALSE(c->tensor().defined());
    Generator& gen = default_generator();
    const uint64_t seed = gen.seed(), offset = gen.offset();
    Strategy strategy(*model, nullptr, StrategyConfig{}, OptimizerConfig{.lr = 1e-3});
    EXPECT_EQ(gen.seed(), seed);
    EXPECT_EQ(gen.offset(), offset);
    EXPECT_TRUE(model->is_training());
    int made = 0;
    for (const auto& [p, c] : model->compute_copies()) {
      if (!c->tensor().defined()) continue;  // a parameter no forward casts (an embedding looks up its rows)
      ++made;
      EXPECT_TRUE(c->current(p));
      EXPECT_TRUE(bitwise_equal(c->tensor(), to_dtype(p, DType::bf16)));
    }
    EXPECT_GE(made, int(model->blocks().size()) * 4);  // at least each block's projections
  }
  models::GPT fp32(::blu::test::tiny_gpt(), 3);
  fp32.train();
  Strategy strategy(fp32, nullptr, StrategyConfig{}, OptimizerConfig{.lr = 1e-3});
  for (const auto& [p, c] : fp32.compute_copies()) EXPECT_FALSE(c->tensor().defined());
}

}  // namespace
}  // namespace blu::dist
