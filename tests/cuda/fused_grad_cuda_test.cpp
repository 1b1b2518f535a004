// GPU tests for the fused gradient ops: "linear_weight_grad" (linear's weight and bias gradients
// from one cuBLASLt gemm with the BGRAD epilogue) through linear's backward, against the CPU; and
// "sum_squares" (clip_grad_norm's multi-tensor squared norm) against the CPU's double sum, with
// run-to-run bitwise determinism. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "blu/backend/cuda/runtime.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/optim/optimizer.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::host;
using test::kGPU;

std::vector<double> vals(const Tensor& t) {
  return to_vector(to_dtype(t.device().is_cpu() ? t : host(t), DType::f64));
}
Tensor rnd(const Shape& s, DType dt) { return to_dtype(randn(s), dt); }

// Max |a - b| / (atol + rtol·|b|) over the elements: <= 1 passes.
void expect_close(const Tensor& got, const Tensor& want, double atol, double rtol, const char* what) {
  const std::vector<double> a = vals(got), b = vals(want);
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (atol + rtol * std::abs(b[i])));
  EXPECT_LE(worst, 1.0) << what;
}

// y = linear(x, w, b) on both devices, backward with the same upstream gradient: the CUDA
// gradients (bias from the gemm's epilogue) match the CPU's. bf16: operands and outputs rounded
// to bf16, fp32 sums in a different order → a few bf16 ulps; the bias gradient sums R values.
void check_linear_backward(DType dt, int64_t R, int64_t in, int64_t out, double atol, double rtol) {
  manual_seed(11);
  const Tensor x0 = rnd({R, in}, dt), w0 = rnd({out, in}, dt), b0 = rnd({out}, dt), g0 = rnd({R, out}, dt);
  Tensor xc = clone(x0).set_requires_grad(true), wc = clone(w0).set_requires_grad(true),
         bc = clone(b0).set_requires_grad(true);
  linear(xc, wc, bc).backward(g0);
  Tensor xd = to_device(x0, kGPU).set_requires_grad(true), wd = to_device(w0, kGPU).set_requires_grad(true),
         bd = to_device(b0, kGPU).set_requires_grad(true);
  linear(xd, wd, bd).backward(to_device(g0, kGPU));
  const double scale = std::sqrt(double(R));  // gradients of w and b sum R products
  expect_close(xd.grad(), xc.grad(), atol * std::sqrt(double(out)), rtol, "grad_x");
  expect_close(wd.grad(), wc.grad(), atol * scale, rtol, "grad_w");
  expect_close(bd.grad(), bc.grad(), atol * scale, rtol, "grad_b");
}

TEST(FusedGradCuda, LinearBackwardBiasF32) {
  SKIP_WITHOUT_CUDA();
  check_linear_backward(DType::f32, 64, 48, 40, 1e-5, 1e-5);
  check_linear_backward(DType::f32, 513, 77, 129, 1e-5, 1e-5);  // odd sizes
  check_linear_backward(DType::f32, 1024, 768, 2304, 1e-5, 1e-5);  // GPT-2 c_attn
}

TEST(FusedGradCuda, LinearBackwardBiasBF16) {
  SKIP_WITHOUT_CUDA();
  check_linear_backward(DType::bf16, 64, 48, 40, 2e-2, 2e-2);
  check_linear_backward(DType::bf16, 1024, 768, 3072, 2e-2, 2e-2);  // GPT-2 c_fc
}

TEST(FusedGradCuda, LinearBackwardBiasF64) {  // cuBLASLt has no BGRAD for f64 here: the fallback
  SKIP_WITHOUT_CUDA();
  check_linear_backward(DType::f64, 33, 17, 9, 1e-12, 1e-12);
}

// 150 tensors of mixed sizes (empty, 1, ..., GPT-2 sized) and dtypes, non-contiguous included.
std::vector<Tensor> mixed_tensors() {
  manual_seed(12);
  const DType dts[] = {DType::f32, DType::bf16, DType::f16, DType::f64};
  const int64_t sizes[] = {0, 1, 7, 768, 3072, 1000, 65537, 768 * 2304, 50257 * 64, 12345};
  std::vector<Tensor> ts;
  for (int i = 0; i < 150; ++i) {
    const int64_t n = sizes[i % 10];
    Tensor t = rnd({n}, dts[i % 4]);
    if (i % 17 == 5 && n > 1) t = transpose(reshape(rnd({2, n}, dts[i % 4]), {n, 2}), 0, 1);  // strided
    ts.push_back(t);
  }
  return ts;
}

TEST(FusedGradCuda, SumSquaresMatchesCpuAndIsDeterministic) {
  SKIP_WITHOUT_CUDA();
  const std::vector<Tensor> cpu = mixed_tensors();
  std::vector<Tensor> gpu;
  for (const Tensor& t : cpu) gpu.push_back(to_device(t, kGPU));
  const Tensor want = sum_squares(cpu);
  ASSERT_EQ(want.dtype(), DType::f64);
  const Tensor got = sum_squares(gpu);
  ASSERT_EQ(got.dtype(), DType::f32);
  ASSERT_EQ(got.dim(), 0);
  // fp32 partials over blocks of >= 16K elements: relative error ~1e-6 of a sum of positives.
  expect_close(got, want, 0, 1e-5, "sum_squares");
  const float first = float(vals(got)[0]);
  for (int rep = 0; rep < 5; ++rep) {
    const float again = float(vals(sum_squares(gpu))[0]);
    EXPECT_EQ(std::memcmp(&first, &again, sizeof first), 0) << "run " << rep << ": " << first << " vs " << again;
  }
}

TEST(FusedGradCuda, SumSquaresEmptyAndSingle) {
  SKIP_WITHOUT_CUDA();
  EXPECT_EQ(vals(sum_squares({to_device(zeros({0}), kGPU)}))[0], 0.0);
  EXPECT_EQ(vals(sum_squares({to_device(full({3}, 2.0), kGPU)}))[0], 12.0);
}

TEST(FusedGradCuda, ClipGradNormMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(13);
  std::vector<Tensor> pc, pd;
  for (int64_t n : {768, 3072, 65537}) {
    Tensor p = randn({n}).set_requires_grad(true);
    sum(mul(p, p)).backward();
    pc.push_back(p);
    Tensor q = to_device(p.detach(), kGPU).set_requires_grad(true);
    sum(mul(q, q)).backward();
    pd.push_back(q);
  }
  const double nc = optim::clip_grad_norm(pc, 1.0), nd = optim::clip_grad_norm(pd, 1.0);
  EXPECT_NEAR(nd, nc, 1e-5 * nc);
  for (size_t i = 0; i < pc.size(); ++i) expect_close(pd[i].grad(), pc[i].grad(), 1e-6, 1e-5, "clipped grad");
}

}  // namespace
}  // namespace blu
