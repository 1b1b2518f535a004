// Timings of the flash-attention kernels at GPT-2 124M's shape (B16 H12 T1024 D64, causal) and
// llama-250m's (B8 H16, 4 key/value heads): bf16
// on each kernel family, variant and CTA order, and f32 in each mode, forward and forward+backward,
// with q, k, v as views of [B, T, H, D] leaves as in GPT. Correctness is flash_attention_test.cpp.
// Run on the GPU machine: ./build-cuda/tests/test_cuda --gtest_filter='FlashAttentionPerf.*'
// (scripts/gpu_run.sh attn runs them beside PyTorch's SDPA).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "cuda/cuda_test_util.h"
#include "cuda/flash_attention_scopes.h"

namespace blu::test {
namespace {

// The attention shape timed: GPT-2 124M's by default; llama-250m's with grouped-query heads.
struct AttnShape {
  int64_t B = 16, H = 12, Hkv = 12, T = 1024, D = 64;
};

// Causal attention at `s` (D: the head dim) in `dtype`. Prints ms and TFLOP/s (flops counted as
// FlashAttention does: forward 4·B·H·T²·D, halved for causal; backward 2.5x the forward; at 3xTF32
// the tensor cores do three times that work).
void time_causal(DType dtype, const char* label, AttnShape s) {
  ASSERT_GT(cuda::device_count(), 0) << "no CUDA device";
  const int64_t B = s.B, H = s.H, T = s.T, D = s.D;
  // q, k, v are [B, H, T, D] views of the head ranges of one [B, T, H + 2·Hkv, D] leaf, as in GPT
  // (heads split off c_attn's output): the backward writes dq, dk, dv side by side into one buffer
  // of that shape, which becomes the leaf's gradient as it is (split's backward joins the pieces as
  // a view), so the time is the kernels' alone, as PyTorch's with its contiguous inputs.
  Generator gen(11);
  const Tensor leaf = to_device(randn({B, T, H + 2 * s.Hkv, D}, dtype, kCPU, &gen), kGPU);
  auto heads = [&](const Tensor& t) {
    std::vector<Tensor> p = split(t, {H, s.Hkv, s.Hkv}, 2);
    for (Tensor& x : p) x = transpose(x, 1, 2);
    return p;
  };
  Tensor dout = to_device(randn({B, H, T, D}, dtype, kCPU, &gen), kGPU);
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
    const std::vector<Tensor> q = heads(leaf);
    (void)scaled_dot_product_attention(q[0], q[1], q[2], true);
  });
  Tensor in = leaf.detach().set_requires_grad(true);
  const double fwdbwd_ms = time_it([&] {
    in.zero_grad();
    const std::vector<Tensor> q = heads(in);
    scaled_dot_product_attention(q[0], q[1], q[2], true).backward(dout);
  });
  std::printf("flash attention %s%s B%d H%d Hkv%d T%d D%d causal: fwd %.4f ms (%.1f TFLOP/s), fwd+bwd %.4f ms "
              "(%.1f TFLOP/s), bwd alone ~%.4f ms\n",
              std::string(dtype_name(dtype)).c_str(), label, int(B), int(H), int(s.Hkv), int(T), int(D), fwd_ms,
              fwd_flops / (fwd_ms * 1e-3) / 1e12, fwdbwd_ms, 3.5 * fwd_flops / (fwdbwd_ms * 1e-3) / 1e12,
              fwdbwd_ms - fwd_ms);
}

void time_gpt2_causal(DType dtype, const char* label = "", int64_t D = 64) {
  time_causal(dtype, label, AttnShape{.D = D});
}

// The default bf16 kernels (on Hopper the wgmma forward and backward), the mma.sync ones, and the
// wgmma forward with the mma.sync backward (the backward alone compared on the same forward).
TEST(FlashAttentionPerf, Gpt2Bf16Causal) {
  time_gpt2_causal(DType::bf16, cuda::flash_attention_wgmma_available() ? " [wgmma fwd, wgmma bwd]" : "");
}
TEST(FlashAttentionPerf, Gpt2Bf16CausalMmaSync) {
  WgmmaScope mma(false);
  time_gpt2_causal(DType::bf16, " [mma.sync fwd, mma.sync bwd]");
}
TEST(FlashAttentionPerf, Gpt2Bf16CausalMmaSyncBwd) {
  WgmmaScope mma(true, false);
  time_gpt2_causal(DType::bf16, " [wgmma fwd, mma.sync bwd]");
}
// Head dim 128 (not GPT-2's; models with wider heads).
TEST(FlashAttentionPerf, Bf16CausalD128) {
  time_gpt2_causal(DType::bf16, cuda::flash_attention_wgmma_available() ? " [wgmma fwd, wgmma bwd]" : "", 128);
}
// llama-250m's attention (B8 H16 T1024 D64, 4 key/value heads: grouped-query, Note [GQA backward]),
// and the same with 16 key/value heads: what the grouping costs.
TEST(FlashAttentionPerf, LlamaBf16CausalGqa) {
  time_causal(DType::bf16, " [GQA]", AttnShape{.B = 8, .H = 16, .Hkv = 4});
  time_causal(DType::bf16, " [no grouping]", AttnShape{.B = 8, .H = 16, .Hkv = 16});
}
// The backward's head group at grouped-query shapes (llama-250m's; llama3.2-1b's heads at B8): the
// wgmma backward deals out head_group / G key/value heads at a time (launch_bwd_wgmma).
TEST(FlashAttentionPerf, LlamaBf16CausalGqaHeadGroups) {
  for (AttnShape s : {AttnShape{.B = 8, .H = 16, .Hkv = 4}, AttnShape{.B = 8, .H = 32, .Hkv = 8}})
    for (int heads : {0, 16, 32, 48, 64, 96, 128, 256}) {
      HeadGroupScope g(cuda::flash_attention_head_group(false), heads);
      time_causal(DType::bf16, (" [backward head group " + std::to_string(heads) + "]").c_str(), s);
    }
}
// The CTA order's head group (Note [head groups]), forward and backward: 0 is the plain grid order.
TEST(FlashAttentionPerf, Gpt2Bf16CausalHeadGroups) {
  for (int heads : {0, 4, 8, 12, 16, 24, 32, 48, 64}) {
    HeadGroupScope g(heads, heads);
    time_gpt2_causal(DType::bf16, (" [head group " + std::to_string(heads) + "]").c_str());
  }
}
// fp32, the default ("ieee"): TF32 tensor cores at 3xTF32 (flash_attention_tf32.cu).
TEST(FlashAttentionPerf, Gpt2F32Causal) {
  F32PathScope scope(F32Path::ieee_3xtf32);
  time_gpt2_causal(DType::f32, " [ieee: 3xTF32]");
}
// fp32 under matmul precision "tf32": 1xTF32.
TEST(FlashAttentionPerf, Gpt2F32Tf32Causal) {
  F32PathScope scope(F32Path::tf32_1x);
  time_gpt2_causal(DType::f32, " [tf32: 1xTF32]");
}

}  // namespace
}  // namespace blu::test
