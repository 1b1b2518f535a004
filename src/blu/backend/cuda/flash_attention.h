// backend/cuda/flash_attention: the host-side contract of the fused attention kernels
// ("flash_attention", "flash_attention_backward"; OpDefs in ops/attention.cpp). Attention is
// computed tile by tile with an online softmax, so the T×T score matrix never exists in memory;
// the forward saves only the per-row logsumexp, and the backward recomputes the probabilities.
// Two kernel families: tensor-core kernels (mma.sync m16n8k16, fp32 accumulation, ldmatrix,
// cp.async double buffering; bf16/f16, head dim 64 or 128) and a plain SIMT path (one warp per
// row; every dtype but f64, same head dims) kept for fp32 and as a cross-check.
// Depends on backend/cuda/runtime and core/dtype. Keep: every operand is [B, H, T, D] addressed by
// element strides for batch, head and time with unit stride along D; row strides and base pointers
// are 16-byte aligned (the op checks this); lse is natural-log logsumexp of the *scaled* scores,
// fp32 [B, H, T] contiguous. Causal masks key j from query i when j > i (top-left, Tq == Tk).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "blu/core/dtype.h"
#include "blu/core/tensor.h"

namespace blu::cuda {

// One [B, H, T, D] operand: the element at (b, h, t, d) is ptr[b*sb + h*sh + t*st + d].
struct AttnOperand {
  void* ptr = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
};

// A [B, H, T, D] tensor (any strides, unit stride along D) as an operand.
inline AttnOperand operand_bhtd(const Tensor& t) { return {t.raw_data(), t.stride(0), t.stride(1), t.stride(2)}; }
// A contiguous [B, T, H, D] buffer (the layout the op's outputs use) as a [B, H, T, D] operand.
inline AttnOperand operand_bthd(const Tensor& t) { return {t.raw_data(), t.stride(0), t.stride(2), t.stride(1)}; }

struct FlashFwdParams {
  AttnOperand q, k, v, o;
  float* lse = nullptr;  // [B, H, T]
  int B = 0, H = 0, T = 0, D = 0;
  float scale = 1.f;  // multiplies q·k
  bool causal = false;
};

struct FlashBwdParams {
  AttnOperand q, k, v, o, dout, dq, dk, dv;
  const float* lse = nullptr;  // [B, H, T], from the forward
  float* dsum = nullptr;       // scratch [B, H, T]: rowsum(dO ∘ O)
  float* dq_accum = nullptr;   // scratch [B, H, T, D] fp32 (tensor-core path only; may be null otherwise)
  int B = 0, H = 0, T = 0, D = 0;
  float scale = 1.f;
  bool causal = false;
};

// Whether the fused kernels take this problem (dtype f32/bf16/f16, head dim 64 or 128).
bool flash_attention_supported(DType dtype, int64_t head_dim);
// Whether the backward of `dtype` uses the tensor-core path (and so needs dq_accum).
bool flash_attention_uses_tensor_cores(DType dtype);

// Launch on `stream`. The caller checked flash_attention_supported and the layout contract.
void flash_attention_forward(const FlashFwdParams& p, DType dtype, cudaStream_t stream);
void flash_attention_backward(const FlashBwdParams& p, DType dtype, cudaStream_t stream);

// Test hook: route bf16/f16 through the SIMT kernels too (to cross-check the tensor-core path).
void set_flash_attention_force_simt(bool on);
bool flash_attention_force_simt();

}  // namespace blu::cuda
