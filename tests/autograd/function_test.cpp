// autograd/function: a node whose backward the caller writes is recorded like an op's node — its
// gradient reaches the inputs through the graph, it stays out of a no-grad forward, and its
// backward runs once per backward pass, in the engine's order; a linear's listener hears of its
// input gradient before the weight gradient is computed (Note [Early input gradients]).
#include <gtest/gtest.h>

#include "blu/autograd/function.h"
#include "blu/blu.h"
#include "blu/ops/dispatch.h"

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

TEST(Function, LinearTellsItsListenerOfTheInputGradientBeforeTheWeightGradient) {
  Tensor x = from_vector({1.0, 2.0, 3.0, 4.0, 5.0, 6.0}, {2, 3}).set_requires_grad();
  Tensor w = from_vector({0.5, -1.0, 2.0, 1.5, 0.25, -0.75}, {2, 3}).set_requires_grad();
  Tensor b = from_vector({0.1, 0.2}, {2}).set_requires_grad();
  const Tensor x_in = mul(x, 1.0);  // a non-leaf input, as under tensor parallelism
  const Tensor y = linear(x_in, w, b);
  int weight_grads = 0, calls = 0;
  Tensor heard;
  const int obs = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
    weight_grads += std::string(op.name).starts_with("linear_weight_grad");
  });
  ASSERT_TRUE(listen_for_input_grad(y, [&](size_t input, const Tensor& g) {
    ++calls;
    EXPECT_EQ(input, 0u);
    EXPECT_EQ(weight_grads, 0) << "the listener must run before the weight gradient's GEMM";
    heard = g;
  }));
  sum(mul(y, y)).backward();
  remove_op_observer(obs);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(weight_grads, 1);
  // What it heard is the input gradient itself: 2y·w.
  const std::vector<double> yv = to_vector(y), wv = to_vector(w);
  std::vector<double> want;
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < 3; ++k) want.push_back(2 * yv[size_t(r * 2)] * wv[size_t(k)] + 2 * yv[size_t(r * 2 + 1)] * wv[size_t(3 + k)]);
  const std::vector<double> got = to_vector(heard), xg = to_vector(x.grad());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-5);
    EXPECT_NEAR(xg[i], want[i], 1e-5);
  }
  // A leaf or an output no op node made takes no listener.
  EXPECT_FALSE(listen_for_input_grad(w, [](size_t, const Tensor&) {}));
  NoGradGuard no_grad;
  EXPECT_FALSE(listen_for_input_grad(linear(x, w), [](size_t, const Tensor&) {}));
}

}  // namespace
}  // namespace blu
