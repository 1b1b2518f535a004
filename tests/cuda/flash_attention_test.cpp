// Fused CUDA attention (backend/cuda/flash_attention*.cu) against the composite reference on the
// CPU in f64: forward output and the gradients of q, k, v, on fresh random data, for head dims
// 64/128, causal and not, T in {1, 17, 64, 200, 1024}, f32/bf16/f16, in the contiguous [B, H, T, D]
// layout and in GPT's layout (q, k, v as strided views of one [B, T, 3C] buffer). bf16/f16 run
// both the tensor-core kernels and the SIMT kernels (forced), so a failure says which one is off.
// "Perf" tests time GPT-2's shape (B16 H12 T1024 D64, causal; bf16 and f32) forward and
// forward+backward.
//
// Run on the GPU machine: ./build-cuda/tests/test_cuda --gtest_filter='FlashAttention*'
// (or ctest -L cuda -R FlashAttention); Perf: --gtest_filter='*FlashAttentionPerf*'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"

namespace blu::test {
namespace {

const Device kGPU("cuda:0");

// Tolerances: inputs are rounded to the tested dtype first and the f64 reference is computed
// from those rounded values, so only the kernel's own arithmetic is measured. Errors are checked
// elementwise as |got − want| <= atol + rtol·|want|.
//  f32:  fp32 accumulation over <= 1024 terms of O(1) values and __expf (a few ulp): ~1e-6
//        relative in practice; 1e-4 leaves room for long rows.
//  bf16: 8 significant bits (unit roundoff 2^-9 ≈ 2e-3). The kernels round P (forward) and P, dS
//        (backward) to bf16 before the tensor-core products, and the outputs once; the forward
//        output (O(1): a convex mix of N(0,1) rows) gets ~2 roundings → 1e-2 + 1e-2·|want|.
//        Gradients sum up to T rounded products and Dsum uses the rounded O: 4e-2 + 4e-2·|want|.
//  f16:  11 significant bits (2^-12 ≈ 2.4e-4): 8x tighter than bf16 (values stay far from the
//        f16 range limits at these magnitudes).
struct Tol {
  double fwd_atol, fwd_rtol, bwd_atol, bwd_rtol;
};
Tol tolerance(DType dt) {
  switch (dt) {
    case DType::f32: return {1e-4, 1e-4, 2e-4, 2e-4};
    case DType::bf16: return {1e-2, 1e-2, 4e-2, 4e-2};
    case DType::f16: return {2e-3, 2e-3, 5e-3, 5e-3};
    default: return {0, 0, 0, 0};
  }
}

// Compares [B, H, T, D] tensors; "" when within tolerance, else the worst element with its
// (b, h, t, d) and the error statistics.
std::string check_close(const std::string& what, const Tensor& got, const Tensor& want, double atol, double rtol) {
  if (got.shape() != want.shape()) {
    std::ostringstream os;
    os << what << ": shape " << got.str() << " vs " << want.str();
    return os.str();
  }
  const std::vector<double> a = to_vector(got), b = to_vector(want);
  double worst = 0, max_err = 0, sum_sq = 0, max_want = 0;
  int64_t at = -1, bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::abs(a[i] - b[i]);
    const double tol = atol + rtol * std::abs(b[i]);
    max_want = std::max(max_want, std::abs(b[i]));
    if (!std::isnan(err)) {
      max_err = std::max(max_err, err);
      sum_sq += err * err;
    }
    if (!(err <= tol)) {
      ++bad;
      const double ratio = std::isnan(err) ? INFINITY : err / tol;
      if (at < 0 || ratio > worst) {
        worst = ratio;
        at = int64_t(i);
      }
    }
  }
  if (at < 0) return "";
  const Shape& s = want.shape();
  int64_t r = at;
  std::vector<int64_t> idx(s.size());
  for (int64_t d = int64_t(s.size()) - 1; d >= 0; --d) {
    idx[size_t(d)] = r % s[size_t(d)];
    r /= s[size_t(d)];
  }
  std::ostringstream os;
  os.precision(6);
  os << what << ": " << bad << " of " << a.size() << " elements off; worst at [";
  for (size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
  os << "]: got " << a[size_t(at)]
     << " want " << b[size_t(at)] << " (" << worst << "x tolerance); max |err| " << max_err << ", rms err "
     << std::sqrt(sum_sq / double(std::max<size_t>(a.size(), 1))) << ", max |want| " << max_want;
  return os.str();
}

enum class Layout { contiguous, gpt };

// q, k, v of shape [B, H, T, D] holding `vals` (dtype dt, on `device`) in the given layout.
std::vector<Tensor> make_qkv(const std::vector<Tensor>& vals, Layout layout, Device device) {
  if (layout == Layout::contiguous) {
    std::vector<Tensor> out;
    for (const Tensor& t : vals) out.push_back(to_device(t, device));
    return out;
  }
  // GPT: one [B, T, 3, H, D] buffer (as c_attn's [B, T, 3C] output split and viewed as heads);
  // q, k, v are [B, H, T, D] views with strides (T·3C, D, 3C, 1).
  const int64_t B = vals[0].size(0), H = vals[0].size(1), T = vals[0].size(2), D = vals[0].size(3);
  Tensor packed = contiguous(stack({transpose(vals[0], 1, 2), transpose(vals[1], 1, 2), transpose(vals[2], 1, 2)}, 2));
  Tensor dev = to_device(packed, device);  // [B, T, 3, H, D]
  std::vector<Tensor> out;
  for (int64_t i = 0; i < 3; ++i) out.push_back(transpose(select(dev, 2, i), 1, 2));
  (void)B, (void)H, (void)T, (void)D;
  return out;
}

struct Case {
  int64_t B, H, T, D;
  bool causal;
  DType dtype;
  Layout layout;
  std::string str() const {
    std::ostringstream os;
    os << "B" << B << " H" << H << " T" << T << " D" << D << (causal ? " causal " : " full ") << dtype
       << (layout == Layout::gpt ? " gpt-layout" : " contiguous");
    return os.str();
  }
};

// Runs one case on the GPU (forward and backward) and compares with the CPU f64 reference.
void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str() + (cuda::flash_attention_force_simt() ? " [SIMT]" : ""));
  Generator gen(seed);
  const Shape shape{c.B, c.H, c.T, c.D};
  std::vector<Tensor> vals;  // dtype-rounded values, CPU
  for (int i = 0; i < 3; ++i) vals.push_back(to_dtype(randn(shape, DType::f64, kCPU, &gen), c.dtype));
  Tensor dout = to_dtype(randn(shape, DType::f64, kCPU, &gen), c.dtype);

  // Reference: composite path on the CPU in f64 from the same rounded values.
  std::vector<Tensor> ref_in;
  for (const Tensor& t : vals) ref_in.push_back(to_dtype(t, DType::f64).set_requires_grad(true));
  Tensor ref_out = scaled_dot_product_attention(ref_in[0], ref_in[1], ref_in[2], c.causal);
  ref_out.backward(to_dtype(dout, DType::f64));

  std::vector<Tensor> in = make_qkv(vals, c.layout, kGPU);
  for (Tensor& t : in) {
    t = t.detach();
    t.set_requires_grad(true);
  }
  Tensor out = scaled_dot_product_attention(in[0], in[1], in[2], c.causal);
  ASSERT_TRUE(out.device().is_cuda());
  ASSERT_EQ(out.shape(), shape);
  ASSERT_EQ(out.dtype(), c.dtype);
  out.backward(to_device(dout, kGPU));
  BLU_CUDA_CHECK(cudaDeviceSynchronize());

  const Tol tol = tolerance(c.dtype);
  EXPECT_EQ(check_close("out", out.detach(), ref_out.detach(), tol.fwd_atol, tol.fwd_rtol), "");
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(in[size_t(i)].grad().defined()) << "no gradient for " << names[i];
    EXPECT_EQ(check_close(names[i], in[size_t(i)].grad(), ref_in[size_t(i)].grad(), tol.bwd_atol, tol.bwd_rtol), "");
  }
}

struct ForceSimt {
  explicit ForceSimt(bool on) { cuda::set_flash_attention_force_simt(on); }
  ~ForceSimt() { cuda::set_flash_attention_force_simt(false); }
};

void run_sweep(DType dtype, bool simt) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  ForceSimt force(simt);
  uint64_t seed = 100;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (int64_t T : {1, 17, 64, 200, 1024}) {
        const int64_t B = T >= 1024 ? 1 : 2, H = T >= 1024 ? 2 : 3;
        run_case({B, H, T, D, causal, dtype, Layout::contiguous}, seed++);
        if (T == 200 || T == 64) run_case({B, H, T, D, causal, dtype, Layout::gpt}, seed++);
      }
}

TEST(FlashAttention, F32) { run_sweep(DType::f32, false); }
TEST(FlashAttention, Bf16TensorCores) { run_sweep(DType::bf16, false); }
TEST(FlashAttention, F16TensorCores) { run_sweep(DType::f16, false); }
TEST(FlashAttention, Bf16Simt) { run_sweep(DType::bf16, true); }
TEST(FlashAttention, F16Simt) { run_sweep(DType::f16, true); }
TEST(FlashAttention, F32Simt) { run_sweep(DType::f32, true); }

// The tensor-core backward sums dQ with fp32 atomics: runs may differ at rounding level, never
// more. dK and dV are deterministic.
TEST(FlashAttention, RepeatedBackwardAgrees) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  Generator gen(7);
  const Shape shape{2, 3, 300, 64};
  std::vector<Tensor> vals;
  for (int i = 0; i < 3; ++i) vals.push_back(to_device(randn(shape, DType::bf16, kCPU, &gen), kGPU));
  Tensor dout = to_device(randn(shape, DType::bf16, kCPU, &gen), kGPU);
  std::vector<std::vector<Tensor>> grads;
  for (int run = 0; run < 2; ++run) {
    std::vector<Tensor> in;
    for (const Tensor& t : vals) in.push_back(t.detach().set_requires_grad(true));
    scaled_dot_product_attention(in[0], in[1], in[2], true).backward(dout);
    grads.push_back({in[0].grad(), in[1].grad(), in[2].grad()});
  }
  EXPECT_EQ(check_close("dq run 2 vs 1", grads[1][0], grads[0][0], 1e-2, 1e-2), "");
  EXPECT_EQ(check_close("dk run 2 vs 1", grads[1][1], grads[0][1], 0, 0), "") << "dK must be deterministic";
  EXPECT_EQ(check_close("dv run 2 vs 1", grads[1][2], grads[0][2], 0, 0), "") << "dV must be deterministic";
}

// Shapes the fused kernels do not take still give the composite result on the GPU.
TEST(FlashAttention, FallbackShapes) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  Generator gen(9);
  struct S {
    Shape q, kv;
    const char* why;
  };
  for (const S& s : {S{{1, 2, 5, 64}, {1, 2, 9, 64}, "Tq != Tk"}, S{{1, 2, 16, 32}, {1, 2, 16, 32}, "D 32"}}) {
    SCOPED_TRACE(s.why);
    Tensor q = randn(s.q, DType::f32, kCPU, &gen), k = randn(s.kv, DType::f32, kCPU, &gen),
           v = randn(s.kv, DType::f32, kCPU, &gen);
    Tensor want = scaled_dot_product_attention(q, k, v, false);
    Tensor got = scaled_dot_product_attention(to_device(q, kGPU), to_device(k, kGPU), to_device(v, kGPU), false);
    EXPECT_EQ(check_close("out", got, want, 1e-4, 1e-4), "");
  }
}

// GPT-2 124M attention: B16 H12 T1024 D64, causal, in `dtype`. Prints ms and TFLOP/s (flops counted
// as FlashAttention does: forward 4·B·H·T²·D, halved for causal; backward 2.5x the forward).
void time_gpt2_causal(DType dtype) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  const int64_t B = 16, H = 12, T = 1024, D = 64;
  const Shape shape{B, H, T, D};
  Generator gen(11);
  std::vector<Tensor> qkv;
  for (int i = 0; i < 3; ++i) qkv.push_back(to_device(randn(shape, dtype, kCPU, &gen), kGPU));
  Tensor dout = to_device(randn(shape, dtype, kCPU, &gen), kGPU);
  cudaStream_t stream = cuda::current_stream();
  cuda::Event start(true), stop(true);
  const double fwd_flops = 4.0 * B * H * T * T * D / 2;
  const int warmup = 5, iters = 20;

  auto time_it = [&](auto&& body) {
    for (int i = 0; i < warmup; ++i) body();
    BLU_CUDA_CHECK(cudaStreamSynchronize(stream));
    start.record(stream);
    for (int i = 0; i < iters; ++i) body();
    stop.record(stream);
    stop.synchronize();
    return double(stop.elapsed_ms(start)) / iters;
  };

  const double fwd_ms = time_it([&] {
    NoGradGuard ng;
    (void)scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], true);
  });
  std::vector<Tensor> in;
  for (const Tensor& t : qkv) in.push_back(t.detach().set_requires_grad(true));
  const double fwdbwd_ms = time_it([&] {
    for (Tensor& t : in) t.zero_grad();
    scaled_dot_product_attention(in[0], in[1], in[2], true).backward(dout);
  });
  std::printf("flash attention %s B16 H12 T1024 D64 causal: fwd %.4f ms (%.1f TFLOP/s), fwd+bwd %.4f ms "
              "(%.1f TFLOP/s), bwd alone ~%.4f ms\n",
              std::string(dtype_name(dtype)).c_str(), fwd_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, fwdbwd_ms,
              3.5 * fwd_flops / (fwdbwd_ms * 1e-3) / 1e12, fwdbwd_ms - fwd_ms);
}

TEST(FlashAttentionPerf, Gpt2Bf16Causal) { time_gpt2_causal(DType::bf16); }
// fp32 (IEEE, CUDA cores): the register-blocked kernels of flash_attention_f32.cu.
TEST(FlashAttentionPerf, Gpt2F32Causal) { time_gpt2_causal(DType::f32); }

}  // namespace
}  // namespace blu::test
