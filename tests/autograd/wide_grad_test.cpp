// Note [Wide gradients] (ops/dispatch.h): under 16-bit compute, an fp32 master parameter's
// gradient comes straight from the backward of the op that used its 16-bit cast — linear (and the
// tied LM head), gelu_linear, layer_norm — in fp32, never rounded to 16 bits, and into the
// parameter's grad slot when it has one; ops that cannot widen still get 16-bit gradients through
// the cast, and the two kinds are summed.
#include <gtest/gtest.h>

#include <cmath>

#include "common/checks.h"
#include "blu/blu.h"
#include "blu/ops/fused.h"

namespace blu {
namespace {

using test::expect_error;

// max |got - want| / max |want|.
double rel_err(const Tensor& got, const Tensor& want) {
  const std::vector<double> a = to_vector(to_dtype(got, DType::f64)), b = to_vector(to_dtype(want, DType::f64));
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

Tensor rnd(const Shape& s, DType dt = DType::f32) { return to_dtype(randn(s), dt); }

// The gradients of W (and b) for y = linear(x, W_bf16, b_bf16) with W, b fp32 leaves, against the
// same products in f64 on the bf16-rounded operands: an fp32 sum, not a bf16 rounding (2^-9).
TEST(WideGrad, LinearGivesMasterWeightsFp32Gradients) {
  manual_seed(3);
  for (DType dt : {DType::bf16, DType::f16}) {
    Tensor w = rnd({48, 96}).set_requires_grad(), b = rnd({48}).set_requires_grad();
    const Tensor x = rnd({200, 96}, dt), g = rnd({200, 48}, dt);
    linear(x, to_dtype(w, dt), to_dtype(b, dt)).backward(g);
    ASSERT_EQ(w.grad().dtype(), DType::f32);
    ASSERT_EQ(b.grad().dtype(), DType::f32);
    const Tensor g64 = to_dtype(g, DType::f64), x64 = to_dtype(x, DType::f64);
    EXPECT_LT(rel_err(w.grad(), matmul(transpose(g64, 0, 1), x64)), 1e-6) << dtype_name(dt);
    EXPECT_LT(rel_err(b.grad(), sum(g64, {0})), 1e-6) << dtype_name(dt);
  }
}

// Without the cast (fp32 compute) nothing changes; and a 16-bit leaf keeps a 16-bit gradient.
TEST(WideGrad, OnlyCastsFromAWiderLeafAreWidened) {
  manual_seed(4);
  Tensor w = rnd({8, 16}).set_requires_grad();
  linear(rnd({5, 16}), w).backward(rnd({5, 8}));
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  Tensor w16 = rnd({8, 16}, DType::bf16).set_requires_grad();
  linear(rnd({5, 16}, DType::bf16), w16).backward(rnd({5, 8}, DType::bf16));
  EXPECT_EQ(w16.grad().dtype(), DType::bf16);
}

// A leaf used through one cast by a widening op (linear) and by one that is not (mul): the fp32
// and the bf16 contribution are summed in fp32 — the same as the f64 reference.
TEST(WideGrad, WideAndNarrowContributionsAreSummed) {
  manual_seed(5);
  Tensor w = rnd({8, 16}).set_requires_grad();
  const Tensor x = rnd({5, 16}, DType::bf16), g = rnd({5, 8}, DType::bf16), r = rnd({8, 16}, DType::bf16);
  const Tensor wb = to_dtype(w, DType::bf16);
  add(sum(mul(linear(x, wb), g)), sum(mul(wb, r))).backward();
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  const Tensor want = add(matmul(transpose(to_dtype(g, DType::f64), 0, 1), to_dtype(x, DType::f64)), to_dtype(r, DType::f64));
  EXPECT_LT(rel_err(w.grad(), want), 1e-6);
}

// gelu_linear's and layer_norm's parameter gradients widen too.
TEST(WideGrad, GeluLinearAndLayerNormParameters) {
  manual_seed(6);
  const DType dt = DType::bf16;
  Tensor w = rnd({32, 64}).set_requires_grad(), b = rnd({32}).set_requires_grad();
  const Tensor u = rnd({100, 64}, dt), g = rnd({100, 32}, dt);
  gelu_linear(u, to_dtype(w, dt), to_dtype(b, dt)).backward(g);
  ASSERT_EQ(w.grad().dtype(), DType::f32);
  const Tensor h = gelu(to_dtype(u, DType::f64), true), g64 = to_dtype(g, DType::f64);
  // The recomputed GELU is rounded to bf16 before the product, as in the forward.
  EXPECT_LT(rel_err(w.grad(), matmul(transpose(g64, 0, 1), to_dtype(to_dtype(h, dt), DType::f64))), 1e-6);
  EXPECT_LT(rel_err(b.grad(), sum(g64, {0})), 1e-6);

  Tensor lw = rnd({64}).set_requires_grad(), lb = rnd({64}).set_requires_grad();
  const Tensor x = rnd({100, 64}, dt), gy = rnd({100, 64}, dt);
  layer_norm(x, to_dtype(lw, dt), to_dtype(lb, dt), 1e-5).backward(gy);
  ASSERT_EQ(lw.grad().dtype(), DType::f32);
  ASSERT_EQ(lb.grad().dtype(), DType::f32);
  Tensor lw64 = to_dtype(to_dtype(lw.detach(), dt), DType::f64).set_requires_grad(),
         lb64 = to_dtype(to_dtype(lb.detach(), dt), DType::f64).set_requires_grad();
  layer_norm(to_dtype(x, DType::f64), lw64, lb64, 1e-5).backward(to_dtype(gy, DType::f64));
  EXPECT_LT(rel_err(lw.grad(), lw64.grad()), 1e-5);
  EXPECT_LT(rel_err(lb.grad(), lb64.grad()), 1e-6);
}

// With a grad slot (DDP's bucket view) the GEMM writes the weight gradient into the slot itself:
// the same bits as without one, and one allocation fewer per parameter.
TEST(WideGrad, GemmWritesIntoTheGradSlotThroughTheCast) {
  manual_seed(7);
  const Tensor x = rnd({64, 32}, DType::bf16), g = rnd({64, 16}, DType::bf16), w0 = rnd({16, 32}), b0 = rnd({16});
  auto run = [&](bool slots) {
    Tensor w = clone(w0).set_requires_grad(), b = clone(b0).set_requires_grad();
    Tensor buffer = zeros({16 * 32 + 16});
    if (slots) {
      w.set_grad_slot(view(narrow(buffer, 0, 0, 16 * 32), {16, 32}));
      b.set_grad_slot(narrow(buffer, 0, 16 * 32, 16));
    }
    const Tensor y = linear(x, to_dtype(w, DType::bf16), to_dtype(b, DType::bf16));
    const int64_t before = cpu_allocator().stats().allocs;
    y.backward(g);
    const int64_t allocs = cpu_allocator().stats().allocs - before;
    if (slots) {
      EXPECT_EQ(w.grad().raw_data(), buffer.raw_data());
      EXPECT_EQ(b.grad().raw_data(), narrow(buffer, 0, 16 * 32, 16).raw_data());
    }
    return std::make_tuple(to_vector(w.grad()), to_vector(b.grad()), allocs);
  };
  const auto [w_plain, b_plain, plain_allocs] = run(false);
  const auto [w_slot, b_slot, slot_allocs] = run(true);
  EXPECT_EQ(w_slot, w_plain);
  EXPECT_EQ(b_slot, b_plain);
  EXPECT_EQ(slot_allocs, plain_allocs - 2);
}

TEST(WideGrad, LinearWeightGradIntoChecksItsOutputs) {
  const Tensor g = rnd({6, 4}, DType::bf16), x = rnd({6, 3}, DType::bf16);
  Tensor gw = zeros({4, 3}), gb = zeros({4});
  linear_weight_grad_into(gw, g, x, gb);
  const Tensor g64 = to_dtype(g, DType::f64);
  EXPECT_LT(rel_err(gw, matmul(transpose(g64, 0, 1), to_dtype(x, DType::f64))), 1e-7);
  EXPECT_LT(rel_err(gb, sum(g64, {0})), 1e-7);
  expect_error([&] { linear_weight_grad_into(zeros({4, 3}, DType::f16), g, x); }, {"gw", "must be bf16 or f32"});
  expect_error([&] { linear_weight_grad_into(zeros({3, 4}), g, x); }, {"gw", "must have shape [4, 3]"});
  expect_error([&] { linear_weight_grad_into(gw, g, x, zeros({5})); }, {"gb", "must have shape [4]"});
  expect_error([&] { linear_weight_grad_into(zeros({4, 3}, DType::f64), rnd({6, 4}), rnd({6, 3})); },
               {"gw", "must be f32"});
  expect_error([&] { linear_weight_grad_into(transpose(zeros({3, 4}), 0, 1), g, x); }, {"must be contiguous"});
}

}  // namespace
}  // namespace blu
