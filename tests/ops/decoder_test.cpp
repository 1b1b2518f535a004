// Targeted tests for the Llama family's ops (rms_norm, rotary_embedding, silu, swiglu): the
// dedicated kernels against the same math written in BluTrain's own ops in float64 (forward and
// gradients — the math checked a second way besides the PyTorch oracle of opinfo_decoder.cpp),
// 16-bit outputs rounded once, the weight's fp32 gradient through a cast (Note [Wide gradients]),
// swiglu's gradients side by side for the halves of one buffer (Note [SwiGLU gradients side by
// side], ops/swiglu.cpp), and every BLU_CHECK on bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "blu/blu.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/nn.h"
#include "common/checks.h"

namespace blu {
namespace {

using test::bitwise_equal;
using test::expect_error;

// max |a - b| over all elements (same shape).
double max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto x = to_vector(a), y = to_vector(b);
  double m = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

Tensor leaf(const Tensor& t) {
  Tensor l = t.detach();
  l.set_requires_grad(true);
  return l;
}

// --- composites in BluTrain's ops ---

Tensor rms_norm_composite(const Tensor& x, const Tensor& w, double eps) {
  Tensor y = mul(x, rsqrt(add(mean(pow(x, 2.0), {-1}, true), eps)));
  return w.defined() ? mul(y, w) : y;
}
Tensor rotate_half(const Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return cat({neg(narrow(x, -1, h, h)), narrow(x, -1, 0, h)}, -1);
}
// cos/sin [T, D] broadcast over [B, T, H, D].
Tensor rotary_composite(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return add(mul(x, unsqueeze(cos, 1)), mul(rotate_half(x), unsqueeze(sin, 1)));
}

// f(inputs) and g(inputs) agree, and so do the gradients of sum(out · r) for every input.
template <typename F, typename G>
void expect_same_as_composite(F f, G g, std::vector<Tensor> inputs, double tol) {
  std::vector<Tensor> a, b;
  for (const Tensor& t : inputs) {
    a.push_back(leaf(t));
    b.push_back(leaf(t));
  }
  Tensor ya = f(a), yb = g(b);
  ASSERT_LT(max_diff(ya, yb), tol) << "forward";
  Tensor r = randn(ya.shape(), DType::f64);
  ya.backward(r);
  yb.backward(r);
  for (size_t i = 0; i < inputs.size(); ++i) {
    ASSERT_TRUE(a[i].grad().defined()) << "input " << i;
    EXPECT_LT(max_diff(a[i].grad(), b[i].grad()), tol) << "gradient of input " << i;
  }
}

TEST(RmsNorm, MatchesCompositeInF64) {
  manual_seed(11);
  for (const Shape& s : std::vector<Shape>{{5, 16}, {2, 3, 37}, {1}, {4, 1024}}) {
    SCOPED_TRACE(to_string(s));
    const Tensor x = randn(s, DType::f64), w = randn({s.back()}, DType::f64);
    expect_same_as_composite([](const std::vector<Tensor>& v) { return rms_norm(v[0], v[1], 1e-6); },
                             [](const std::vector<Tensor>& v) { return rms_norm_composite(v[0], v[1], 1e-6); }, {x, w},
                             1e-12);
    expect_same_as_composite([](const std::vector<Tensor>& v) { return rms_norm(v[0], Tensor(), 0.5); },
                             [](const std::vector<Tensor>& v) { return rms_norm_composite(v[0], Tensor(), 0.5); }, {x},
                             1e-12);
  }
}

TEST(RmsNorm, RowsHaveUnitRmsAndSixteenBitIsRoundedOnce) {
  manual_seed(12);
  Tensor x = add(mul(randn({3, 64}), 4.0), 1.0);
  const auto y = to_vector(rms_norm(x, Tensor(), 0.0));
  for (int r = 0; r < 3; ++r) {
    double ms = 0;
    for (int k = 0; k < 64; ++k) ms += y[size_t(r * 64 + k)] * y[size_t(r * 64 + k)] / 64;
    EXPECT_NEAR(ms, 1.0, 1e-5);
  }
  // The bf16/f16 kernel computes in f32 and rounds once: the f32 kernel's result on the same
  // (16-bit) values, rounded, bit for bit.
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor x16 = to_dtype(x, dt), w16 = to_dtype(randn({64}), dt);
    const Tensor want = to_dtype(rms_norm(to_dtype(x16, DType::f32), to_dtype(w16, DType::f32)), dt);
    EXPECT_TRUE(bitwise_equal(rms_norm(x16, w16), want)) << dtype_name(dt);
  }
}

TEST(RmsNorm, WeightGradientIsFp32ThroughACast) {
  manual_seed(13);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor w = randn({48}).set_requires_grad();
    const Tensor x = to_dtype(randn({100, 48}), dt), g = to_dtype(randn({100, 48}), dt);
    rms_norm(x, to_dtype(w, dt)).backward(g);
    ASSERT_EQ(w.grad().dtype(), DType::f32) << dtype_name(dt);
    // The same column sums in f64 on the 16-bit operands: an fp32 sum, not a 16-bit rounding.
    Tensor w64 = leaf(to_dtype(to_dtype(w.detach(), dt), DType::f64));
    rms_norm(to_dtype(x, DType::f64), w64).backward(to_dtype(g, DType::f64));
    const double scale = max_diff(w64.grad(), zeros({48}, DType::f64));
    EXPECT_LT(max_diff(w.grad(), w64.grad()) / scale, 1e-5) << dtype_name(dt);
  }
}

TEST(RmsNorm, Errors) {
  expect_error([] { rms_norm(zeros({2, 5}), zeros({4})); }, {"weight of shape [5]", "[4]"});
  expect_error([] { rms_norm(zeros({2, 5}), zeros({5}, DType::f64)); }, {"weight dtype f64", "f32"});
  expect_error([] { rms_norm(zeros({}), Tensor()); }, {"rms_norm", "0-d"});
  expect_error([] { rms_norm(zeros({2, 5}, DType::i32), Tensor()); }, {"rms_norm", "floating", "i32"});
  expect_error([] { rms_norm(zeros({2, 5}), Tensor(), -1.0); }, {"eps >= 0", "-1"});
}

// --- rotary_embedding ---

TEST(Rotary, MatchesCompositeInF64) {
  manual_seed(21);
  for (const Shape& s : std::vector<Shape>{{2, 5, 3, 8}, {1, 4, 2, 6}, {3, 1, 1, 2}}) {
    SCOPED_TRACE(to_string(s));
    const Tensor x = randn(s, DType::f64);
    const Tensor cos = randn({s[1], s[3]}, DType::f64), sin = randn({s[1], s[3]}, DType::f64);
    std::vector<Tensor> a{leaf(x)}, b{leaf(x)};
    Tensor ya = rotary_embedding(a[0], cos, sin), yb = rotary_composite(b[0], cos, sin);
    ASSERT_LT(max_diff(ya, yb), 1e-14);
    EXPECT_TRUE(ya.is_contiguous());
    Tensor r = randn(s, DType::f64);
    ya.backward(r);
    yb.backward(r);
    EXPECT_LT(max_diff(a[0].grad(), b[0].grad()), 1e-14);
  }
}

// With a real rotation table (cos/sin of position·frequency), the rotation keeps each pair's
// norm, and position 0 is the identity.
TEST(Rotary, RotationTableKeepsPairNorms) {
  const int64_t T = 6, D = 8, h = D / 2;
  std::vector<double> cv, sv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D; ++j) {
      const double f = double(t) / std::pow(10000.0, double(2 * (j % h)) / double(D));
      cv.push_back(std::cos(f));
      sv.push_back(std::sin(f));
    }
  const Tensor cos = from_vector(cv, {T, D}, DType::f64), sin = from_vector(sv, {T, D}, DType::f64);
  const Tensor x = randn({2, T, 3, D}, DType::f64);
  const Tensor y = rotary_embedding(x, cos, sin);
  const auto xv = to_vector(x), yv = to_vector(y);
  for (size_t row = 0; row < xv.size() / D; ++row)
    for (int64_t j = 0; j < h; ++j) {
      const size_t a = row * D + size_t(j), b = a + size_t(h);
      EXPECT_NEAR(xv[a] * xv[a] + xv[b] * xv[b], yv[a] * yv[a] + yv[b] * yv[b], 1e-12);
      if ((row / 3) % T == 0) {
        EXPECT_EQ(yv[a], xv[a]);
        EXPECT_EQ(yv[b], xv[b]);
      }
    }
}

TEST(Rotary, SixteenBitIsRoundedOnceWithF32Tables) {
  manual_seed(22);
  const Tensor cos = randn({5, 16}), sin = randn({5, 16});
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor x = to_dtype(randn({2, 5, 3, 16}), dt);
    const Tensor want = to_dtype(rotary_embedding(to_dtype(x, DType::f32), cos, sin), dt);
    EXPECT_TRUE(bitwise_equal(rotary_embedding(x, cos, sin), want)) << dtype_name(dt);
    // Tables in x's dtype: the same as f32 tables holding those values.
    const Tensor c16 = to_dtype(cos, dt), s16 = to_dtype(sin, dt);
    EXPECT_TRUE(bitwise_equal(rotary_embedding(x, c16, s16),
                              rotary_embedding(x, to_dtype(c16, DType::f32), to_dtype(s16, DType::f32))))
        << dtype_name(dt);
  }
}

// A head slice of a fused qkv buffer is read where it lies: no copy op runs.
TEST(Rotary, ReadsAStridedHeadSliceWithoutACopy) {
  const Tensor qkv = randn({2, 4, 6, 8});
  const Tensor q = narrow(qkv, 2, 0, 4), cos = randn({4, 8}), sin = randn({4, 8});
  std::vector<std::string> ran;
  const int h = add_op_observer([&](const OpDef& op, auto, auto, const Attrs&) { ran.push_back(op.name); });
  const Tensor y = rotary_embedding(q, cos, sin);
  remove_op_observer(h);
  EXPECT_EQ(ran, std::vector<std::string>{"rotary_embedding"});
  EXPECT_EQ(max_diff(y, rotary_embedding(contiguous(q), cos, sin)), 0.0);
}

TEST(Rotary, Errors) {
  const Tensor cs = zeros({3, 4});
  expect_error([&] { rotary_embedding(zeros({2, 3, 4}), cs, cs); }, {"x [B, T, H, D]", "[2, 3, 4]"});
  expect_error([] { rotary_embedding(zeros({1, 3, 2, 5}), zeros({3, 5}), zeros({3, 5})); }, {"even", "D"});
  expect_error([&] { rotary_embedding(zeros({1, 2, 2, 4}), cs, cs); }, {"cos of shape [2, 4]", "[3, 4]"});
  expect_error([&] { rotary_embedding(zeros({1, 3, 2, 4}), cs, zeros({3, 2})); }, {"sin of shape [3, 4]"});
  expect_error([&] { rotary_embedding(zeros({1, 3, 2, 4}), cs, cs, 3); }, {"rotate in [0, H = 2]", "got 3"});
  expect_error([&] { rotary_embedding(zeros({1, 3, 2, 4}), zeros({3, 4}, DType::bf16), cs); },
               {"cos in f32 or in x's dtype f32", "bf16"});
  expect_error([&] { rotary_embedding(zeros({1, 3, 2, 4}, DType::bf16), cs, zeros({3, 4}, DType::bf16)); },
               {"must share a dtype"});
  expect_error([&] { rotary_embedding(zeros({1, 3, 2, 4}, DType::i64), cs, cs); }, {"floating", "i64"});
}

// --- silu / swiglu ---

TEST(Swiglu, MatchesCompositeInF64) {
  manual_seed(31);
  const Tensor x = randn({4, 9}, DType::f64), u = randn({4, 9}, DType::f64);
  expect_same_as_composite([](const std::vector<Tensor>& v) { return silu(v[0]); },
                           [](const std::vector<Tensor>& v) { return mul(v[0], sigmoid(v[0])); }, {x}, 1e-14);
  expect_same_as_composite([](const std::vector<Tensor>& v) { return swiglu(v[0], v[1]); },
                           [](const std::vector<Tensor>& v) { return mul(mul(v[0], sigmoid(v[0])), v[1]); }, {x, u},
                           1e-14);
}

TEST(Swiglu, SixteenBitIsRoundedOnce) {
  manual_seed(32);
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor a = to_dtype(randn({6, 40}), dt), b = to_dtype(randn({6, 40}), dt);
    const Tensor want = to_dtype(swiglu(to_dtype(a, DType::f32), to_dtype(b, DType::f32)), dt);
    EXPECT_TRUE(bitwise_equal(swiglu(a, b), want)) << dtype_name(dt);
    EXPECT_TRUE(bitwise_equal(silu(a), to_dtype(silu(to_dtype(a, DType::f32)), dt))) << dtype_name(dt);
  }
}

// The op names that run during f().
template <typename F>
std::vector<std::string> ops_run(F&& f) {
  std::vector<std::string> ran;
  const int h = add_op_observer([&](const OpDef& op, auto, auto, const Attrs&) { ran.push_back(op.name); });
  f();
  remove_op_observer(h);
  return ran;
}
bool ran(const std::vector<std::string>& names, const std::string& op) {
  return std::find(names.begin(), names.end(), op) != names.end();
}

// gate and up as split/chunk halves of one [N, 2I] projection: no copy in the forward, and the
// backward's gradient of the projection is swiglu_backward's own buffer — no cat, no copy.
TEST(Swiglu, HalvesOfOneBufferGetTheirGradientsSideBySide) {
  manual_seed(33);
  const int64_t N = 6, I = 8;
  const Tensor h0 = randn({2, N / 2, 2 * I}, DType::f64), r = randn({2, N / 2, I}, DType::f64);
  Tensor h = leaf(h0);
  const auto parts = chunk(h, 2, -1);
  Tensor y;
  EXPECT_EQ(ops_run([&] { y = swiglu(parts[0], parts[1]); }), std::vector<std::string>{"swiglu"});
  const void* gh = nullptr;  // swiglu_backward's output buffer (not held: see below)
  Shape gh_shape;
  const int obs = add_op_observer([&](const OpDef& op, auto, auto out, const Attrs&) {
    if (std::string(op.name) != "swiglu_backward") return;
    gh = out[0].raw_data();
    gh_shape = out[0].shape();
  });
  const auto bw = ops_run([&] { y.backward(r); });
  remove_op_observer(obs);
  // The kernel, and the two halves it returns as views: split's backward joins them as a view
  // (a cat otherwise), and nothing copies.
  EXPECT_EQ(bw, (std::vector<std::string>{"swiglu_backward", "narrow", "narrow"}));
  EXPECT_FALSE(ran(bw, "cat"));
  ASSERT_NE(gh, nullptr);
  EXPECT_EQ(gh_shape, Shape({2, N / 2, 2 * I}));
  // The leaf's gradient is that buffer (AccumulateGrad keeps a gradient nothing else holds).
  EXPECT_EQ(h.grad().raw_data(), gh);
  // And it is right: the composite on separate halves.
  Tensor h2 = leaf(h0);
  const Tensor a = narrow(h2, -1, 0, I), b = narrow(h2, -1, I, I);
  mul(mul(a, sigmoid(a)), b).backward(r);
  EXPECT_LT(max_diff(h.grad(), h2.grad()), 1e-14);
}

// Halves taken with narrow get the same gradient, through narrow's own backward (zero-fill and
// copy per piece: narrow's backward does not join views).
TEST(Swiglu, NarrowHalvesGetCorrectGradients) {
  manual_seed(34);
  const Tensor h0 = randn({5, 12}, DType::f64), r = randn({5, 6}, DType::f64);
  Tensor h = leaf(h0), h2 = leaf(h0);
  swiglu(narrow(h, -1, 0, 6), narrow(h, -1, 6, 6)).backward(r);
  const auto parts = split(h2, 6, -1);
  swiglu(parts[0], parts[1]).backward(r);
  EXPECT_EQ(max_diff(h.grad(), h2.grad()), 0.0);
}

// Separate gate and up get contiguous gradients of their own.
TEST(Swiglu, SeparateInputsGetSeparateContiguousGradients) {
  Tensor a = leaf(randn({3, 4})), b = leaf(randn({3, 4}));
  swiglu(a, b).backward(randn({3, 4}));
  EXPECT_TRUE(a.grad().is_contiguous());
  EXPECT_TRUE(b.grad().is_contiguous());
  EXPECT_NE(a.grad().storage(), b.grad().storage());
}

TEST(Swiglu, Errors) {
  expect_error([] { swiglu(zeros({2, 3}), zeros({2, 4})); }, {"swiglu", "[2, 3]", "[2, 4]", "same shape"});
  expect_error([] { swiglu(zeros({2, 3}), zeros({2, 3}, DType::bf16)); }, {"up has dtype bf16", "f32"});
  expect_error([] { swiglu(zeros({2, 3}, DType::i32), zeros({2, 3}, DType::i32)); }, {"floating", "i32"});
  expect_error([] { silu(zeros({2}, DType::i64)); }, {"silu", "floating", "i64"});
}

}  // namespace
}  // namespace blu
