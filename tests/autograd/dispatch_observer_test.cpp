// ops/dispatch observers: every op call is seen, in order, with its inputs and outputs; removed
// observers see nothing more.
#include <gtest/gtest.h>

#include "blu/blu.h"
#include "blu/ops/dispatch.h"

namespace blu {
namespace {

TEST(Dispatch, ObserversSeeOpsInOrder) {
  std::vector<std::string> names;
  std::vector<Shape> out_shapes;
  const int h = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor> out, const Attrs&) {
    names.push_back(op.name);
    out_shapes.push_back(out.empty() ? Shape{-1} : out[0].shape());
  });
  Tensor a = empty({2, 3});
  Tensor b = transpose(a, 0, 1);
  Tensor c = sum(b, {0});
  remove_op_observer(h);
  Tensor d = exp(c);  // not seen
  EXPECT_EQ(names, (std::vector<std::string>{"empty", "permute", "sum"}));
  EXPECT_EQ(out_shapes, (std::vector<Shape>{{2, 3}, {3, 2}, {2}}));
}

TEST(Dispatch, SeveralObserversAndRemoval) {
  int first = 0, second = 0;
  const int h1 = add_op_observer([&](const OpDef&, auto, auto, const Attrs&) { ++first; });
  const int h2 = add_op_observer([&](const OpDef&, auto, auto, const Attrs&) { ++second; });
  EXPECT_NE(h1, h2);
  Tensor t = empty({2});
  remove_op_observer(h1);
  Tensor u = empty({2});
  remove_op_observer(h2);
  Tensor v = empty({2});
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 2);
  remove_op_observer(h2);  // removing twice is harmless
}

TEST(Dispatch, ObserverSeesAttrsAndBackwardOps) {
  std::vector<std::string> names;
  Tensor x = from_vector({1, 2}, {2}).set_requires_grad();
  Tensor y = sum(mul(x, 2.0));
  double scale = 0;
  const int h = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs& a) {
    names.push_back(op.name);
    if (std::string(op.name) == "mul_scalar") scale = a.f("value");
  });
  y.backward();
  remove_op_observer(h);
  // The backward formulas are op calls too: the observer sees them.
  ASSERT_FALSE(names.empty());
  EXPECT_NE(std::find(names.begin(), names.end(), "mul_scalar"), names.end());
  EXPECT_EQ(scale, 2.0);
}

}  // namespace
}  // namespace blu
