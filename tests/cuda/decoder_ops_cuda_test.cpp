// GPU tests for the Llama family's kernels (backend/cuda/rms_norm.cu, rotary_swiglu.cu) beyond the
// op table's f32/f64 samples (ops_vs_cpu_test.cpp runs those): bf16/f16/f32 at widths that take
// every fast-path instantiation and the general kernels, each against the CPU reference through
// the public ops and autograd — forward, input gradients, the weight's fp32 gradient through a
// cast, run-to-run determinism — swiglu over the halves of one [N, 2I] GPU buffer with its
// gradients side by side (no cat), and the achieved bandwidth at Llama sizes.
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='CudaDecoderOps*'.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/ops/dispatch.h"
#include "blu/autograd/node.h"
#include "blu/ops/attention.h"
#include "blu/ops/join.h"
#include "blu/ops/nn.h"
#include "common/checks.h"
#include "common/opinfo.h"
#include "cuda/cuda_test_util.h"
#include "cuda/flash_attention_checks.h"
#include "cuda/flash_attention_scopes.h"

namespace blu::test {
namespace {

// Like test::host (which this one hides here), but of t.detach().
Tensor host(const Tensor& t) {
  Tensor h = to_device(t.detach(), kCPU);
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  return h;
}
// Values exactly representable in dt (drawn in f32, rounded once).
Tensor rnd16(const Shape& s, DType dt, double scale = 1.0) { return to_dtype(mul(randn(s), scale), dt); }
Tensor grad_leaf(const Tensor& t) { return t.detach().set_requires_grad(true); }

// Relative tolerance of one output rounding in dt (the GPU's fp32 sums may land on the other side
// of a rounding boundary than the CPU's double sums).
double ulp_tol(DType dt) {
  switch (dt) {
    case DType::bf16: return 1.0 / 128;
    case DType::f16: return 1.0 / 1024;
    case DType::f32: return 2e-5;
    default: return 1e-12;
  }
}

// --- rms_norm ---

struct RmsCase {
  DType dt;
  int64_t R, C;
  bool weight = true, misaligned = false;
};
std::string tag(const RmsCase& c) {
  return std::string(dtype_name(c.dt)) + " R=" + std::to_string(c.R) + " C=" + std::to_string(c.C) +
         (c.weight ? "" : " no weight") + (c.misaligned ? " misaligned" : "");
}

// Every fast-path shape (threads per row x vectors per thread: 32x2, 32x4, 32x8, 128x4, 128x8,
// 256x8 — rms_norm.cu's fast_shape) in bf16 and f32, f16 at two, and the general kernels: widths
// that are not whole vectors, rows past 2048 vectors, a misaligned x, f64. 5000 rows give several
// rows per group in the backward (at most 1024 blocks).
std::vector<RmsCase> rms_cases() {
  return {{DType::bf16, 5000, 64},    {DType::bf16, 1003, 768},  {DType::bf16, 5000, 2048, false},
          {DType::bf16, 777, 4096},   {DType::bf16, 300, 8192},  {DType::bf16, 200, 16384},
          {DType::bf16, 64, 100},     {DType::bf16, 33, 24576},  {DType::bf16, 257, 768, true, true},
          {DType::f32, 5000, 64},     {DType::f32, 1003, 512},   {DType::f32, 999, 1024},
          {DType::f32, 400, 2048},    {DType::f32, 300, 4096},   {DType::f32, 100, 8192},
          {DType::f32, 65, 37},       {DType::f16, 2000, 768},   {DType::f16, 300, 4096, false},
          {DType::f64, 100, 256}};
}

// The input: contiguous, or (misaligned) a contiguous view one element into its buffer.
Tensor rms_input(const RmsCase& c) {
  Tensor x = add(rnd16({c.R, c.C}, c.dt, 2.0), 0.25);
  if (!c.misaligned) return x;
  Tensor buf = zeros({c.R * c.C + 1}, c.dt);
  Tensor v = view(narrow(buf, 0, 1, c.R * c.C), {c.R, c.C});
  copy_(v, x);
  return v;
}

TEST(CudaDecoderOps, RmsNormMatchesCpuAndIsDeterministic) {
  SKIP_WITHOUT_CUDA();
  manual_seed(41);
  for (const RmsCase& c : rms_cases()) {
    SCOPED_TRACE(tag(c));
    const Tensor x = rms_input(c), w = c.weight ? rnd16({c.C}, c.dt) : Tensor(), g = rnd16({c.R, c.C}, c.dt);
    Tensor xd = dev(x);
    if (c.misaligned) {
      Tensor buf = zeros({c.R * c.C + 1}, c.dt, kGPU);
      xd = view(narrow(buf, 0, 1, c.R * c.C), {c.R, c.C});
      copy_(xd, dev(contiguous(x)));
    }
    Tensor xc = grad_leaf(x), wc = c.weight ? grad_leaf(w) : Tensor();
    Tensor xg = grad_leaf(xd), wg = c.weight ? grad_leaf(dev(w)) : Tensor();
    const Tensor yc = rms_norm(xc, wc), yg = rms_norm(xg, wg);
    const double tol = ulp_tol(c.dt);
    EXPECT_EQ(compare(host(yg), yc.detach(), 1e-6, tol), "") << "forward";
    yc.backward(g);
    yg.backward(dev(g));
    EXPECT_EQ(compare(host(xg.grad()), xc.grad(), c.dt == DType::f64 ? 1e-10 : 1e-5, 2 * tol), "") << "grad_x";
    if (c.weight) {
      // Column sums over R rows of O(1) terms: fp32 partial sums err by ~√R·2^-24 each, and the
      // 16-bit result is rounded once.
      const double sr = std::sqrt(double(c.R));
      const double atol = c.dt == DType::f64 ? 1e-10 : c.dt == DType::f32 ? 1e-5 * sr : 1e-3 * sr;
      EXPECT_EQ(compare(host(wg.grad()), wc.grad(), atol, c.dt == DType::f64 ? 1e-10 : tol), "") << "grad_w";
    }
    // Rerun: bit for bit.
    Tensor xg2 = grad_leaf(xd), wg2 = c.weight ? grad_leaf(dev(w)) : Tensor();
    const Tensor yg2 = rms_norm(xg2, wg2);
    EXPECT_TRUE(bitwise_equal(host(yg2), host(yg))) << "forward rerun";
    yg2.backward(dev(g));
    EXPECT_TRUE(bitwise_equal(host(xg2.grad()), host(xg.grad()))) << "grad_x rerun";
    if (c.weight) {
      EXPECT_TRUE(bitwise_equal(host(wg2.grad()), host(wg.grad()))) << "grad_w rerun";
    }
  }
}

// An fp32 master weight used through its bf16 cast gets an fp32 gradient straight from the
// kernel's column sums (Note [Wide gradients]) — the CPU's, within fp32 summation error.
TEST(CudaDecoderOps, RmsNormWeightGradientIsFp32ThroughACast) {
  SKIP_WITHOUT_CUDA();
  manual_seed(42);
  for (int64_t C : {768, 4096, 100}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t R = 2048;
    const Tensor x = rnd16({R, C}, DType::bf16), g = rnd16({R, C}, DType::bf16), w0 = randn({C});
    Tensor wc = grad_leaf(w0), wg = grad_leaf(dev(w0));
    rms_norm(x, to_dtype(wc, DType::bf16)).backward(g);
    rms_norm(dev(x), to_dtype(wg, DType::bf16)).backward(dev(g));
    ASSERT_EQ(wg.grad().dtype(), DType::f32);
    EXPECT_EQ(compare(host(wg.grad()), wc.grad(), 1e-5 * std::sqrt(double(R)), 1e-5), "");
  }
}

// Note [Folded gradient sums]: the residual stream's two gradients summed inside the norm's
// backward kernel, on the GPU bitwise the engine's add of the two (fast path: C = 1024 bf16 and
// f32; general: C = 101, f64), for rms_norm and layer_norm.
TEST(CudaDecoderOps, NormBackwardFoldsTheResidualGradientBitwise) {
  SKIP_WITHOUT_CUDA();
  manual_seed(47);
  for (const bool rms : {true, false})
    for (const auto& [dt, C] : {std::pair{DType::bf16, int64_t(1024)}, {DType::f32, int64_t(1024)},
                                {DType::f32, int64_t(101)}, {DType::f64, int64_t(64)}}) {
      SCOPED_TRACE(std::string(rms ? "rms_norm " : "layer_norm ") + std::string(dtype_name(dt)) + " C=" +
                   std::to_string(C));
      const Tensor x0 = dev(rnd16({300, C}, dt)), g = dev(rnd16({300, C}, dt));
      const Tensor w = dev(rnd16({C}, dt)), b = dev(rnd16({C}, dt));
      auto norm = [&](const Tensor& t) { return rms ? rms_norm(t, w, 1e-6) : layer_norm(t, w, b, 1e-5); };
      Tensor x = grad_leaf(x0), xr = grad_leaf(x0);
      const Tensor t = mul(x, 2.0), tr = mul(xr, 2.0);
      std::vector<size_t> inputs;
      const int obs = add_op_observer([&](const OpDef& op, std::span<const Tensor> in, auto, const Attrs&) {
        // OpDef::name is a C string: compare the text, not the pointer.
        if (std::string_view(op.name) == (rms ? "rms_norm_backward" : "layer_norm_backward")) inputs.push_back(in.size());
      });
      sum(mul(add(norm(t), t), g)).backward();
      remove_op_observer(obs);
      sum(mul(add(norm(clone(tr)), tr), g)).backward();  // the engine's add of the two
      EXPECT_EQ(inputs, std::vector<size_t>{rms ? 5u : 6u});
      const Tensor a = host(x.grad()), r = host(xr.grad());
      EXPECT_EQ(std::memcmp(a.raw_data(), r.raw_data(), a.nbytes()), 0);
    }
}

// --- rotary_embedding ---

struct RopeCase {
  DType dt, cs;
  int64_t B, T, H, D;
  bool qkv_slice;
  int64_t rotate = -1;  // heads rotated (-1: all), the rest copied
};

// Both sides compute x·c ∓ x'·s in the accumulation type without FMA and round once: the CPU's
// result bit for bit, forward and backward, vectorised (head dims of whole 16-byte halves, 16-byte
// strides) or scalar (D = 24 or 40 in 16 bits: halves of 12 or 20; D = 6 or 10), for every pair of
// x's dtype and the tables' (f32 or x's), all heads rotated or the first few (the rest copied).
TEST(CudaDecoderOps, RotaryMatchesCpuBitForBit) {
  SKIP_WITHOUT_CUDA();
  manual_seed(43);
  const std::vector<RopeCase> cases{
      {DType::bf16, DType::f32, 2, 64, 4, 64, true},  {DType::bf16, DType::bf16, 2, 33, 3, 128, false},
      {DType::bf16, DType::f32, 1, 16, 2, 24, true},  {DType::f16, DType::f32, 2, 20, 3, 64, true},
      {DType::f16, DType::f16, 1, 7, 2, 128, false},  {DType::f32, DType::f32, 2, 31, 5, 64, true},
      {DType::f32, DType::f32, 1, 9, 2, 6, false},    {DType::f64, DType::f32, 2, 8, 2, 64, true},
      {DType::f64, DType::f64, 1, 5, 3, 10, true},    {DType::bf16, DType::bf16, 2, 5, 2, 24, false},
      {DType::f16, DType::f16, 1, 6, 3, 40, true},    {DType::f64, DType::f32, 1, 4, 2, 6, false},
      {DType::bf16, DType::f32, 2, 64, 6, 64, false, 4}, {DType::f32, DType::f32, 1, 9, 3, 6, true, 1}};
  for (const RopeCase& c : cases) {
    const std::string t = std::string(dtype_name(c.dt)) + " cos " + std::string(dtype_name(c.cs)) + " B" +
                          std::to_string(c.B) + " T" + std::to_string(c.T) + " H" + std::to_string(c.H) + " D" +
                          std::to_string(c.D) + (c.qkv_slice ? " qkv slice" : "") + " rotate " + std::to_string(c.rotate);
    SCOPED_TRACE(t);
    // x: contiguous, or heads [1, 1 + H) of a [B, T, H + 3, D] projection (strided, no copy).
    const Tensor full = rnd16({c.B, c.T, c.qkv_slice ? c.H + 3 : c.H, c.D}, c.dt);
    const Tensor cos = rnd16({c.T, c.D}, c.cs), sin = rnd16({c.T, c.D}, c.cs), g = rnd16({c.B, c.T, c.H, c.D}, c.dt);
    Tensor fc = grad_leaf(full), fg = grad_leaf(dev(full));
    auto pick = [&](const Tensor& f) { return c.qkv_slice ? narrow(f, 2, 1, c.H) : f; };
    const Tensor yc = rotary_embedding(pick(fc), cos, sin, c.rotate),
                 yg = rotary_embedding(pick(fg), dev(cos), dev(sin), c.rotate);
    EXPECT_TRUE(bitwise_equal(host(yg), yc.detach())) << "forward: " << compare(host(yg), yc.detach(), 0, 0);
    yc.backward(g);
    yg.backward(dev(g));
    EXPECT_TRUE(bitwise_equal(host(fg.grad()), fc.grad())) << "backward: " << compare(host(fg.grad()), fc.grad(), 0, 0);
  }
}

// --- rotary_attention ---

// Whether `t` was made by the fused node (a few view nodes above it at most).
bool made_by_rotary_attention(const Tensor& t) {
  const Node* n = t.grad_fn().get();
  for (int i = 0; n && i < 4; ++i, n = n->next.empty() ? nullptr : n->next[0].fn.get())
    if (n->name() == "rotary_attention") return true;
  return false;
}

struct RopeAttentionCase {
  DType dt;
  int64_t B, T, H, Hkv, D;
  bool wgmma = true;  // bf16/f16: the wgmma backward (dQ rotated back in its cast), else mma.sync
};

// The fused node (RoPE and flash attention, qkv's gradient written by flash_attention_backward:
// dQ and dK rotated back by the wgmma backward in fp32, or in place after the other kernels) against the CPU's composition in f64 on
// the same rounded inputs, within the attention tests' tolerances, and against the GPU's own
// unfused composition (rotary_embedding, split, scaled_dot_product_attention): the same forward
// kernels, so the same output bits, and gradients within one rounding of the dtype (the fused dQ
// and dK are rounded once, from fp32; bitwise where RoPE's backward runs in place instead). Grouped-query and plain heads, f32 (its own kernels, every head
// rotated back in place), bf16 and f16, D 64 and 128, a T that is not a whole tile.
TEST(CudaDecoderOps, RotaryAttentionMatchesTheComposition) {
  SKIP_WITHOUT_CUDA();
  manual_seed(47);
  const std::vector<RopeAttentionCase> cases{
      {DType::bf16, 2, 200, 8, 2, 64},         {DType::bf16, 1, 128, 4, 4, 64},
      {DType::bf16, 2, 130, 4, 2, 128},        {DType::f16, 1, 96, 6, 3, 64},
      {DType::bf16, 2, 200, 8, 2, 64, false},  {DType::f32, 2, 100, 4, 2, 64}};
  for (const RopeAttentionCase& c : cases) {
    SCOPED_TRACE(std::string(dtype_name(c.dt)) + " B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" +
                 std::to_string(c.H) + " Hkv" + std::to_string(c.Hkv) + " D" + std::to_string(c.D) +
                 (c.wgmma ? "" : " mma.sync"));
    WgmmaScope scope(true, c.wgmma);
    const int64_t heads = c.H + 2 * c.Hkv;
    const Tensor qkv = rnd16({c.B, c.T, heads, c.D}, c.dt), g = rnd16({c.B, c.H, c.T, c.D}, c.dt);
    // RoPE's tables as the model makes them (cos and sin of position · frequency, the halves
    // alike), f32.
    std::vector<double> cv(size_t(c.T * c.D)), sv(cv.size());
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t j = 0; j < c.D; ++j) {
        const double a = double(t) * std::pow(10000.0, -2.0 * double(j % (c.D / 2)) / double(c.D));
        cv[size_t(t * c.D + j)] = double(float(std::cos(a)));
        sv[size_t(t * c.D + j)] = double(float(std::sin(a)));
      }
    const Tensor cos_t = from_vector(cv, {c.T, c.D}, DType::f32), sin_t = from_vector(sv, {c.T, c.D}, DType::f32);
    // Fused, on the GPU.
    Tensor xg = grad_leaf(dev(qkv));
    const Tensor og = rotary_attention(xg, dev(cos_t), dev(sin_t), c.H, c.Hkv);
    EXPECT_TRUE(made_by_rotary_attention(og)) << "the fused node did not run";
    og.backward(dev(g));
    // The GPU's composition.
    Tensor xu = grad_leaf(dev(qkv));
    const std::vector<Tensor> r = split(rotary_embedding(xu, dev(cos_t), dev(sin_t), c.H + c.Hkv), {c.H, c.Hkv, c.Hkv}, 2);
    const Tensor ou = scaled_dot_product_attention(transpose(r[0], 1, 2), transpose(r[1], 1, 2), transpose(r[2], 1, 2));
    ou.backward(dev(g));
    EXPECT_TRUE(bitwise_equal(host(og), host(ou))) << compare(host(og), host(ou), 0, 0);
    // The reference: the CPU's composition in f64.
    Tensor xc = grad_leaf(to_dtype(qkv, DType::f64));
    const Tensor oc = rotary_attention(xc, to_dtype(cos_t, DType::f64), to_dtype(sin_t, DType::f64), c.H, c.Hkv);
    oc.backward(to_dtype(g, DType::f64));
    const Tol tol = tolerance(c.dt);  // the flash-attention tests' (flash_attention_checks.h)
    const Tensor gf = to_dtype(host(xg.grad()), DType::f64), gu = to_dtype(host(xu.grad()), DType::f64);
    EXPECT_EQ(compare(to_dtype(host(og), DType::f64), oc.detach(), tol.fwd_atol, tol.fwd_rtol), "");
    EXPECT_EQ(compare(gf, xc.grad(), tol.bwd_atol, tol.bwd_rtol), "") << "fused gradient";
    EXPECT_EQ(compare(gu, xc.grad(), tol.bwd_atol, tol.bwd_rtol), "") << "unfused gradient";
    // dV is attention's own in both; dQ and dK differ by at most a rounding of the dtype where the
    // wgmma backward rotates them back, and not at all where RoPE's backward runs in place (f32,
    // mma.sync).
    EXPECT_EQ(compare(gf, gu, ulp_tol(c.dt) * 4, ulp_tol(c.dt) * 2), "");
    if (c.dt == DType::f32 || !c.wgmma) {
      EXPECT_TRUE(bitwise_equal(host(xg.grad()), host(xu.grad())));
    }
    EXPECT_TRUE(bitwise_equal(narrow(host(xg.grad()), 2, c.H + c.Hkv, c.Hkv), narrow(host(xu.grad()), 2, c.H + c.Hkv, c.Hkv)))
        << "dV";
  }
}

// --- silu / swiglu ---

// swiglu over chunk halves of one [N, 2I] GPU buffer: the forward reads them in place, the
// backward writes one [N, 2I] gradient that split's backward passes on as a view (no cat, no
// copy), and values match the CPU within one output rounding (CUDA's expf vs glibc's: ≤ 2 ulp).
TEST(CudaDecoderOps, SwigluOnHalvesOfOneBufferMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(44);
  struct Case {
    DType dt;
    int64_t N, I;
  };
  for (Case c : {Case{DType::bf16, 1000, 1376}, Case{DType::bf16, 77, 100}, Case{DType::f16, 300, 512}, Case{DType::f16, 90, 36},
                 Case{DType::f32, 500, 1001}, Case{DType::f32, 64, 256}, Case{DType::f64, 33, 40}}) {
    SCOPED_TRACE(std::string(dtype_name(c.dt)) + " N=" + std::to_string(c.N) + " I=" + std::to_string(c.I));
    const Tensor h0 = rnd16({c.N, 2 * c.I}, c.dt, 2.0), g = rnd16({c.N, c.I}, c.dt);
    Tensor hc = grad_leaf(h0), hg = grad_leaf(dev(h0));
    const auto pc = chunk(hc, 2, -1), pg = chunk(hg, 2, -1);
    const Tensor yc = swiglu(pc[0], pc[1]);
    const Tensor yg = swiglu(pg[0], pg[1]);
    const double tol = std::max(ulp_tol(c.dt), 1e-6);
    EXPECT_EQ(compare(host(yg), yc.detach(), 1e-6, tol), "") << "forward";
    yc.backward(g);
    std::vector<std::string> ran;
    const Tensor gd = dev(g);
    const int obs = add_op_observer([&](const OpDef& op, auto, auto, const Attrs&) { ran.push_back(op.name); });
    yg.backward(gd);
    remove_op_observer(obs);
    // The kernel, and the two halves it returns as views: nothing copies or joins.
    EXPECT_EQ(ran, (std::vector<std::string>{"swiglu_backward", "narrow", "narrow"}));
    ASSERT_TRUE(hg.grad().device().is_cuda());
    EXPECT_EQ(compare(host(hg.grad()), hc.grad(), 1e-5, 2 * tol), "") << "gradient";
  }
}

TEST(CudaDecoderOps, SiluAndSeparateSwigluMatchCpu) {
  SKIP_WITHOUT_CUDA();
  manual_seed(45);
  for (DType dt : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = std::max(ulp_tol(dt), 1e-6);
    const Tensor a0 = rnd16({513, 72}, dt, 2.0), b0 = rnd16({513, 72}, dt), g = rnd16({513, 72}, dt);
    Tensor ac = grad_leaf(a0), bc = grad_leaf(b0), ag = grad_leaf(dev(a0)), bg = grad_leaf(dev(b0));
    const Tensor sc = silu(ac), sg = silu(ag);
    EXPECT_EQ(compare(host(sg), sc.detach(), 1e-6, tol), "") << "silu";
    sc.backward(g);
    sg.backward(dev(g));
    EXPECT_EQ(compare(host(ag.grad()), ac.grad(), 1e-5, 2 * tol), "") << "silu gradient";
    ac.zero_grad();
    ag.zero_grad();
    const Tensor yc = swiglu(ac, bc), yg = swiglu(ag, bg);
    EXPECT_EQ(compare(host(yg), yc.detach(), 1e-6, tol), "") << "swiglu";
    yc.backward(g);
    yg.backward(dev(g));
    EXPECT_EQ(compare(host(ag.grad()), ac.grad(), 1e-5, 2 * tol), "") << "swiglu d_gate";
    EXPECT_EQ(compare(host(bg.grad()), bc.grad(), 1e-5, 2 * tol), "") << "swiglu d_up";
  }
}

// --- bandwidth at Llama sizes ---

// Times body() (after warm-up) on the current stream; milliseconds per call.
template <typename F>
double time_ms(F&& body, int iters = 20) {
  cudaStream_t s = cuda::current_stream();
  for (int i = 0; i < 3; ++i) body();
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  cuda::Event start(true), stop(true);
  start.record(s);
  for (int i = 0; i < iters; ++i) body();
  stop.record(s);
  stop.synchronize();
  return double(stop.elapsed_ms(start)) / iters;
}

// Forward and forward+backward of each op in bf16 at a Llama-1B-like layer (B·T = 16384 tokens,
// C = 2048, 32 heads of 64, I = 5632 with gate/up halves of one buffer), printed as ms and the
// bandwidth of the bytes each must move (reads + writes, once). Each must reach 1 TB/s — a
// fraction of an H100's ~3.3 TB/s — which fails if a slow path is taken.
TEST(CudaDecoderOps, BandwidthAtLlamaSizes) {
  SKIP_WITHOUT_CUDA();
  const int64_t N = 16384, C = 2048, H = 32, D = 64, I = 5632, B = 16, T = N / B;
  const DType dt = DType::bf16;
  Generator gen(5);
  auto make = [&](const Shape& s) { return grad_leaf(to_device(randn(s, dt, kCPU, &gen), kGPU)); };
  auto report = [](const char* what, double ms, double bytes) {
    const double tbs = bytes / (ms * 1e-3) / 1e12;
    std::printf("%-28s %8.3f ms  %6.2f TB/s\n", what, ms, tbs);
    EXPECT_GT(tbs, 1.0) << what;
  };
  {
    Tensor x = make({N, C}), w = make({C});
    const Tensor g = to_device(randn({N, C}, dt, kCPU, &gen), kGPU);
    const double f = time_ms([&] {
      NoGradGuard ng;
      (void)rms_norm(x, w);
    });
    const double fb = time_ms([&] {
      x.zero_grad();
      w.zero_grad();
      rms_norm(x, w).backward(g);
    });
    report("rms_norm forward", f, 2.0 * N * C * 2);
    report("rms_norm backward", fb - f, 3.0 * N * C * 2);  // g, x in; grad_x out
  }
  {
    Tensor qkv = make({B, T, 3 * H, D});
    const Tensor cos = to_device(randn({T, D}, DType::f32, kCPU, &gen), kGPU), sin = cos;
    const Tensor g = to_device(randn({B, T, H, D}, dt, kCPU, &gen), kGPU);
    const double f = time_ms([&] {
      NoGradGuard ng;
      (void)rotary_embedding(narrow(qkv, 2, 0, H), cos, sin);
    });
    report("rotary forward (qkv slice)", f, 2.0 * B * T * H * D * 2);
    Tensor q = make({B, T, H, D});
    const double fb = time_ms([&] {
      q.zero_grad();
      rotary_embedding(q, cos, sin).backward(g);
    });
    report("rotary fwd+bwd", fb, 4.0 * B * T * H * D * 2);
  }
  {
    Tensor h = make({N, 2 * I});
    const Tensor g = to_device(randn({N, I}, dt, kCPU, &gen), kGPU);
    const double f = time_ms([&] {
      NoGradGuard ng;
      const auto p = chunk(h, 2, -1);
      (void)swiglu(p[0], p[1]);
    });
    const double fb = time_ms([&] {
      h.zero_grad();
      const auto p = chunk(h, 2, -1);
      swiglu(p[0], p[1]).backward(g);
    });
    report("swiglu forward (halves)", f, 3.0 * N * I * 2);
    report("swiglu backward (side by side)", fb - f, 5.0 * N * I * 2);  // g, gate, up in; d_gate, d_up out
  }
}

}  // namespace
}  // namespace blu::test
