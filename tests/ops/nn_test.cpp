// Targeted tests for ops/nn: dropout's Philox mask (determinism, rate, scaling, gradient, eval
// mode), the edges the OpInfo table cannot express (all targets ignored, repeated embedding
// indices, 16-bit against f32), and every BLU_CHECK on bad input, each naming the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "blu/blu.h"
#include "blu/ops/nn.h"
#include "donated_logits_check.h"

namespace blu {
namespace {

// Runs f, expects blu::Error, and checks that the message contains every fragment.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected blu::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "message: " << msg;
  }
}

Tensor ids(const std::vector<double>& v, const Shape& shape, DType dt = DType::i64) { return from_vector(v, shape, dt); }

// --- dropout ---

TEST(Dropout, SameSeedSameMaskOtherOffsetOtherMask) {
  Tensor x = randn({64, 33});
  Generator a(7), b(7);
  const auto ya = to_vector(dropout(x, 0.4, true, &a));
  EXPECT_EQ(ya, to_vector(dropout(x, 0.4, true, &b)));
  EXPECT_EQ(a.offset(), b.offset());
  EXPECT_GT(a.offset(), 0u);
  EXPECT_NE(ya, to_vector(dropout(x, 0.4, true, &a)));  // the generator moved on
}

TEST(Dropout, DropsAboutPAndScalesTheRest) {
  for (double p : {0.1, 0.5, 0.9}) {
    Generator gen(123);
    const auto y = to_vector(dropout(ones({20000}), p, true, &gen));
    int64_t dropped = 0;
    for (double v : y) {
      if (v == 0) {
        ++dropped;
      } else {
        EXPECT_FLOAT_EQ(float(v), float(1.0 / (1.0 - p)));
      }
    }
    EXPECT_NEAR(double(dropped) / double(y.size()), p, 0.015) << "p = " << p;
  }
}

TEST(Dropout, GradientIsTheSameMaskScaled) {
  Generator gen(5);
  Tensor x = randn({7, 9}, DType::f64);
  x.set_requires_grad(true);
  Tensor y = dropout(x, 0.3, true, &gen);
  Tensor r = randn({7, 9}, DType::f64);
  y.backward(r);
  const auto xv = to_vector(x), yv = to_vector(y), rv = to_vector(r), gv = to_vector(x.grad());
  for (size_t i = 0; i < xv.size(); ++i) {
    const bool kept = yv[i] != 0;
    EXPECT_DOUBLE_EQ(gv[i], kept ? rv[i] / 0.7 : 0.0) << i;
    if (kept) {
      EXPECT_DOUBLE_EQ(yv[i], xv[i] / 0.7) << i;
    }
  }
}

TEST(Dropout, MaskFollowsLogicalIndexNotLayout) {
  Tensor x = randn({6, 5});
  Tensor xt = contiguous(transpose(x, 0, 1));
  Tensor nc = transpose(xt, 0, 1);  // same values as x, other strides
  ASSERT_FALSE(nc.is_contiguous());
  Generator a(11), b(11);
  EXPECT_EQ(to_vector(dropout(x, 0.5, true, &a)), to_vector(dropout(nc, 0.5, true, &b)));
}

TEST(Dropout, EvalModeAndZeroPAreIdentityOneGivesZeros) {
  Tensor x = randn({4, 4});
  EXPECT_TRUE(dropout(x, 0.5, false).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, true).is_same(x));
  Generator gen(1);
  for (double v : to_vector(dropout(x, 1.0, true, &gen))) EXPECT_EQ(v, 0.0);
}

TEST(Dropout, BadP) {
  expect_error([] { dropout(ones({3}), 1.5); }, {"dropout", "p in [0, 1]", "1.5"});
  expect_error([] { dropout(ones({3}), -0.1); }, {"dropout", "-0.1"});
  expect_error([] { dropout(ones({3}, DType::i64), 0.5); }, {"dropout", "floating", "i64"});
}

// --- softmax ---

TEST(Softmax, StableForLargeLogitsAndRowsSumToOne) {
  Tensor x = from_vector({1000, 1001, 1002, -1000, 0, 1000}, {2, 3});
  const auto y = to_vector(softmax(x, 1));
  for (double v : y) EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(y[0] + y[1] + y[2], 1.0, 1e-6);
  EXPECT_NEAR(y[3] + y[4] + y[5], 1.0, 1e-6);
  const auto ly = to_vector(log_softmax(x, 1));
  for (double v : ly) EXPECT_TRUE(std::isfinite(v));
}

TEST(Softmax, SixteenBitMatchesF32) {
  Tensor x = randn({5, 11});
  for (DType dt : {DType::bf16, DType::f16}) {
    const auto want = to_vector(log_softmax(x, -1));
    const auto got = to_vector(log_softmax(to_dtype(x, dt), -1));
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.05 + 0.01 * std::abs(want[i])) << dt;
  }
}

TEST(Softmax, Errors) {
  expect_error([] { softmax(ones({2, 3}), 2); }, {"dim 2", "out of range"});
  expect_error([] { log_softmax(ones({2, 3}), -3); }, {"dim -3", "out of range"});
  expect_error([] { softmax(ones({2, 3}, DType::i64), 0); }, {"softmax", "floating", "i64"});
}

// --- cross_entropy ---

TEST(CrossEntropy, FusedMatchesLogSoftmaxPick) {
  Tensor x = randn({4, 6});
  Tensor t = ids({5, 0, 3, 3}, {4});
  const auto ls = to_vector(log_softmax(x, 1));
  const auto none = to_vector(cross_entropy(x, t, -100, Reduction::none));
  const int64_t tv[] = {5, 0, 3, 3};
  double total = 0;
  for (int n = 0; n < 4; ++n) {
    EXPECT_NEAR(none[size_t(n)], -ls[size_t(n * 6 + tv[n])], 1e-5);
    total += none[size_t(n)];
  }
  EXPECT_NEAR(cross_entropy(x, t).item(), total / 4, 1e-5);
  EXPECT_NEAR(cross_entropy(x, t, -100, Reduction::sum).item(), total, 1e-5);
}

TEST(CrossEntropy, AllIgnoredMeanIsNaNWithZeroGradient) {
  Tensor x = randn({3, 4});
  x.set_requires_grad(true);
  Tensor loss = cross_entropy(x, ids({-100, -100, -100}, {3}));
  EXPECT_TRUE(std::isnan(loss.item()));
  loss.backward();
  for (double v : to_vector(x.grad())) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(cross_entropy(x, ids({-100, -100, -100}, {3}), -100, Reduction::sum).item(), 0.0);
}

TEST(CrossEntropy, SixteenBitMatchesF32) {
  Tensor x = randn({6, 10});
  Tensor t = ids({9, 0, -100, 4, 4, 7}, {6});
  Tensor xf = x.detach();
  xf.set_requires_grad(true);
  Tensor want = cross_entropy(xf, t);
  want.backward();
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor xh = to_dtype(x, dt);
    xh.set_requires_grad(true);
    Tensor got = cross_entropy(xh, t);
    got.backward();
    EXPECT_NEAR(got.item(), want.item(), 0.02) << dt;
    const auto gw = to_vector(xf.grad()), gg = to_vector(xh.grad());
    for (size_t i = 0; i < gw.size(); ++i) EXPECT_NEAR(gg[i], gw[i], 0.005) << dt << " element " << i;
  }
}

// Its backward writes over logits nobody holds any more (Note [Donated buffers]).
TEST(CrossEntropy, BackwardWritesOverDroppedLogits) {
  test::check_donated_logits(kCPU, DType::f32);
  test::check_donated_logits(kCPU, DType::f64);
}

TEST(CrossEntropy, Errors) {
  expect_error([] { cross_entropy(zeros({3, 4}), ids({0, 4, 1}, {3})); },
               {"target 4", "position 1", "[0, 4)"});
  expect_error([] { cross_entropy(zeros({3, 4}), ids({0, 1, -1}, {3})); }, {"target -1", "position 2"});
  expect_error([] { cross_entropy(zeros({4}), ids({7}, {})); }, {"target 7", "position 0"});
  // num_classes: targets must be classes, not padded columns; K must lie in [1, C] (or be -1).
  expect_error([] { cross_entropy(zeros({3, 8}), ids({0, 5, 1}, {3}), -100, Reduction::mean, 5); },
               {"target 5", "position 1", "[0, 5)"});
  expect_error([] { cross_entropy(zeros({8}), ids({6}, {}), -100, Reduction::sum, 5); }, {"target 6", "[0, 5)"});
  expect_error([] { cross_entropy(zeros({3, 4}), ids({0, 1, 2}, {3}), -100, Reduction::mean, 5); },
               {"num_classes", "[1, 4]", "got 5"});
  expect_error([] { cross_entropy(zeros({3, 4}), ids({0, 1, 2}, {3}), -100, Reduction::mean, 0); },
               {"num_classes", "got 0"});
  expect_error([] { cross_entropy(zeros({3, 4}), ids({0, 1}, {2})); }, {"target of shape [3]", "[2]"});
  expect_error([] { cross_entropy(zeros({4}), ids({0}, {1})); }, {"0-d target", "[1]"});
  expect_error([] { cross_entropy(zeros({2, 3, 4}), ids({0, 1}, {2})); }, {"[N, C] or [C]", "[2, 3, 4]"});
  expect_error([] { cross_entropy(zeros({2, 3}), zeros({2})); }, {"target", "index dtype", "f32"});
  expect_error([] { cross_entropy(zeros({2, 3}, DType::i64), ids({0, 1}, {2})); }, {"logits", "floating", "i64"});
}

// --- layer_norm ---

TEST(LayerNorm, NormalisesRowsAndSixteenBitMatchesF32) {
  Tensor x = add(mul(randn({3, 64}), 3.0), 5.0);
  const auto y = to_vector(layer_norm(x, Tensor(), Tensor()));
  for (int r = 0; r < 3; ++r) {
    double m = 0, v = 0;
    for (int k = 0; k < 64; ++k) m += y[size_t(r * 64 + k)] / 64;
    for (int k = 0; k < 64; ++k) v += (y[size_t(r * 64 + k)] - m) * (y[size_t(r * 64 + k)] - m) / 64;
    EXPECT_NEAR(m, 0.0, 1e-5);
    EXPECT_NEAR(v, 1.0, 1e-3);
  }
  Tensor w = randn({64}), b = randn({64});
  const auto want = to_vector(layer_norm(x, w, b));
  const auto got = to_vector(layer_norm(to_dtype(x, DType::bf16), to_dtype(w, DType::bf16), to_dtype(b, DType::bf16)));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 0.1 + 0.02 * std::abs(want[i]));
}

TEST(LayerNorm, SingleColumnGivesTheBiasAndNoInputGradient) {
  Tensor x = randn({4, 1}, DType::f64);
  Tensor w = randn({1}, DType::f64), b = randn({1}, DType::f64);
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  Tensor y = layer_norm(x, w, b);
  for (double v : to_vector(y)) EXPECT_EQ(v, b.item());
  sum(y).backward();
  for (double v : to_vector(x.grad())) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(w.grad().item(), 0.0);
}

TEST(LayerNorm, Errors) {
  expect_error([] { layer_norm(zeros({2, 5}), zeros({4}), Tensor()); }, {"weight of shape [5]", "[4]"});
  expect_error([] { layer_norm(zeros({2, 5}), Tensor(), zeros({5, 1})); }, {"bias of shape [5]", "[5, 1]"});
  expect_error([] { layer_norm(zeros({2, 5}), zeros({5}, DType::f64), Tensor()); }, {"weight dtype f64", "f32"});
  expect_error([] { layer_norm(zeros({}), Tensor(), Tensor()); }, {"layer_norm", "0-d"});
  expect_error([] { layer_norm(zeros({2, 5}, DType::i32), Tensor(), Tensor()); }, {"layer_norm", "floating", "i32"});
  expect_error([] { layer_norm(zeros({2, 5}), Tensor(), Tensor(), -1.0); }, {"eps >= 0", "-1"});
}

// --- embedding ---

TEST(Embedding, RepeatedIndicesSumTheirGradients) {
  Tensor w = randn({4, 3}, DType::f64);
  w.set_requires_grad(true);
  Tensor idx = ids({2, 0, 2, 2}, {2, 2});
  Tensor y = embedding(w, idx);
  EXPECT_EQ(y.shape(), (Shape{2, 2, 3}));
  y.backward(from_vector({1, 2, 3, 10, 20, 30, 100, 200, 300, 1000, 2000, 3000}, {2, 2, 3}, DType::f64));
  EXPECT_EQ(to_vector(w.grad()), (std::vector<double>{10, 20, 30, 0, 0, 0, 1101, 2202, 3303, 0, 0, 0}));
}

TEST(Embedding, ParallelBackwardMatchesSerialSum) {
  // Large enough for the threaded path; the sum per row must not depend on the thread count.
  const int64_t V = 50, C = 32, M = 4096;
  Generator gen(3);
  Tensor idx = randint(0, V, {M}, DType::i64, kCPU, &gen);
  Tensor g = randn({M, C}, DType::f64, kCPU, &gen);
  Tensor w = zeros({V, C}, DType::f64);
  w.set_requires_grad(true);
  embedding(w, idx).backward(g);
  const auto iv = to_vector(idx), gv = to_vector(g);
  std::vector<double> want(size_t(V * C), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < C; ++k) want[size_t(int64_t(iv[size_t(m)]) * C + k)] += gv[size_t(m * C + k)];
  EXPECT_EQ(to_vector(w.grad()), want);
}

TEST(Embedding, BackwardAddScalesRowsIntoAnExistingGradient) {
  const int64_t V = 7, C = 3;
  Generator gen(5);
  const Tensor idx = ids({2, 0, 2, 6, 2, 0}, {2, 3});
  const Tensor g = randn({2, 3, C}, DType::f64, kCPU, &gen), base = randn({V, C}, DType::f64, kCPU, &gen);
  Tensor out = clone(base);
  EXPECT_EQ(embedding_backward_add_(out, g, idx, 0.25).raw_data(), out.raw_data());
  const auto iv = to_vector(idx), gv = to_vector(g);
  std::vector<double> want = to_vector(base);
  for (int64_t v = 0; v < V; ++v) {  // rows summed in position order, scaled, added once
    std::vector<double> acc(size_t(C), 0.0);
    bool named = false;
    for (size_t m = 0; m < iv.size(); ++m)
      if (int64_t(iv[m]) == v) {
        named = true;
        for (int64_t k = 0; k < C; ++k) acc[size_t(k)] += gv[m * size_t(C) + size_t(k)];
      }
    if (named)
      for (int64_t k = 0; k < C; ++k) want[size_t(v * C + k)] += 0.25 * acc[size_t(k)];
  }
  EXPECT_EQ(to_vector(out), want);
  // Into a window of rows [first, first + rows): the whole table's rows there, the other indices
  // skipped (ZeRO-2's row exchange adds into a rank's slice of the embedding gradient).
  for (const auto& [first, rows] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {1, 2}, {3, 2}, {5, 2}, {0, 7}}) {
    Tensor win = clone(narrow(base, 0, first, rows));
    embedding_backward_add_window_(win, g, idx, first, 0.25);
    EXPECT_EQ(to_vector(win), std::vector<double>(want.begin() + first * C, want.begin() + (first + rows) * C))
        << "window [" << first << ", " << first + rows << ")";
  }
  expect_error([&] { embedding_backward_add_window_(out, g, idx, -1); }, {"first_row must be >= 0", "-1"});
  expect_error([&] { embedding_backward_add_(out, to_dtype(g, DType::f32), idx); }, {"grad_out [6, 3] f64", "f32"});
  expect_error([&] { embedding_backward_add_(out, zeros({6, 4}, DType::f64), idx); }, {"grad_out [6, 3]", "[6, 4]"});
  expect_error([&] { embedding_backward_add_(transpose(zeros({3, 7}, DType::f64), 0, 1), g, idx); },
               {"contiguous grad_weight"});
  expect_error([&] { embedding_backward_add_(out, g, ids({0, 9, 1, 1, 1, 1}, {6})); }, {"index 9", "7 rows"});
}

TEST(Embedding, Errors) {
  expect_error([] { embedding(zeros({5, 3}), ids({0, 5, 1}, {3})); }, {"index 5", "position 1", "5 rows"});
  expect_error([] { embedding(zeros({5, 3}), ids({-1}, {1}, DType::i32)); }, {"index -1", "position 0"});
  expect_error([] { embedding(zeros({5}), ids({0}, {1})); }, {"weight [V, C]", "[5]"});
  expect_error([] { embedding(zeros({5, 3}), zeros({2})); }, {"indices", "index dtype", "f32"});
  expect_error([] { embedding(zeros({5, 3}, DType::i64), ids({0}, {1})); }, {"weight", "floating", "i64"});
}

}  // namespace
}  // namespace blu

namespace blu {
namespace {

// Note [Vectorisable tanh] (backend/cpu/elementwise.cpp): GELU's tanh form in float, forward and
// backward (gelu_and_backward, what gelu_linear's backward runs), against the same formulas in
// double over 2M values in [-12, 12]; NaN stays NaN. The bound is what float evaluation of the
// formula allows: a few ulp of the result, plus a few ulp of 1 in 1 + tanh (scaled by x/2).
TEST(Gelu, TanhFormInFloatMatchesDouble) {
  const int64_t n = 2'000'001;
  std::vector<double> xs(static_cast<size_t>(n));  // float values
  for (int64_t i = 0; i < n; ++i) xs[size_t(i)] = double(-12.f + 24.f * float(i) / float(n - 1));
  xs.push_back(NAN);
  const Tensor x = from_vector(xs, {int64_t(xs.size())});
  const Tensor g = ones({int64_t(xs.size())});
  const auto both = gelu_and_backward(g, x, /*approximate=*/true);
  const std::vector<double> y = to_vector(gelu(x, true)), y2 = to_vector(both[0]), dy = to_vector(both[1]);
  const double k = std::sqrt(2.0 / M_PI), eps = std::numeric_limits<float>::epsilon();
  double worst_y = 0, worst_dy = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = xs[size_t(i)];
    const double u = k * (v + 0.044715 * v * v * v), th = std::tanh(u);
    const double ref = 0.5 * v * (1 + th);
    const double dref = 0.5 * (1 + th) + 0.5 * v * (1 - th * th) * k * (1 + 3 * 0.044715 * v * v);
    const double tol_y = 4 * eps * (std::abs(ref) + 0.5 * std::abs(v));
    const double tol_dy = 8 * eps * (std::abs(dref) + 1 + std::abs(v) * (1 + 0.2 * v * v));
    worst_y = std::max(worst_y, std::abs(y[size_t(i)] - ref) / tol_y);
    worst_dy = std::max(worst_dy, std::abs(dy[size_t(i)] - dref) / tol_dy);
    ASSERT_EQ(y[size_t(i)], y2[size_t(i)]) << "x = " << v;
  }
  EXPECT_LE(worst_y, 1.0) << "worst forward error, in units of the bound";
  EXPECT_LE(worst_dy, 1.0) << "worst backward error, in units of the bound";
  EXPECT_TRUE(std::isnan(y.back()));
  EXPECT_TRUE(std::isnan(dy.back()));
}

}  // namespace
}  // namespace blu
