// core/shape and the view layer: strides, broadcasting, views sharing storage, offsets of
// narrow/select/permute, when reshape copies, and the messages of the shape errors.
#include <gtest/gtest.h>

#include "common/checks.h"
#include "blu/blu.h"

namespace blu {
namespace {

using test::expect_error;

TEST(Shape, StridesAndNumel) {
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(contiguous_strides({}), (Shape{}));
  EXPECT_EQ(numel({}), 1);
  EXPECT_EQ(numel({3, 0, 2}), 0);
  EXPECT_EQ(to_string({2, 3}), "[2, 3]");
  EXPECT_EQ(to_string({}), "[]");
}

TEST(Shape, Broadcast) {
  EXPECT_EQ(broadcast_shapes({3, 1, 5}, {4, 1}), (Shape{3, 4, 5}));
  EXPECT_EQ(broadcast_shapes({}, {2, 2}), (Shape{2, 2}));
  EXPECT_EQ(broadcast_shapes({0, 1}, {1, 3}), (Shape{0, 3}));
  expect_error([] { broadcast_shapes({2, 3}, {4, 3}); }, {"[2, 3]", "[4, 3]", "do not broadcast"});
  expect_error([] { add(zeros({2, 3}), zeros({3, 2})); }, {"[2, 3]", "[3, 2]"});
}

TEST(Shape, WrapDim) {
  EXPECT_EQ(wrap_dim(-1, 3), 2);
  EXPECT_EQ(wrap_dim(0, 0), 0);
  EXPECT_EQ(wrap_dim(-1, 0), 0);
  expect_error([] { wrap_dim(3, 3); }, {"dim 3", "3 dims", "-3..2"});
  expect_error([] { wrap_dim(-4, 3); }, {"dim -4", "out of range"});
  expect_error([] { sum(zeros({2, 3}), {2}); }, {"dim 2", "out of range"});
  expect_error([] { transpose(zeros({2, 3}), 0, 5); }, {"dim 5"});
}

TEST(View, SharesStorageBothWays) {
  Tensor t = arange(0, 6, 1, DType::f32);
  Tensor v = view(t, {2, 3});
  EXPECT_EQ(v.storage(), t.storage());
  fill_(select(v, 0, 1), 9);  // writes through a view of a view
  EXPECT_EQ(to_vector(t), (std::vector<double>{0, 1, 2, 9, 9, 9}));
  fill_(narrow(t, 0, 0, 1), -1);
  EXPECT_EQ(to_vector(v)[0], -1);
}

TEST(View, ReshapeOfNonContiguous) {
  Tensor t = transpose(arange(0, 6, 1, DType::f32).alias_with({2, 3}, {3, 1}, 0), 0, 1);  // [3, 2], strides [1, 3]
  EXPECT_FALSE(t.is_contiguous());
  expect_error([&] { view(t, {6}); }, {"cannot be viewed", "[3, 2]", "[1, 3]", "reshape"});
  Tensor r = reshape(t, {6});
  EXPECT_NE(r.storage(), t.storage());  // had to copy
  EXPECT_EQ(to_vector(r), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  // A non-contiguous layout that still allows a view: splitting a dim of a transposed tensor.
  Tensor u = transpose(zeros({4, 6}), 0, 1);  // [6, 4], strides [1, 6]
  Tensor w = view(u, {2, 3, 4});
  EXPECT_EQ(w.storage(), u.storage());
  EXPECT_EQ(w.strides(), (Shape{3, 1, 6}));
  // Merging dims after narrowing the inner one cannot be a view.
  expect_error([] { view(narrow(zeros({4, 6}), 1, 0, 3), {12}); }, {"cannot be viewed"});
}

TEST(View, BadReshapeSizes) {
  Tensor t = zeros({2, 3});
  expect_error([&] { reshape(t, {4, 2}); }, {"[4, 2]", "8 elements", "[2, 3]", "6"});
  expect_error([&] { reshape(t, {-1, -1}); }, {"only one dim can be -1"});
  expect_error([&] { reshape(t, {4, -1}); }, {"cannot infer -1", "6 elements"});
  expect_error([&] { view(t, {-2, 3}); }, {"bad size"});
  EXPECT_EQ(reshape(t, {-1}).shape(), (Shape{6}));
  EXPECT_EQ(reshape(zeros({0, 3}), {3, 0}).shape(), (Shape{3, 0}));
}

TEST(View, ExpandHasStrideZero) {
  Tensor t = from_vector({1, 2, 3}, {3, 1});
  Tensor e = expand(t, {2, 3, 4});
  EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(e.storage(), t.storage());
  EXPECT_EQ(to_vector(e)[5], 2);  // [0, 1, 1]
  EXPECT_EQ(expand(t, {-1, 2}).shape(), (Shape{3, 2}));
  expect_error([&] { expand(t, {3, 4, 5}); }, {"expand", "[3, 1]", "3", "4"});
  expect_error([&] { expand(t, {3}); }, {"fewer dims"});
}

TEST(View, NarrowSelectPermuteOffsets) {
  Tensor t = arange(0, 24, 1, DType::f32);
  Tensor x = view(t, {2, 3, 4});
  Tensor n = narrow(x, 2, 1, 2);
  EXPECT_EQ(n.offset(), 1);
  EXPECT_EQ(n.strides(), (Shape{12, 4, 1}));
  Tensor s = select(x, 1, 2);
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.offset(), 8);
  EXPECT_EQ(select(x, 0, -1).offset(), 12);
  Tensor p = permute(x, {2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  Tensor q = select(narrow(p, 0, 3, 1), 1, 1);  // p[3:4, 1] → offset 12 + 3
  EXPECT_EQ(q.offset(), 15);
  EXPECT_EQ(to_vector(q), (std::vector<double>{15, 19, 23}));
  expect_error([&] { narrow(x, 2, 3, 2); }, {"[3, 5)", "dim 2", "size 4"});
  expect_error([&] { select(x, 1, 3); }, {"index 3", "dim 1", "size 3"});
  expect_error([&] { permute(x, {0, 1}); }, {"2 dims given", "3"});
  expect_error([&] { permute(x, {0, 1, 1}); }, {"repeated"});
}

TEST(View, ContiguousCopiesOnlyWhenNeeded) {
  Tensor t = zeros({3, 4});
  EXPECT_TRUE(contiguous(t).is_same(t));
  Tensor tt = transpose(t, 0, 1);
  Tensor c = contiguous(tt);
  EXPECT_FALSE(c.is_same(tt));
  EXPECT_NE(c.storage(), tt.storage());
  EXPECT_TRUE(c.is_contiguous());
  // Size-1 dims do not make a tensor non-contiguous, whatever their stride.
  Tensor one = t.alias_with({3, 1}, {1, 7}, 0);
  EXPECT_TRUE(one.is_contiguous());
  EXPECT_TRUE(contiguous(one).is_same(one));
  EXPECT_TRUE(contiguous(select(t, 0, 1)).is_contiguous());
}

TEST(Tensor, ViewBoundsAreChecked) {
  Tensor t = zeros({4});
  expect_error([&] { t.alias_with({5}, {1}, 0); }, {"outside its storage", "4 elements"});
  expect_error([&] { t.alias_with({2}, {1}, -1); }, {"negative storage offset"});
  expect_error([&] { t.alias_with({2, 2}, {1}, 0); }, {"differ in rank"});
  expect_error([&] { t.data<double>(); }, {"f32", "f64"});
  expect_error([&] { zeros({2}).item(); }, {"one element", "[2]"});
  EXPECT_EQ(Tensor().str(), "Tensor(undefined)");
  expect_error([] { Tensor().shape(); }, {"undefined tensor"});
}

}  // namespace
}  // namespace blu
