// Grouped-query attention (GQA) in the fused CUDA attention (backend/cuda/flash_attention*.cu):
// q [B, H, T, D] with k, v [B, Hkv, T, D], query head h reading key/value head h / (H / Hkv),
// against the composite reference on the CPU in f64 (which expands k, v over each group), on fresh
// random data: out, dq, dk, dv, for every kernel family the dispatch can pick — bf16/f16 on the
// default path (on Hopper the wgmma forward and backward; elsewhere mma.sync), on mma.sync, with
// head groups of 4; f32 on 3xTF32 and 1xTF32. Shapes: (H, Hkv) (9, 3), (16, 4), (6, 2), (4, 1), (32, 8);
// head dims 64 and 128, causal and not, T of 1, 17, 100, 130, 200 (not a multiple of any tile)
// and 64; q, k, v as separate tensors and as the head ranges of one [B, T, H + 2·Hkv, D] buffer
// (a fused projection: the backward then writes one packed gradient buffer). Each case also checks
// that the GQA forward equals, bit for bit, the same kernel on k, v repeated over the groups. The
// RepeatedBackward tests check that dK and dV (every family) and dQ (the deterministic ones) are the
// same bits run to run. LlamaShapes runs T = 1024 at the three Llama head layouts.
//
// Run on the GPU machine: ./build-cuda/tests/test_cuda --gtest_filter='FlashAttentionGqa*'
// (or ctest -L cuda -R FlashAttentionGqa).
#include <gtest/gtest.h>

#include <cmath>
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

struct GqaCase {
  int64_t B, H, Hkv, T, D;
  bool causal;
  DType dtype;
  bool fused;  // q, k, v as the head ranges of one [B, T, H + 2·Hkv, D] buffer
  std::string str() const {
    std::ostringstream os;
    os << "B" << B << " H" << H << " Hkv" << Hkv << " T" << T << " D" << D << (causal ? " causal " : " full ") << dtype
       << (fused ? " fused-qkv" : " separate");
    return os.str();
  }
};

// How a family's results are judged: elementwise against tolerance(dtype), or (1xTF32) by the
// norm-and-elementwise bounds of the f32 tests.
enum class Judge { elementwise, tf32_1x };

// [B, Hkv, T, E] → [B, H, T, E], head h a copy of head h / (H / Hkv) (contiguous).
Tensor repeat_kv(const Tensor& t, int64_t H) {
  const int64_t B = t.size(0), Hkv = t.size(1), T = t.size(2), E = t.size(3);
  return contiguous(reshape(expand(unsqueeze(t, 2), {B, Hkv, H / Hkv, T, E}), {B, H, T, E}));
}

struct Grads {
  Tensor out, dq, dk, dv;
};

// Forward and backward of the op on the GPU on `vals` (q, k, v: dtype-rounded, CPU) and dout, in
// the case's layout.
Grads run_gpu(const GqaCase& c, const std::vector<Tensor>& vals, const Tensor& dout) {
  Grads r;
  if (!c.fused) {
    std::vector<Tensor> in;
    for (const Tensor& t : vals) in.push_back(to_device(t, kGPU).set_requires_grad(true));
    r.out = scaled_dot_product_attention(in[0], in[1], in[2], c.causal);
    r.out.backward(to_device(dout, kGPU));
    r.dq = in[0].grad(), r.dk = in[1].grad(), r.dv = in[2].grad();
  } else {
    // One [B, T, H + 2·Hkv, D] leaf; q, k, v its head ranges viewed as [B, heads, T, D].
    Tensor packed = to_device(contiguous(cat({transpose(vals[0], 1, 2), transpose(vals[1], 1, 2),
                                              transpose(vals[2], 1, 2)}, 2)), kGPU)
                        .set_requires_grad(true);
    const int64_t H = c.H, Hkv = c.Hkv;
    Tensor q = transpose(narrow(packed, 2, 0, H), 1, 2), k = transpose(narrow(packed, 2, H, Hkv), 1, 2),
           v = transpose(narrow(packed, 2, H + Hkv, Hkv), 1, 2);
    r.out = scaled_dot_product_attention(q, k, v, c.causal);
    r.out.backward(to_device(dout, kGPU));
    const Tensor g = packed.grad();
    r.dq = transpose(narrow(g, 2, 0, H), 1, 2);
    r.dk = transpose(narrow(g, 2, H, Hkv), 1, 2);
    r.dv = transpose(narrow(g, 2, H + Hkv, Hkv), 1, 2);
  }
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  return r;
}

// One case on the current family against the f64 reference; and the forward against the same
// kernels on k, v repeated over the groups (exactly equal: the same arithmetic on the same values).
void run_gqa_case(const GqaCase& c, uint64_t seed, Judge judge) {
  SCOPED_TRACE(c.str());
  Generator gen(seed);
  const Shape q_shape{c.B, c.H, c.T, c.D}, kv_shape{c.B, c.Hkv, c.T, c.D};
  std::vector<Tensor> vals;  // dtype-rounded values, CPU
  vals.push_back(to_dtype(randn(q_shape, DType::f64, kCPU, &gen), c.dtype));
  for (int i = 0; i < 2; ++i) vals.push_back(to_dtype(randn(kv_shape, DType::f64, kCPU, &gen), c.dtype));
  const Tensor dout = to_dtype(randn(q_shape, DType::f64, kCPU, &gen), c.dtype);

  std::vector<Tensor> ref;
  for (const Tensor& t : vals) ref.push_back(to_dtype(t, DType::f64).set_requires_grad(true));
  const Tensor ref_out = scaled_dot_product_attention(ref[0], ref[1], ref[2], c.causal);
  ref_out.backward(to_dtype(dout, DType::f64));

  const Grads got = run_gpu(c, vals, dout);
  ASSERT_TRUE(got.out.device().is_cuda());
  ASSERT_EQ(got.out.shape(), q_shape);
  ASSERT_EQ(got.dk.shape(), kv_shape);
  ASSERT_EQ(got.dv.shape(), kv_shape);
  if (judge == Judge::tf32_1x) {
    const std::vector<Tensor> outs = {got.out, got.dq, got.dk, got.dv};
    const std::vector<Tensor> refs = {ref_out.detach(), ref[0].grad(), ref[1].grad(), ref[2].grad()};
    const char* names[] = {"out", "dq", "dk", "dv"};
    ErrStats stats;
    const F32Tol tol = f32_tolerance(F32Path::tf32_1x);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(check_norm(names[i], outs[i], refs[i], tol, stats), "");
  } else {
    // dK, dV sum over the group's query heads as well as over the queries: G times the terms, so
    // their absolute error grows like sqrt(G); the relative bound stays.
    const Tol tol = tolerance(c.dtype);
    const double g = std::sqrt(double(c.H / c.Hkv));
    EXPECT_EQ(check_close("out", got.out, ref_out.detach(), tol.fwd_atol, tol.fwd_rtol), "");
    EXPECT_EQ(check_close("dq", got.dq, ref[0].grad(), tol.bwd_atol, tol.bwd_rtol), "");
    EXPECT_EQ(check_close("dk", got.dk, ref[1].grad(), tol.bwd_atol * g, tol.bwd_rtol), "");
    EXPECT_EQ(check_close("dv", got.dv, ref[2].grad(), tol.bwd_atol * g, tol.bwd_rtol), "");
  }

  // The forward with k, v expanded to H heads (no GQA in the kernels) gives the same bits.
  const Tensor q = to_device(vals[0], kGPU);
  const Tensor out_rep = scaled_dot_product_attention(q, to_device(repeat_kv(vals[1], c.H), kGPU),
                                                      to_device(repeat_kv(vals[2], c.H), kGPU), c.causal);
  EXPECT_EQ(check_close("out vs out on repeated k, v", got.out, out_rep, 0, 0), "");
}

void run_gqa_sweep(DType dtype, Judge judge = Judge::elementwise) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  struct Heads {
    int64_t H, Hkv, T;
  };
  uint64_t seed = 9000;
  for (int64_t D : {64, 128})
    for (bool causal : {true, false})
      for (const Heads& s : {Heads{9, 3, 100}, Heads{16, 4, 17}, Heads{6, 2, 200}, Heads{4, 1, 64}, Heads{32, 8, 130},
                             Heads{6, 3, 1}}) {
        const int64_t B = s.H >= 16 ? 1 : 2;
        run_gqa_case({B, s.H, s.Hkv, s.T, D, causal, dtype, false}, seed++, judge);
        if (s.T == 100 || s.T == 130) run_gqa_case({B, s.H, s.Hkv, s.T, D, causal, dtype, true}, seed++, judge);
      }
}

// bf16/f16: the default path (wgmma on Hopper, mma.sync elsewhere), mma.sync.
TEST(FlashAttentionGqa, Bf16) { run_gqa_sweep(DType::bf16); }
TEST(FlashAttentionGqa, F16) { run_gqa_sweep(DType::f16); }
TEST(FlashAttentionGqa, Bf16MmaSync) {
  WgmmaScope mma(false);
  run_gqa_sweep(DType::bf16);
}
TEST(FlashAttentionGqa, F16MmaSync) {
  WgmmaScope mma(false);
  run_gqa_sweep(DType::f16);
}
// Head groups of 4 (the wgmma backward deals out 4 / group key/value heads at a time: one here).
TEST(FlashAttentionGqa, Bf16HeadGroups) {
  HeadGroupScope g(4, 4);
  run_gqa_sweep(DType::bf16);
}
// f32: 3xTF32 ("ieee", the default), 1xTF32.
TEST(FlashAttentionGqa, F32Ieee3xTf32) {
  F32PathScope path(F32Path::ieee_3xtf32);
  run_gqa_sweep(DType::f32);
}
TEST(FlashAttentionGqa, F32Tf32) {
  F32PathScope path(F32Path::tf32_1x);
  run_gqa_sweep(DType::f32, Judge::tf32_1x);
}

// The shapes Llama-family models train at: head dim 64, T 1024, bf16, causal, on the default path.
TEST(FlashAttentionGqa, LlamaShapesBf16) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  uint64_t seed = 9500;
  for (const auto& [H, Hkv] : {std::pair<int64_t, int64_t>{9, 3}, {16, 4}, {32, 8}})
    run_gqa_case({1, H, Hkv, 1024, 64, true, DType::bf16, false}, seed++, Judge::elementwise);
}

// The GQA backward twice on the same inputs: dK, dV the same bits on every family (they sum the
// group in registers, in a fixed order); dQ, summed by fp32 atomics, equal up to their order.
TEST(FlashAttentionGqa, RepeatedBackward) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  enum class Fam { tensor_cores, mma_sync, tf32 };
  for (Fam fam : {Fam::tensor_cores, Fam::mma_sync, Fam::tf32}) {
    const DType dt = fam == Fam::tf32 ? DType::f32 : DType::bf16;
    WgmmaScope wgmma(fam != Fam::mma_sync);
    F32PathScope path(F32Path::ieee_3xtf32);
    SCOPED_TRACE("family " + std::to_string(int(fam)));
    Generator gen(77);
    const int64_t B = 2, H = 9, Hkv = 3, T = 300, D = 64;
    const Tensor q = to_device(randn({B, H, T, D}, dt, kCPU, &gen), kGPU);
    const Tensor k = to_device(randn({B, Hkv, T, D}, dt, kCPU, &gen), kGPU);
    const Tensor v = to_device(randn({B, Hkv, T, D}, dt, kCPU, &gen), kGPU);
    const Tensor dout = to_device(randn({B, H, T, D}, dt, kCPU, &gen), kGPU);
    std::vector<std::vector<Tensor>> grads;
    for (int run = 0; run < 2; ++run) {
      std::vector<Tensor> in = {q.detach().set_requires_grad(true), k.detach().set_requires_grad(true),
                                v.detach().set_requires_grad(true)};
      scaled_dot_product_attention(in[0], in[1], in[2], true).backward(dout);
      grads.push_back({in[0].grad(), in[1].grad(), in[2].grad()});
    }
    const double dq_tol = dt == DType::f32 ? 1e-5 : 1e-2;
    EXPECT_EQ(check_close("dq run 2 vs 1", grads[1][0], grads[0][0], dq_tol, dq_tol), "");
    EXPECT_EQ(check_close("dk run 2 vs 1", grads[1][1], grads[0][1], 0, 0), "") << "dK must be deterministic";
    EXPECT_EQ(check_close("dv run 2 vs 1", grads[1][2], grads[0][2], 0, 0), "") << "dV must be deterministic";
  }
}

}  // namespace
}  // namespace blu::test
