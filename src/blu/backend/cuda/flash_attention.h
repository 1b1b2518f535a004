// backend/cuda/flash_attention: the host-side contract of the fused attention kernels
// ("flash_attention", "flash_attention_backward"; OpDefs in ops/attention.cpp). Attention is
// computed tile by tile with an online softmax, so the T×T score matrix never exists in memory;
// the forward saves only the per-row logsumexp, and the backward recomputes the probabilities.
// Kernel families: tensor-core kernels for bf16/f16 (mma.sync m16n8k16, fp32 accumulation,
// ldmatrix, cp.async double buffering; on Hopper the forward and backward use wgmma instead) and for f32 (TF32 mma.sync m16n8k8: 1xTF32 under
// matmul_precision() "tf32", 3xTF32 — fp32-level accuracy — under "ieee"), all for head dim 64 or
// 128. (A plain SIMT path and register-blocked IEEE-fp32 CUDA-core kernels, which never won a
// measurement, are kept in scripts/lab/.)
// Grouped-query attention: k, v (and dk, dv) have Hkv = H / group heads; query head h reads
// key/value head h / group. Every family takes it natively (no copy or expansion of K, V): the
// forwards read the shared head in place; the backwards give each CTA (or warp) of dK, dV a key
// tile of one key/value head and walk the query tiles of all `group` query heads in turn, so the
// group sums stay in registers, in a fixed order (Note [GQA backward] in flash_attention.cuh).
// Depends on backend/cuda/runtime and core/dtype. Keep: every operand is [B, heads, T, D]
// addressed by element strides for batch, head and time with unit stride along D (q, o, dout, dq
// with H heads; k, v, dk, dv with H / group); row strides and base pointers are 16-byte aligned
// (the op checks this); lse is natural-log logsumexp of the *scaled* scores, fp32 [B, H, T]
// contiguous. Causal masks key j from query i when j > i (top-left, Tq == Tk).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "blu/backend/cuda/int_div.h"  // BLU_HD
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
  int head_group = 0;  // CTA order (Note [head groups]); set by flash_attention_forward
  int group = 1;       // query heads per key/value head (H / Hkv; 1 without GQA)
};

struct FlashBwdParams {
  AttnOperand q, k, v, o, dout, dq, dk, dv;
  const float* lse = nullptr;  // [B, H, T], from the forward
  float* dsum = nullptr;       // scratch [B, H, T]: rowsum(dO ∘ O)
  // Scratch fp32 dQ (bf16/f16 tensor cores only; may be null otherwise) of flash_dq_accum_floats
  // floats: [B, H, T, D] rows for the mma.sync backward, 64-row tiles in fragment order for the
  // wgmma one (Note [dQ tiles] in flash_attention_wgmma_backward.cu).
  float* dq_accum = nullptr;
  int B = 0, H = 0, T = 0, D = 0;
  float scale = 1.f;
  bool causal = false;
  int head_group = 0;  // CTA order (Note [head groups]); set by flash_attention_backward
  int group = 1;       // query heads per key/value head (H / Hkv; 1 without GQA); dk, dv have H / group
  // RoPE's tables (f32 [T, D], contiguous) when q and k were rotated (ops/attention.h,
  // rotary_attention): the wgmma backward writes dQ and dK rotated back (Note [RoPE in the dQ
  // cast], flash_attention_wgmma_backward.cu). Null: attention's own gradients.
  const float* rope_cos = nullptr;
  const float* rope_sin = nullptr;
};

// Whether the fused kernels take this problem (dtype f32/bf16/f16, head dim 64 or 128).
bool flash_attention_supported(DType dtype, int64_t head_dim);
// Whether the backward of `dtype` needs the dq_accum scratch (the bf16/f16 tensor-core path; the
// f32 paths accumulate into dq itself or need no accumulator).
bool flash_attention_needs_dq_accum(DType dtype);
// Floats of that scratch: B·H·T·D with T rounded up to the 64-row tiles of the wgmma backward.
BLU_HD inline int64_t flash_dq_accum_floats(int64_t B, int64_t H, int64_t T, int64_t D) {
  return B * H * ((T + 63) / 64 * 64) * D;
}

// Launch on `stream`. The caller checked flash_attention_supported and the layout contract.
void flash_attention_forward(const FlashFwdParams& p, DType dtype, cudaStream_t stream);
// Returns whether dQ and dK came out rotated back (p.rope_cos set and the wgmma backward ran);
// otherwise they are attention's own gradients, which the caller rotates back itself.
bool flash_attention_backward(const FlashBwdParams& p, DType dtype, cudaStream_t stream);

// Whether the Hopper wgmma forward (flash_attention_wgmma.h) can run: the build has sm_90a code
// (CMAKE_CUDA_ARCHITECTURES 90a) and the current device is of compute capability 9.0.
bool flash_attention_wgmma_available();
// Test hook: bf16/f16 forwards take the wgmma kernel when it is available (default on); off, the
// mma.sync kernel.
void set_flash_attention_wgmma(bool on);
bool flash_attention_wgmma();
// Test hook: bf16/f16 backwards take the wgmma kernel (flash_attention_wgmma_backward.cu) when it
// is available (default on; BLU_FLASH_WGMMA_BWD=0 in the environment starts with it off); off, the
// mma.sync kernel.
void set_flash_attention_wgmma_backward(bool on);
bool flash_attention_wgmma_backward();

// Tuning knob: how many (batch, head) pairs the tensor-core forwards (backward = false) and the
// wgmma backward (true) work through together (Note [head groups] in flash_attention.cuh); 0 takes
// all of them at once (the plain grid order). Both start from BLU_FLASH_HEAD_GROUP when it is set,
// else from the defaults measured on an H200 at GPT-2 shapes (B16 H12 T1024 D64 causal bf16,
// the sweep in docs/performance.md): in groups of 24 to 64 heads a head's CTAs share its tiles in
// the L2 — at 48 the backward takes 0.2755 ms and the forward 0.0824 ms, against 0.2925 and
// 0.0836 in the plain order.
constexpr int kDefaultFwdHeadGroup = 48, kDefaultBwdHeadGroup = 48;
void set_flash_attention_head_group(bool backward, int heads);
int flash_attention_head_group(bool backward);

// The CTA order of Note [head groups]: the (batch, head) pair and tile rank of the CTA with linear
// index `lin` (x fastest) of a (bh_count, ranks) grid, heads dealt out in groups of `head_group`
// (≤ 0 or ≥ bh_count: one group, the plain order). A bijection onto [0, bh_count) × [0, ranks).
struct TileSlot {
  int bh, rank;
};
BLU_HD inline TileSlot tile_slot_of(int lin, int bh_count, int ranks, int head_group) {
  const int g = head_group <= 0 || head_group > bh_count ? bh_count : head_group;
  const int group = lin / (g * ranks), r = lin - group * g * ranks;
  const int rest = bh_count - group * g, size = rest < g ? rest : g;  // the last group may be smaller
  return {group * g + r % size, r / size};
}

// The head group of the GQA wgmma backward (Note [GQA head groups] in flash_attention.cuh), in
// key/value heads: `preferred` (the backward's head group over `group`, at least 1) or a larger
// one up to kv_heads (one group), the smallest whose simulated makespan is within 2% of the best.
// kv_heads = B·Hkv CTA columns, ranks key tiles of 128 per column, query_tiles of 64 per head,
// group = H / Hkv query heads per CTA, sms CTAs at once (one per multiprocessor). preferred ≤ 0:
// 0 (the plain order).
int gqa_backward_head_group(int kv_heads, int ranks, int query_tiles, int group, bool causal, int sms,
                            int preferred);

}  // namespace blu::cuda
