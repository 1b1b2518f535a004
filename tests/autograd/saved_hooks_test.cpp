// autograd/saved_hooks and autograd/checkpoint: a hook that takes a saved tensor holds it instead of
// the node and gives it back for the backward (the gradient unchanged); a hook that declines passes
// it to the next; a recompute region runs its function again in backward, once per backward,
// with the same gradients as running it plainly, also through retain_graph.
#include <gtest/gtest.h>

#include "blu/autograd/checkpoint.h"
#include "blu/autograd/saved_hooks.h"
#include "blu/blu.h"

namespace blu {
namespace {

struct CountingBox final : SavedBox {
  Tensor kept;
  int* unpacks;
  Tensor unpack() override {
    ++*unpacks;
    return clone(kept);  // a different tensor with the same values
  }
};

TEST(SavedHooks, BoxesHoldSavedTensorsAndGiveThemBack) {
  Tensor x = from_vector({1.0, 2.0, 3.0}, {3});
  x.set_requires_grad(true);
  int packs = 0, unpacks = 0, declined = 0;
  Tensor y;
  {
    SavedTensorHooks outer([&](const SavedInfo& info) -> std::shared_ptr<SavedBox> {
      ++packs;
      auto b = std::make_shared<CountingBox>();
      b->kept = info.t.detach();
      b->unpacks = &unpacks;
      return b;
    });
    SavedTensorHooks inner([&](const SavedInfo&) -> std::shared_ptr<SavedBox> {
      ++declined;
      return nullptr;  // declines: the outer hook is asked
    });
    EXPECT_TRUE(saved_hooks_active());
    y = mul(x, x);  // saves both inputs
  }
  EXPECT_FALSE(saved_hooks_active());
  EXPECT_EQ(packs, 2);
  EXPECT_EQ(declined, 2);
  sum(y).backward(Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(unpacks, 2);
  EXPECT_EQ(to_vector(x.grad()), (std::vector<double>{2, 4, 6}));
  sum(y).backward();  // the boxes outlive a retained backward
  EXPECT_EQ(unpacks, 4);
  EXPECT_EQ(to_vector(x.grad()), (std::vector<double>{4, 8, 12}));
}

TEST(Checkpoint, RegionRunsAgainInBackwardWithThePlainGradients) {
  Generator g(2);
  Tensor w = randn({4, 4}, DType::f64, kCPU, &g);
  w.set_requires_grad(true);
  const Tensor x0 = randn({3, 4}, DType::f64, kCPU, &g);
  int runs = 0;
  const RegionFn fn = [&](const std::vector<Tensor>& in) {
    ++runs;
    return tanh(matmul(in[0], w));
  };
  auto grads = [&](bool recompute, bool retain) {
    w.zero_grad();
    Tensor x = x0.detach();
    x.set_requires_grad(true);
    Tensor h = mul(x, 2.0);
    Tensor y = recompute ? checkpoint("region", fn, {h}) : fn({h});
    Tensor loss = sum(mul(y, y));
    loss.backward(Tensor(), retain);
    if (retain) loss.backward();
    return std::make_pair(to_vector(x.grad()), to_vector(w.grad()));
  };
  const auto plain = grads(false, false);
  EXPECT_EQ(runs, 1);
  runs = 0;
  const int64_t rebuilds = recompute_rebuild_count();
  EXPECT_EQ(grads(true, false), plain);
  EXPECT_EQ(runs, 2);  // forward, and once in backward
  EXPECT_EQ(recompute_rebuild_count() - rebuilds, 1);
  runs = 0;
  const auto twice = grads(true, true);  // retain_graph: the second backward rebuilds again
  EXPECT_EQ(runs, 3);
  const auto plain_twice = grads(false, true);
  EXPECT_EQ(twice, plain_twice);
  // Not recorded without grad, nor when no input requires grad: fn runs plainly.
  runs = 0;
  {
    NoGradGuard no_grad;
    checkpoint("region", fn, {x0});
  }
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace blu
