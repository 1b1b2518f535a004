// autograd/function: a node whose backward the caller writes is recorded like an op's node — its
// gradient reaches the inputs through the graph, it stays out of a no-grad forward, and its
// backward runs once per backward pass, in the engine's order.
#include <gtest/gtest.h>

#include "blu/autograd/function.h"
#include "blu/blu.h"

namespace blu {
namespace {

TEST(Function, BackwardIsTheCallersAndFeedsTheGraph) {
  Tensor x = from_vector({1.0, 2.0, 3.0}, {3});
  x.set_requires_grad(true);
  int calls = 0;
  // Forward: 2·x (computed by the caller); backward: a deliberately different 3·g, so the test
  // sees that the caller's function ran and not an op's own derivative.
  const Tensor y = record_function("twice", {mul(x, 1.0)}, {mul(x.detach(), 2.0)}, [&](const std::vector<Tensor>& g) {
    ++calls;
    return std::vector<Tensor>{mul(g[0], 3.0)};
  })[0];
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(to_vector(y), (std::vector<double>{2, 4, 6}));
  sum(mul(y, y)).backward();  // dL/dy = 2y
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(to_vector(x.grad()), (std::vector<double>{12, 24, 36}));  // 3 · 2y
}

TEST(Function, NotRecordedWithoutGrad) {
  Tensor x = from_vector({1.0}, {1});
  x.set_requires_grad(true);
  {
    NoGradGuard no_grad;
    const Tensor y = record_function("f", {x}, {mul(x, 2.0)}, [](const std::vector<Tensor>& g) { return g; })[0];
    EXPECT_FALSE(y.requires_grad());
  }
  const Tensor c = from_vector({1.0}, {1});  // no input requires grad
  EXPECT_FALSE(record_function("f", {c}, {c}, [](const std::vector<Tensor>& g) { return g; })[0].requires_grad());
}

}  // namespace
}  // namespace blu
