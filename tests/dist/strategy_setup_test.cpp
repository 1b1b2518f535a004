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

// Split master weights (Note [Split masters], optim/master_split.h): the set-up splits every
// parameter read through a bf16 copy (not the embeddings) and gives its fp32 bytes back; the values
// read through parameter_values() are the fp32 masters, and when the strategy ends each split
// parameter keeps them, on the CPU. Steps run on batches in between.
TEST(StrategySetup, SplitMastersLeaveTheirValuesToTheParametersWhenTheStrategyEnds) {
  models::GPT model(::blu::test::tiny_gpt(), 3);
  model.train();
  model.set_compute_dtype(DType::bf16);
  std::vector<std::vector<double>> during;
  int64_t split = 0;
  {
    StrategyConfig sc;
    sc.split_masters = true;
    Strategy strategy(model, nullptr, sc, OptimizerConfig{.lr = 1e-2});
    split = strategy.split_elements();
    int64_t embeddings = 0, released = 0;
    for (const auto& [name, p] : model.named_parameters()) {
      if (p.storage()->nbytes() == 0) released += p.numel();
      if (name.find("wte") != std::string::npos || name.find("wpe") != std::string::npos) embeddings += p.numel();
    }
    EXPECT_EQ(split, model.num_parameters() - embeddings);
    EXPECT_EQ(released, split);
    Generator gen(5);
    const Tensor ids = randint(0, 64, {2, 8}, DType::i64, kCPU, &gen),
                 targets = randint(0, 64, {2, 8}, DType::i64, kCPU, &gen);
    for (int s = 0; s < 3; ++s)
      strategy.step(1, [&](int64_t) { return std::make_pair(ids, targets); }, 1e-2, 1.0);
    const auto values = strategy.parameter_values();
    for (const auto& [name, t] : model.state_dict()) during.push_back(to_vector(t));
  }
  size_t i = 0;
  for (const auto& [name, t] : model.state_dict()) {
    EXPECT_EQ(to_vector(t), during.at(i)) << name;
    ++i;
  }
  EXPECT_GT(split, 0);
}

}  // namespace
}  // namespace blu::dist
