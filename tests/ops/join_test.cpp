// ops/join beyond the OpInfo table: argument errors (each message names the problem), views from
// split/chunk, and cat of non-floating dtypes.
#include <gtest/gtest.h>

#include "common/checks.h"
#include "blu/blu.h"
#include "blu/ops/dispatch.h"

namespace blu {
namespace {

// Runs f, expects blu::Error, and checks its message contains every one of `parts`.
using test::expect_error;

// [1, 3] as every other element of [1, 2, 3, 4].
Tensor noncontig_bf16() { return from_vector({1, 2, 3, 4}, {4}, DType::bf16).alias_with({2}, {2}, 0); }

TEST(Join, CatValuesAndDtypes) {
  Tensor a = from_vector({1, 2, 3, 4}, {2, 2}, DType::i64);
  Tensor b = from_vector({5, 6}, {2, 1}, DType::i64);
  EXPECT_EQ(to_vector(cat({a, b}, 1)), (std::vector<double>{1, 2, 5, 3, 4, 6}));
  Tensor m = from_vector({1, 0, 1}, {3}, DType::b8);
  EXPECT_EQ(to_vector(cat({m, m}, 0)), (std::vector<double>{1, 0, 1, 1, 0, 1}));
  Tensor h = from_vector({0.5, -1.5}, {2}, DType::bf16);
  Tensor hc = cat({h, noncontig_bf16()}, 0);
  EXPECT_EQ(hc.dtype(), DType::bf16);
  EXPECT_EQ(to_vector(hc), (std::vector<double>{0.5, -1.5, 1, 3}));
}

TEST(Join, CatOfOneIsACopy) {
  Tensor a = from_vector({1, 2, 3}, {3});
  Tensor c = cat({a}, 0);
  EXPECT_NE(c.storage(), a.storage());
  EXPECT_EQ(to_vector(c), to_vector(a));
}

TEST(Join, CatErrors) {
  Tensor a = zeros({2, 3}), b = zeros({2, 4}), c = zeros({2, 3, 1});
  expect_error([&] { cat({a, b}, 0); }, {"tensor 1", "dim 1", "4", "3"});
  expect_error([&] { cat({a, c}, 0); }, {"tensor 1", "3 dims", "2 dims"});
  expect_error([&] { cat({a, zeros({2, 3}, DType::f64)}, 0); }, {"tensor 1", "f64", "f32"});
  expect_error([&] { cat({a, a}, 2); }, {"dim 2", "out of range"});
  expect_error([&] { cat({a, a}, -3); }, {"dim -3", "out of range"});
  expect_error([&] { cat({}, 0); }, {"at least one tensor"});
  expect_error([&] { cat({zeros({}), zeros({})}, 0); }, {"tensor 0", "0-d"});
  expect_error([&] { cat({a, Tensor()}, 0); }, {"tensor 1", "undefined"});
}

TEST(Join, StackErrors) {
  expect_error([&] { stack({zeros({2, 3}), zeros({3, 2})}, 0); }, {"tensor 1", "[3, 2]", "[2, 3]"});
  expect_error([&] { stack({zeros({2, 3}), zeros({2, 3})}, 3); }, {"dim 3", "out of range"});
  expect_error([&] { stack({}, 0); }, {"at least one tensor"});
  EXPECT_EQ(stack({zeros({2, 3}), zeros({2, 3})}, -1).shape(), (Shape{2, 3, 2}));
}

// split's backward joins the pieces' gradients; when they already lie side by side in one buffer
// (here cat's backward hands out adjacent slices of its gradient; on CUDA the attention backward
// writes dq, dk, dv so) the join is a view, no cat runs. In another order it is a cat. The
// gradient is the same either way.
TEST(Join, SplitBackwardOfAdjacentGradientsIsAView) {
  Generator gen(3);
  const Tensor w = randn({4, 6}, DType::f64, kCPU, &gen);
  for (const bool in_order : {true, false}) {
    Tensor x = randn({4, 6}, DType::f64, kCPU, &gen);
    x.set_requires_grad(true);
    auto p = split(x, 2, 1);
    const Tensor y = in_order ? cat({p[0], p[1], p[2]}, 1) : cat({p[2], p[0], p[1]}, 1);
    const Tensor loss = sum(mul(y, w));
    int cats = 0;
    const int h = add_op_observer([&](const OpDef& op, auto, auto, const Attrs&) { cats += std::string(op.name) == "cat"; });
    loss.backward();
    remove_op_observer(h);
    EXPECT_EQ(cats, in_order ? 0 : 1) << (in_order ? "in order" : "out of order");
    // d loss / dx: w's columns, moved back to where each piece came from.
    const std::vector<double> wv = to_vector(w);
    std::vector<double> want(24);
    const int64_t src[3] = {0, 1, 2}, moved[3] = {1, 2, 0};  // out of order: piece k sits at block moved[k]
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t k = 0; k < 3; ++k)
        for (int64_t j = 0; j < 2; ++j)
          want[size_t(r * 6 + k * 2 + j)] = wv[size_t(r * 6 + (in_order ? src[k] : moved[k]) * 2 + j)];
    EXPECT_EQ(to_vector(x.grad()), want) << (in_order ? "in order" : "out of order");
  }
}

TEST(Join, SplitAndChunkAreViews) {
  Tensor t = arange(0, 10, 1, DType::f32);
  auto p = split(t, 4);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[2].shape(), (Shape{2}));
  for (const Tensor& x : p) EXPECT_EQ(x.storage(), t.storage());
  EXPECT_EQ(p[1].offset(), 4);
  fill_(p[1], -1);
  EXPECT_EQ(to_vector(t)[5], -1);

  auto c = chunk(reshape(t, {2, 5}), 3, 1);  // ceil(5/3) = 2 → sizes 2, 2, 1
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].shape(), (Shape{2, 2}));
  EXPECT_EQ(c[2].shape(), (Shape{2, 1}));
  EXPECT_EQ(chunk(t, 6).size(), 5u);  // ceil(10/6) = 2 → 5 pieces, as torch.chunk
  EXPECT_EQ(chunk(zeros({0, 2}), 3).size(), 3u);
  EXPECT_EQ(split(zeros({0, 2}), 2).size(), 1u);
}

TEST(Join, SplitErrors) {
  Tensor t = zeros({4, 6});
  expect_error([&] { split(t, 0, 1); }, {"size must be positive", "0"});
  expect_error([&] { split(t, -2, 0); }, {"size must be positive", "-2"});
  expect_error([&] { split(t, std::vector<int64_t>{2, 3}, 1); }, {"[2, 3]", "sum to 5", "size 6"});
  expect_error([&] { split(t, std::vector<int64_t>{7, -1}, 1); }, {"non-negative", "[7, -1]"});
  expect_error([&] { split(t, 2, 2); }, {"dim 2", "out of range"});
  expect_error([&] { split(zeros({}), 1, 0); }, {"0-d"});
  expect_error([&] { chunk(t, 0, 0); }, {"positive number of chunks", "0"});
  expect_error([&] { chunk(t, 2, -3); }, {"dim -3", "out of range"});
}

TEST(Join, CatGradientIsSlices) {
  Tensor a = from_vector({1, 2}, {2}).set_requires_grad();
  Tensor b = from_vector({3, 4, 5}, {3}).set_requires_grad();
  Tensor y = cat({a, b}, 0);
  y.backward(from_vector({10, 20, 30, 40, 50}, {5}));
  EXPECT_EQ(to_vector(a.grad()), (std::vector<double>{10, 20}));
  EXPECT_EQ(to_vector(b.grad()), (std::vector<double>{30, 40, 50}));
}

TEST(Join, CatOnlySomeInputsNeedGrad) {
  Tensor a = from_vector({1, 2}, {1, 2});
  Tensor b = from_vector({3, 4}, {1, 2}).set_requires_grad();
  sum(mul(cat({a, b}, 0), 2.0)).backward();
  EXPECT_FALSE(a.grad().defined());
  EXPECT_EQ(to_vector(b.grad()), (std::vector<double>{2, 2}));
}

}  // namespace
}  // namespace blu
