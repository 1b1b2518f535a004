// ops/attention: scaled dot-product attention. The CPU reference here is the plain form
// (softmax(q·kᵀ·scale + causal mask)·v written in other ops, so its gradient is automatic); the
// CUDA backend supplies a fused flash-attention kernel for the same call: on a CUDA device with
// q [B, H, T, D] and k, v [B, Hkv, T, D], H a multiple of Hkv (D 64 or 128; f32, bf16 or f16) it
// dispatches the "flash_attention" op (backend/cuda/flash_attention.h), which never materialises
// the T x T scores; anything else takes the composite path after a one-time log line naming the
// reason. The fused result is a [B, H, T, D] view of a [B, T, H, D] buffer (so merging the heads
// afterwards is free).
// Grouped-query attention (GQA): k and v may have fewer heads than q (dim -3: Hkv < H, H % Hkv
// == 0, both > 1 — a single k/v head is ordinary broadcasting and means the same); query head h
// attends with key/value head h / (H / Hkv), as torch's scaled_dot_product_attention(...,
// enable_gqa=True). The composite path expands k and v over each group (their gradients sum over
// the group); the fused kernels read the shared head in place.
// Depends on ops/linalg, ops/nn (rotary_embedding), ops/elementwise (ops/factory, ops/view for the mask).
// Keep: the same semantics as torch.nn.functional.scaled_dot_product_attention (default scale
// 1/sqrt(head_dim); is_causal masks key j from query i when j > i, aligned top-left).
#pragma once
#include "blu/core/tensor.h"

namespace blu {

// q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] → [..., Tq, Dv]. scale <= 0 means 1/sqrt(D).
// GQA: q [..., H, Tq, D], k [..., Hkv, Tk, D], v [..., Hkv, Tk, Dv] with H % Hkv == 0 and the
// leading dims equal.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                                    double scale = 0.0);

// RoPE, then attention, on the heads of one fused q/k/v projection: qkv [B, T, H + 2·Hkv, D] holds
// the H query heads, then the Hkv key heads and the Hkv value heads; cos, sin [T, D] are RoPE's
// tables. The same as rotary_embedding(qkv, cos, sin, H + Hkv) split into its head ranges and
// scaled_dot_product_attention(q, k, v, causal) on their [B, heads, T, D] views (default scale);
// returns [B, H, T, D]. On CUDA, where flash attention takes the heads and the tables are f32
// [T, D], the two are one autograd node whose backward writes qkv's gradient itself (dQ and dK
// rotated back by the wgmma backward while they are still fp32: Note [RoPE in the dQ cast],
// backend/cuda/flash_attention_wgmma_backward.cu) instead of attention's gradient followed by a
// pass of RoPE's backward over all of it; elsewhere (or with BLU_ROTARY_ATTENTION=0 in the
// environment) it is that composition.
Tensor rotary_attention(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t H, int64_t Hkv,
                        bool causal = true);

}  // namespace blu
