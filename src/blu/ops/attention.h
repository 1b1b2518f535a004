// ops/attention: scaled dot-product attention. The CPU reference here is the plain form
// (softmax(q·kᵀ·scale + causal mask)·v written in other ops, so its gradient is automatic); the
// CUDA backend supplies a fused flash-attention kernel for the same call: on a CUDA device with
// q, k, v of one shape [B, H, T, D] (D 64 or 128; f32, bf16 or f16) it dispatches the
// "flash_attention" op (backend/cuda/flash_attention.h), which never materialises the T x T scores;
// anything else takes the composite path after a one-time log line naming the reason. The fused
// result is a [B, H, T, D] view of a [B, T, H, D] buffer (so merging the heads afterwards is free).
// Depends on ops/linalg, ops/nn, ops/elementwise (ops/factory, ops/view for the mask).
// Keep: the same semantics as torch.nn.functional.scaled_dot_product_attention (default scale
// 1/sqrt(head_dim); is_causal masks key j from query i when j > i, aligned top-left).
#pragma once
#include "blu/core/tensor.h"

namespace blu {

// q [..., Tq, D], k [..., Tk, D], v [..., Tk, Dv] → [..., Tq, Dv]. scale <= 0 means 1/sqrt(D).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true,
                                    double scale = 0.0);

}  // namespace blu
