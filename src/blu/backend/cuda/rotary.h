// backend/cuda/rotary: RoPE's backward on a range of heads of a packed gradient, in place — after
// the attention backwards that do not rotate dQ and dK back themselves (flash_attention_backward
// under RoPE, ops/attention.h's rotary_attention: the f32 and mma.sync kernels), with
// rotary_embedding_backward's arithmetic.
// Depends on core/tensor. Keep: touches only heads [first, first + count) of each row.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "blu/core/tensor.h"

namespace blu::cuda {

// g: a contiguous [B, T, heads, D] (or [B, T, 3, H, D]) buffer of f32, bf16 or f16; heads
// [first, first + count) of each (b, t) row are rotated back by the f32 [T, D] tables cos, sin.
void rotary_backward_heads_in_place(cudaStream_t stream, const Tensor& g, int64_t first, int64_t count,
                                    const Tensor& cos, const Tensor& sin);

}  // namespace blu::cuda
