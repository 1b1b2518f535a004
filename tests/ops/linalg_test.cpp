// Targeted tests for ops/linalg beyond the OpInfo table: argument errors, the 16-bit paths, and
// that linear's backward reaches BLAS without copying its transposed operands.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "blu/ops/dispatch.h"
#include "common/opinfo.h"
#include "common/checks.h"

namespace blu::test {
namespace {

// The message of the blu::Error that f throws ("" if it throws none).
#define EXPECT_ERROR_MENTIONS(call, ...)                                                   \
  do {                                                                                     \
    const std::string msg = error_of([&] { (void)(call); });                               \
    ASSERT_NE(msg, "") << #call " did not throw blu::Error";                               \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(msg.find(part), std::string::npos) << msg; \
  } while (0)

TEST(Linalg, MatmulInnerDimMismatchNamesBothShapes) {
  EXPECT_ERROR_MENTIONS(matmul(zeros({3, 4}), zeros({5, 6})), "inner dims", "[3, 4]", "[5, 6]");
  EXPECT_ERROR_MENTIONS(matmul(zeros({4}), zeros({5})), "inner dims", "[4]", "[5]");
  EXPECT_ERROR_MENTIONS(matmul(zeros({2, 3, 4}), zeros({5})), "[2, 3, 4]", "[5]");
}

TEST(Linalg, MatmulRejects0dOperands) {
  EXPECT_ERROR_MENTIONS(matmul(zeros({}), zeros({3})), "at least 1 dim", "[]");
  EXPECT_ERROR_MENTIONS(matmul(zeros({3}), zeros({})), "at least 1 dim");
  EXPECT_ERROR_MENTIONS(linear(zeros({}), zeros({2, 1})), "at least 1 dim");
}

TEST(Linalg, MatmulDtypeMismatch) {
  EXPECT_ERROR_MENTIONS(matmul(zeros({2, 3}), zeros({3, 2}, DType::f64)), "dtype mismatch", "f32", "f64");
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}), zeros({4, 3}, DType::bf16)), "dtype mismatch", "bf16");
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}), zeros({4, 3}), zeros({4}, DType::f64)), "dtype mismatch", "bias");
}

TEST(Linalg, IntegerOperandsRefused) {
  EXPECT_ERROR_MENTIONS(matmul(zeros({2, 3}, DType::i64), zeros({3, 2}, DType::i64)), "floating", "i64");
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}, DType::i32), zeros({4, 3}, DType::i32)), "floating", "i32");
}

TEST(Linalg, MatmulBatchDimsMustBroadcast) {
  EXPECT_ERROR_MENTIONS(matmul(zeros({2, 3, 4}), zeros({3, 4, 5})), "do not broadcast", "[2]", "[3]");
}

TEST(Linalg, LinearShapeErrors) {
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}), zeros({4, 5})), "input features", "[2, 3]", "[4, 5]");
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}), zeros({3})), "2-D weight", "[3]");
  EXPECT_ERROR_MENTIONS(linear(zeros({2, 3}), zeros({4, 3}), zeros({3})), "bias of shape [4]", "[3]");
}

// 16-bit products: fp32 products of the same (rounded) values, rounded once (up to a rounding
// flip where BLAS sums in another order for another layout: 2 ulps).
TEST(Linalg, HalfPrecisionMatchesFloat) {
  Generator g(7);
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double rtol = dt == DType::bf16 ? 8e-3 : 1e-3;
    const Tensor a = rnd(g, {2, 5, 33}, dt), b = noncontig(rnd(g, {33, 7}, dt));
    const Tensor want = matmul(to_dtype(a, DType::f32), to_dtype(b, DType::f32));
    const Tensor got = matmul(a, b);
    ASSERT_EQ(got.dtype(), dt);
    EXPECT_EQ(compare(to_dtype(got, DType::f32), to_dtype(want, dt), 1e-4, rtol), "");

    const Tensor x = rnd(g, {4, 33}, dt), w = rnd(g, {6, 33}, dt), bias = rnd(g, {6}, dt);
    const Tensor lw = linear(to_dtype(x, DType::f32), to_dtype(w, DType::f32), to_dtype(bias, DType::f32));
    EXPECT_EQ(compare(to_dtype(linear(x, w, bias), DType::f32), to_dtype(lw, dt), 1e-4, rtol), "");
  }
}

// linear's backward (gᵀ·x and g·w) passes transposed views to BLAS: nothing copies a
// non-contiguous tensor into a contiguous one. (The engine's clones of the leaf gradients it
// stores are of contiguous tensors.)
TEST(Linalg, LinearBackwardCopiesNoLayout) {
  Generator g(3);
  Tensor x = rnd(g, {8, 16}, DType::f32).set_requires_grad(true);
  Tensor w = rnd(g, {4, 16}, DType::f32).set_requires_grad(true);
  Tensor b = rnd(g, {4}, DType::f32).set_requires_grad(true);
  Tensor y = linear(x, w, b);
  std::vector<std::string> ran;
  int layout_copies = 0;
  const int h = add_op_observer([&](const OpDef& op, std::span<const Tensor> in, auto, const Attrs&) {
    ran.push_back(op.name);
    if (std::string_view(op.name) == "clone" && !in[0].is_contiguous()) ++layout_copies;
  });
  y.backward(ones({8, 4}));
  remove_op_observer(h);
  // grad_x is one matmul; grad_w and grad_b come together from one linear_weight_grad.
  EXPECT_EQ(std::count(ran.begin(), ran.end(), "matmul"), 1) << testing::PrintToString(ran);
  EXPECT_EQ(std::count(ran.begin(), ran.end(), "linear_weight_grad"), 1) << testing::PrintToString(ran);
  EXPECT_EQ(std::count(ran.begin(), ran.end(), "linear"), 0);
  EXPECT_EQ(layout_copies, 0) << testing::PrintToString(ran);
}

// A timing, not a check: run with --gtest_also_run_disabled_tests --gtest_filter='*Perf*'.
TEST(Linalg, DISABLED_PerfGptLmHead) {
  Generator g(1);
  const int64_t R = 512, C = 128, V = 50304;
  Tensor x = rnd(g, {R, C}, DType::f32).set_requires_grad(true);
  Tensor w = mul(rnd(g, {V, C}, DType::f32), 0.02).set_requires_grad(true);
  Tensor gy = rnd(g, {R, V}, DType::f32);
  auto time = [](auto&& f) {
    f();  // warm-up
    const int n = 3;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
  };
  const double flops = 2.0 * double(R) * double(C) * double(V);
  Tensor y;
  const double fwd = time([&] { y = linear(x, w); });
  const double bwd = time([&] {
    x.zero_grad();
    w.zero_grad();
    linear(x, w).backward(gy);
  }) - fwd;
  std::printf("linear [%lld,%lld]x[%lld,%lld]^T f32: forward %.1f ms (%.1f GFLOP/s), backward %.1f ms (%.1f GFLOP/s)\n",
              (long long)R, (long long)C, (long long)V, (long long)C, fwd * 1e3, flops / fwd * 1e-9, bwd * 1e3,
              2 * flops / bwd * 1e-9);
}

}  // namespace
}  // namespace blu::test
