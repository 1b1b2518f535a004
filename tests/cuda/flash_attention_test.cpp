// Fused CUDA attention (backend/cuda/flash_attention*.cu) against the composite reference on the
// CPU in f64: forward output and the gradients of q, k, v, on fresh random data, for head dims
// 64/128, causal and not, T in {1, 17, 64, 200, 1024}, f32/bf16/f16, in the contiguous [B, H, T, D]
// layout and in GPT's layout (q, k, v as strided views of one [B, T, 3C] buffer). bf16/f16 run
// the tensor-core kernels; f32 runs the TF32 tensor-core kernels under matmul precision "ieee"
// (3xTF32) and "tf32" (1xTF32); the FlashAttentionF32 tests also check the saved logsumexp and
// bound the errors both in norm and elementwise.
// On Hopper the bf16/f16 forward and backward are the wgmma kernels (flash_attention_wgmma.cu,
// flash_attention_wgmma_backward.cu): the sweeps above run them by default, the "MmaSync" sweeps
// run the mma.sync kernels, the FlashAttentionWgmma tests compare the two forwards' out and lse
// with each other and with the f64 reference, and the FlashAttentionWgmmaBackward tests the two
// backwards' dq, dk, dv likewise, on fresh data for T in {1, 17, 64, 100, 128, 1000, 1024} and a
// strided layout; the ...HeadGroups ones rerun the sweeps with the CTAs dealt out in groups of 4
// heads (a partial last group). The timings are in
// flash_attention_perf_test.cpp; the scope guards in flash_attention_scopes.h, the tolerances and
// comparisons in flash_attention_checks.h; grouped-query attention in flash_attention_gqa_test.cpp.
//
// Run on the GPU machine: ./build-cuda/tests/test_cuda --gtest_filter='FlashAttention*'
// (or ctest -L cuda -R FlashAttention).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/ops/precision.h"
#include "cuda/cuda_test_util.h"
#include "cuda/flash_attention_checks.h"
#include "cuda/flash_attention_scopes.h"

namespace blu::test {
namespace {

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
  SCOPED_TRACE(c.str());
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

void run_sweep(DType dtype) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  F32PathScope ieee(F32Path::ieee_3xtf32);
  uint64_t seed = 100;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (int64_t T : {1, 17, 64, 200, 1024}) {
        const int64_t B = T >= 1024 ? 1 : 2, H = T >= 1024 ? 2 : 3;
        run_case({B, H, T, D, causal, dtype, Layout::contiguous}, seed++);
        if (T == 200 || T == 64) run_case({B, H, T, D, causal, dtype, Layout::gpt}, seed++);
      }
}

TEST(FlashAttention, F32) { run_sweep(DType::f32); }  // TF32 kernels, 3xTF32 ("ieee")
// The default path: on Hopper the wgmma forward and backward, elsewhere the mma.sync ones.
TEST(FlashAttention, Bf16TensorCores) { run_sweep(DType::bf16); }
TEST(FlashAttention, F16TensorCores) { run_sweep(DType::f16); }
TEST(FlashAttention, Bf16TensorCoresMmaSync) {
  WgmmaScope mma(false);
  run_sweep(DType::bf16);
}
TEST(FlashAttention, F16TensorCoresMmaSync) {
  WgmmaScope mma(false);
  run_sweep(DType::f16);
}

// --- f32 paths: out, lse and the three gradients, bounded in norm and elementwise -------------
// (F32Tol, check_norm and their bounds: flash_attention_checks.h)

// logsumexp over the visible keys of each row of scale·q·kᵀ, in f64; q, k [B, H, T, D] on the CPU.
Tensor reference_lse(const Tensor& q, const Tensor& k, bool causal, double scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const std::vector<double> qv = to_vector(q), kv = to_vector(k);
  std::vector<double> out(static_cast<size_t>(B * H * T)), s(static_cast<size_t>(T));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < T; ++i) {
      const double* qi = qv.data() + (bh * T + i) * D;
      const int64_t n = causal ? i + 1 : T;
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const double* kj = kv.data() + (bh * T + j) * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
        s[size_t(j)] = dot * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += std::exp(s[size_t(j)] - mx);
      out[size_t(bh * T + i)] = mx + std::log(sum);
    }
  return from_vector(out, {B, H, T}, DType::f64);
}

// One f32 case on the path of `path`: out and dq, dk, dv through the op and autograd, the lse
// through a direct call of the forward launcher on the same (possibly strided) q, k, v.
void run_f32_case(const Case& c, uint64_t seed, F32Path path, ErrStats& stats) {
  SCOPED_TRACE(c.str());
  Generator gen(seed);
  const Shape shape{c.B, c.H, c.T, c.D};
  std::vector<Tensor> vals;  // f32 values, CPU
  for (int i = 0; i < 3; ++i) vals.push_back(randn(shape, DType::f32, kCPU, &gen));
  Tensor dout = randn(shape, DType::f32, kCPU, &gen);
  const double scale = 1.0 / std::sqrt(double(c.D));

  std::vector<Tensor> ref_in;
  for (const Tensor& t : vals) ref_in.push_back(to_dtype(t, DType::f64).set_requires_grad(true));
  Tensor ref_out = scaled_dot_product_attention(ref_in[0], ref_in[1], ref_in[2], c.causal);
  ref_out.backward(to_dtype(dout, DType::f64));
  const Tensor ref_lse = reference_lse(ref_in[0].detach(), ref_in[1].detach(), c.causal, scale);

  std::vector<Tensor> in = make_qkv(vals, c.layout, kGPU);
  for (Tensor& t : in) {
    t = t.detach();
    t.set_requires_grad(true);
  }
  Tensor out = scaled_dot_product_attention(in[0], in[1], in[2], c.causal);
  ASSERT_TRUE(out.device().is_cuda());
  out.backward(to_device(dout, kGPU));

  // The launcher itself, for the lse (the op keeps it as a saved output).
  Tensor o_bthd = empty({c.B, c.T, c.H, c.D}, DType::f32, kGPU);
  Tensor lse = empty({c.B, c.H, c.T}, DType::f32, kGPU);
  cuda::FlashFwdParams p;
  p.q = cuda::operand_bhtd(in[0]);
  p.k = cuda::operand_bhtd(in[1]);
  p.v = cuda::operand_bhtd(in[2]);
  p.o = cuda::operand_bthd(o_bthd);
  p.lse = static_cast<float*>(lse.raw_data());
  p.B = int(c.B), p.H = int(c.H), p.T = int(c.T), p.D = int(c.D);
  p.scale = float(scale);
  p.causal = c.causal;
  cuda::flash_attention_forward(p, DType::f32, cuda::current_stream());
  BLU_CUDA_CHECK(cudaDeviceSynchronize());

  const F32Tol tol = f32_tolerance(path);
  EXPECT_EQ(check_norm("out", out.detach(), ref_out.detach(), tol, stats), "");
  EXPECT_EQ(check_norm("out(launcher)", transpose(o_bthd, 1, 2), ref_out.detach(), tol, stats), "");
  EXPECT_EQ(check_norm("lse", lse, ref_lse, tol, stats), "");
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(in[size_t(i)].grad().defined()) << "no gradient for " << names[i];
    EXPECT_EQ(check_norm(names[i], in[size_t(i)].grad(), ref_in[size_t(i)].grad(), tol, stats), "");
  }
}

// D 64/128 x causal or not x T (ragged tails: 1, 17, 100, 200; whole tiles: 64, 1024), contiguous,
// and GPT's strided layout for T 17, 100, 200.
ErrStats run_f32_sweep(F32Path path) {
  ErrStats stats;
  if (cuda::device_count() == 0) {
    ADD_FAILURE() << "no CUDA device";
    return stats;
  }
  F32PathScope scope(path);
  uint64_t seed = 1000;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (int64_t T : {1, 17, 64, 100, 200, 1024}) {
        const int64_t B = T >= 1024 ? 1 : 2, H = T >= 1024 ? 2 : 3;
        run_f32_case({B, H, T, D, causal, DType::f32, Layout::contiguous}, seed++, path, stats);
        if (T == 17 || T == 100 || T == 200)
          run_f32_case({B, H, T, D, causal, DType::f32, Layout::gpt}, seed++, path, stats);
      }
  std::printf("worst norm-relative errors:%s\n", stats.str().c_str());
  return stats;
}

// The test's own yardsticks, on the CPU: exp(scale·q·kᵀ − lse) is the composite path's softmax
// (so reference_lse is the logsumexp the kernels must save), and check_norm passes an exact
// match but flags one wrong element that the norm alone would let through.
TEST(FlashAttentionF32, ReferenceAndCheckerSelfTest) {
  Generator gen(3);
  const int64_t B = 2, H = 2, T = 37, D = 64;
  const double scale = 0.125;
  const Tensor q = randn({B, H, T, D}, DType::f64, kCPU, &gen), k = randn({B, H, T, D}, DType::f64, kCPU, &gen);
  for (bool causal : {true, false}) {
    Tensor scores = mul(matmul(q, transpose(k, -2, -1)), scale);
    const Tensor pos = arange(0, double(T), 1, DType::i64, kCPU);
    const Tensor above_diagonal = gt(pos, reshape(pos, {T, 1}));  // key j > query i
    Tensor probs = softmax(causal ? masked_fill(scores, above_diagonal, -INFINITY) : scores, -1);
    const Tensor lse = reshape(reference_lse(q, k, causal, scale), {B, H, T, 1});
    Tensor mine = exp(sub(scores, lse));
    if (causal) mine = mul(mine, to_dtype(gt(probs, 0.0), DType::f64));  // exp(−inf) is 0 in both
    EXPECT_EQ(check_close(causal ? "softmax via lse (causal)" : "softmax via lse", mine, probs, 1e-12, 1e-12), "");
  }
  ErrStats stats;
  const F32Tol tol{1e-5, 1e-4};
  const Tensor want = randn({4, 1000}, DType::f64, kCPU, &gen);
  EXPECT_EQ(check_norm("same", want, want, tol, stats), "");
  std::vector<double> v = to_vector(want);
  v[1234] += 0.01;  // ~1.6e-4 norm-relative in a tensor of norm ~63: over the norm bound
  EXPECT_NE(check_norm("one off", from_vector(v, {4, 1000}, DType::f64), want, tol, stats), "");
  v[1234] -= 0.01 - 1e-3;  // 1e-3 on one element: inside a norm bound of 1e-3, not elementwise
  const F32Tol loose_norm{1e-3, 1e-4};
  EXPECT_NE(check_norm("one off", from_vector(v, {4, 1000}, DType::f64), want, loose_norm, stats), "");
  EXPECT_EQ(check_norm("zero ref", zeros({10}, DType::f64), zeros({10}, DType::f64), tol, stats), "");
}

TEST(FlashAttentionF32, Ieee3xTf32) { run_f32_sweep(F32Path::ieee_3xtf32); }
TEST(FlashAttentionF32, Tf32) {
  const ErrStats stats = run_f32_sweep(F32Path::tf32_1x);
  // The precision setting reaches the kernels: 1xTF32 is measurably less exact than 3xTF32
  // (which stays near 1e-6), so this fails if "tf32" were silently run as 3xTF32.
  EXPECT_GT(stats.get("out"), 2e-5) << "matmul precision \"tf32\" did not select 1xTF32";
}

// TF32 backward: dK and dV bitwise reproducible, dQ (fp32 atomics) equal up to summation order.
TEST(FlashAttentionF32, RepeatedBackward) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  for (F32Path path : {F32Path::ieee_3xtf32, F32Path::tf32_1x}) {
    F32PathScope scope(path);
    SCOPED_TRACE(path == F32Path::tf32_1x ? "1xTF32" : "3xTF32");
    Generator gen(17);
    const Shape shape{2, 3, 300, 64};
    std::vector<Tensor> vals;
    for (int i = 0; i < 3; ++i) vals.push_back(to_device(randn(shape, DType::f32, kCPU, &gen), kGPU));
    Tensor dout = to_device(randn(shape, DType::f32, kCPU, &gen), kGPU);
    std::vector<std::vector<Tensor>> grads;
    for (int run = 0; run < 2; ++run) {
      std::vector<Tensor> in;
      for (const Tensor& t : vals) in.push_back(t.detach().set_requires_grad(true));
      scaled_dot_product_attention(in[0], in[1], in[2], true).backward(dout);
      grads.push_back({in[0].grad(), in[1].grad(), in[2].grad()});
    }
    const double dq_tol = 1e-5;
    EXPECT_EQ(check_close("dq run 2 vs 1", grads[1][0], grads[0][0], dq_tol, dq_tol), "");
    EXPECT_EQ(check_close("dk run 2 vs 1", grads[1][1], grads[0][1], 0, 0), "") << "dK must be deterministic";
    EXPECT_EQ(check_close("dv run 2 vs 1", grads[1][2], grads[0][2], 0, 0), "") << "dV must be deterministic";
  }
}

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

// --- the Hopper wgmma forward -----------------------------------------------------------------
//
// out and lse of the forward launcher on q, k, v (any layout), with the wgmma kernel on or off.
// The outputs start as NaN, so a row the kernel fails to write shows up.
std::pair<Tensor, Tensor> launch_forward(const std::vector<Tensor>& in, const Case& c, double scale, bool wgmma) {
  WgmmaScope scope(wgmma, true);
  Tensor o_bthd = full({c.B, c.T, c.H, c.D}, NAN, c.dtype, kGPU);
  Tensor lse = full({c.B, c.H, c.T}, NAN, DType::f32, kGPU);
  cuda::FlashFwdParams p;
  p.q = cuda::operand_bhtd(in[0]);
  p.k = cuda::operand_bhtd(in[1]);
  p.v = cuda::operand_bhtd(in[2]);
  p.o = cuda::operand_bthd(o_bthd);
  p.lse = static_cast<float*>(lse.raw_data());
  p.B = int(c.B), p.H = int(c.H), p.T = int(c.T), p.D = int(c.D);
  p.scale = float(scale);
  p.causal = c.causal;
  cuda::flash_attention_forward(p, c.dtype, cuda::current_stream());
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  return {transpose(o_bthd, 1, 2), lse};
}

// out against the f64 reference (tolerance(dtype)) and against the mma.sync forward (the same
// tolerance: each is within it of the reference); lse against both with 1e-3 + 1e-3·|want| — the
// lse involves no 16-bit rounding, only fp32 sums of exact products and ex2.approx (~1e-6 seen).
void run_wgmma_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str());
  Generator gen(seed);
  const Shape shape{c.B, c.H, c.T, c.D};
  const double scale = 1.0 / std::sqrt(double(c.D));
  std::vector<Tensor> vals;  // dtype-rounded values, CPU
  for (int i = 0; i < 3; ++i) vals.push_back(to_dtype(randn(shape, DType::f64, kCPU, &gen), c.dtype));
  std::vector<Tensor> ref;
  for (const Tensor& t : vals) ref.push_back(to_dtype(t, DType::f64));
  const Tensor ref_out = scaled_dot_product_attention(ref[0], ref[1], ref[2], c.causal);
  const Tensor ref_lse = reference_lse(ref[0], ref[1], c.causal, scale);

  const std::vector<Tensor> in = make_qkv(vals, c.layout, kGPU);
  const auto [out, lse] = launch_forward(in, c, scale, true);
  const auto [mma_out, mma_lse] = launch_forward(in, c, scale, false);

  const Tol tol = tolerance(c.dtype);
  const double lse_tol = 1e-3;
  EXPECT_EQ(check_close("out (wgmma) vs reference", out, ref_out, tol.fwd_atol, tol.fwd_rtol), "");
  EXPECT_EQ(check_close("out (wgmma) vs mma.sync", out, mma_out, tol.fwd_atol, tol.fwd_rtol), "");
  EXPECT_EQ(check_close("out (mma.sync) vs reference", mma_out, ref_out, tol.fwd_atol, tol.fwd_rtol), "");
  EXPECT_EQ(check_close("lse (wgmma) vs reference", lse, ref_lse, lse_tol, lse_tol), "");
  EXPECT_EQ(check_close("lse (wgmma) vs mma.sync", lse, mma_lse, lse_tol, lse_tol), "");
}

// Whether this test can run the wgmma kernel; a compute-capability-9.0 device with a build that
// lacks it (CMAKE_CUDA_ARCHITECTURES without "90a") fails, other devices skip.
bool wgmma_testable() {
  if (cuda::device_count() == 0) {
    ADD_FAILURE() << "no CUDA device";
    return false;
  }
  if (cuda::flash_attention_wgmma_available()) return true;
  cudaDeviceProp prop{};
  BLU_CUDA_CHECK(cudaGetDeviceProperties(&prop, cuda::current_device()));
  if (prop.major == 9 && prop.minor == 0) ADD_FAILURE() << "compute capability 9.0 but the build has no sm_90a code";
  return false;
}

void run_wgmma_sweep(DType dtype) {
  uint64_t seed = 5000;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (int64_t T : {1, 17, 64, 100, 128, 1000, 1024}) {
        const int64_t B = T >= 1000 ? 1 : 2, H = T >= 1000 ? 2 : 3;
        run_wgmma_case({B, H, T, D, causal, dtype, Layout::contiguous}, seed++);
        if (T == 17 || T == 100 || T == 1000) run_wgmma_case({B, H, T, D, causal, dtype, Layout::gpt}, seed++);
      }
}

TEST(FlashAttentionWgmma, Bf16) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  run_wgmma_sweep(DType::bf16);
}
TEST(FlashAttentionWgmma, F16) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  run_wgmma_sweep(DType::f16);
}

// The GQA backward's head group (Note [GQA head groups]): at llama-250m's shape (B8 Hkv4, 8 key
// tiles, 16 query tiles, G 4) groups of 12 key/value heads end late and all 32 at once do not; at
// B8 Hkv8 the plain order again; past 8 waves, and without causal (equal CTAs), the preferred
// group stands; 0 stays the plain order; a preferred group larger than the heads is all of them.
TEST(FlashAttentionHost, GqaBackwardHeadGroup) {
  EXPECT_EQ(cuda::gqa_backward_head_group(32, 8, 16, 4, true, 132, 12), 32);
  EXPECT_EQ(cuda::gqa_backward_head_group(64, 8, 16, 4, true, 132, 12), 64);
  EXPECT_EQ(cuda::gqa_backward_head_group(32, 8, 16, 4, true, 132, 0), 0);
  EXPECT_EQ(cuda::gqa_backward_head_group(32, 8, 16, 4, false, 132, 12), 12);
  EXPECT_EQ(cuda::gqa_backward_head_group(512, 8, 16, 4, true, 132, 12), 12);
  EXPECT_EQ(cuda::gqa_backward_head_group(32, 8, 16, 4, true, 132, 40), 32);
  for (int kv : {3, 8, 24, 48, 96})
    for (int pref : {1, 4, 12}) {
      const int g = cuda::gqa_backward_head_group(kv, 8, 16, 4, true, 132, pref);
      EXPECT_TRUE(g >= std::min(pref, kv) && g <= kv) << kv << " " << pref << " → " << g;  // at most every head
      EXPECT_EQ(cuda::gqa_backward_head_group(kv, 8, 16, 4, true, 132, pref), g) << "the same answer again";
    }
}

// The CTA order (Note [head groups]), host-side: every (head, rank) cell exactly once; group g's
// CTAs cover heads gG.. only, in non-decreasing rank, after every CTA of group g-1; G ≤ 0 or ≥ B·H
// is the plain order (head = blockIdx.x, rank = blockIdx.y).
TEST(FlashAttentionHost, TileSlotOrder) {
  for (int bh = 1; bh <= 40; ++bh)
    for (int ranks = 1; ranks <= 9; ++ranks)
      for (int g : {-1, 0, 1, 2, 3, 4, 5, 7, 16, bh, bh + 3}) {
        SCOPED_TRACE("bh " + std::to_string(bh) + " ranks " + std::to_string(ranks) + " group " + std::to_string(g));
        const int G = g <= 0 || g > bh ? bh : g;
        std::vector<int> seen(size_t(bh * ranks), 0);
        int last_group = 0, last_rank = 0;
        for (int lin = 0; lin < bh * ranks; ++lin) {
          const cuda::TileSlot s = cuda::tile_slot_of(lin, bh, ranks, g);
          ASSERT_TRUE(s.bh >= 0 && s.bh < bh && s.rank >= 0 && s.rank < ranks) << "lin " << lin;
          ++seen[size_t(s.bh * ranks + s.rank)];
          const int group = s.bh / G;
          ASSERT_GE(group, last_group) << "lin " << lin;
          if (group == last_group) {
            ASSERT_GE(s.rank, last_rank) << "lin " << lin;
          }
          last_group = group;
          last_rank = s.rank;
          if (G == bh) {
            ASSERT_TRUE(s.bh == lin % bh && s.rank == lin / bh) << "lin " << lin;
          }
        }
        ASSERT_EQ(std::count(seen.begin(), seen.end(), 1), bh * ranks);
      }
}

// Head groups of 4 over the sweep's 6 (batch, head) pairs: a full group and a partial one, so every
// pair must still be visited exactly once (the sweeps above run one group, B·H ≤ 6 < the default).
TEST(FlashAttentionWgmma, Bf16HeadGroups) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  HeadGroupScope g(4, 4);
  run_wgmma_sweep(DType::bf16);
}

// --- the Hopper wgmma backward ----------------------------------------------------------------
//
// dq, dk, dv ([B, H, T, D] views of [B, T, H, D] buffers, as the op returns them) of the backward
// launcher (dsum precompute, main kernel, dq cast) with the wgmma main kernel on or off. The
// outputs and scratch start as NaN, so a row the kernels fail to write or clear shows up.
std::vector<Tensor> launch_backward(const std::vector<Tensor>& in, const Tensor& dout, const Tensor& o,
                                    const Tensor& lse, const Case& c, double scale, bool wgmma) {
  WgmmaScope scope(true, wgmma);
  std::vector<Tensor> grads;
  for (int i = 0; i < 3; ++i) grads.push_back(full({c.B, c.T, c.H, c.D}, NAN, c.dtype, kGPU));
  Tensor dsum = full({c.B, c.H, c.T}, NAN, DType::f32, kGPU);
  // The launcher zeroes it; T rounded up to 64 rows for the wgmma backward's tiles.
  Tensor dq_accum = full({cuda::flash_dq_accum_floats(c.B, c.H, c.T, c.D)}, NAN, DType::f32, kGPU);
  cuda::FlashBwdParams p;
  p.dout = cuda::operand_bhtd(dout);
  p.q = cuda::operand_bhtd(in[0]);
  p.k = cuda::operand_bhtd(in[1]);
  p.v = cuda::operand_bhtd(in[2]);
  p.o = cuda::operand_bhtd(o);
  p.lse = static_cast<const float*>(lse.raw_data());
  p.dsum = static_cast<float*>(dsum.raw_data());
  p.dq_accum = static_cast<float*>(dq_accum.raw_data());
  p.dq = cuda::operand_bthd(grads[0]);
  p.dk = cuda::operand_bthd(grads[1]);
  p.dv = cuda::operand_bthd(grads[2]);
  p.B = int(c.B), p.H = int(c.H), p.T = int(c.T), p.D = int(c.D);
  p.scale = float(scale);
  p.causal = c.causal;
  cuda::flash_attention_backward(p, c.dtype, cuda::current_stream());
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  for (Tensor& g : grads) g = transpose(g, 1, 2);
  return grads;
}

// dq, dk, dv of the wgmma backward against the f64 reference and against the mma.sync backward,
// both run on the same forward outputs (the mma.sync forward's o and lse); the mma.sync backward
// against the reference too, so a failure says which kernel is off. Tolerance: tolerance(dtype)'s
// backward bounds for each (each kernel is within them of the reference). In the strided case
// q, k, v are GPT's views of one [B, T, 3C] buffer and dO a [B, H, T, D] view of a [B, T, H, D]
// buffer.
void run_wgmma_bwd_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str());
  Generator gen(seed);
  const Shape shape{c.B, c.H, c.T, c.D};
  const double scale = 1.0 / std::sqrt(double(c.D));
  std::vector<Tensor> vals;  // dtype-rounded values, CPU
  for (int i = 0; i < 3; ++i) vals.push_back(to_dtype(randn(shape, DType::f64, kCPU, &gen), c.dtype));
  const Tensor dout = to_dtype(randn(shape, DType::f64, kCPU, &gen), c.dtype);

  std::vector<Tensor> ref;
  for (const Tensor& t : vals) ref.push_back(to_dtype(t, DType::f64).set_requires_grad(true));
  scaled_dot_product_attention(ref[0], ref[1], ref[2], c.causal).backward(to_dtype(dout, DType::f64));

  const std::vector<Tensor> in = make_qkv(vals, c.layout, kGPU);
  const Tensor dout_dev = c.layout == Layout::gpt ? transpose(to_device(contiguous(transpose(dout, 1, 2)), kGPU), 1, 2)
                                                  : to_device(dout, kGPU);
  const auto [o, lse] = launch_forward(in, c, scale, false);
  const std::vector<Tensor> wg = launch_backward(in, dout_dev, o, lse, c, scale, true);
  const std::vector<Tensor> mma = launch_backward(in, dout_dev, o, lse, c, scale, false);

  const Tol tol = tolerance(c.dtype);
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < 3; ++i) {
    const std::string n = names[i];
    EXPECT_EQ(check_close(n + " (wgmma) vs reference", wg[i], ref[i].grad(), tol.bwd_atol, tol.bwd_rtol), "");
    EXPECT_EQ(check_close(n + " (wgmma) vs mma.sync", wg[i], mma[i], tol.bwd_atol, tol.bwd_rtol), "");
    EXPECT_EQ(check_close(n + " (mma.sync) vs reference", mma[i], ref[i].grad(), tol.bwd_atol, tol.bwd_rtol), "");
  }
}

void run_wgmma_bwd_sweep(DType dtype) {
  uint64_t seed = 7000;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (int64_t T : {1, 17, 64, 100, 128, 1000, 1024}) {
        const int64_t B = T >= 1000 ? 1 : 2, H = T >= 1000 ? 2 : 3;
        run_wgmma_bwd_case({B, H, T, D, causal, dtype, Layout::contiguous}, seed++);
        if (T == 17 || T == 100 || T == 1000) run_wgmma_bwd_case({B, H, T, D, causal, dtype, Layout::gpt}, seed++);
      }
}

TEST(FlashAttentionWgmmaBackward, Bf16) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  run_wgmma_bwd_sweep(DType::bf16);
}
TEST(FlashAttentionWgmmaBackward, F16) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  run_wgmma_bwd_sweep(DType::f16);
}

TEST(FlashAttentionWgmmaBackward, Bf16HeadGroups) {
  if (!wgmma_testable()) GTEST_SKIP() << "no sm_90a device";
  HeadGroupScope g(4, 4);
  run_wgmma_bwd_sweep(DType::bf16);
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

}  // namespace
}  // namespace blu::test
