// backend/cuda/rotary: RoPE's rotation of one pair of a row, for every CUDA kernel that rotates
// (rotary_embedding and its backward, the wgmma flash backward's dQ cast and dK epilogue), and
// RoPE's backward on a range of heads of a packed gradient, in place — after the attention
// backwards that do not rotate dQ and dK back themselves (flash_attention_backward under RoPE,
// ops/attention.h's rotary_attention: the f32 and mma.sync kernels).
// Depends on backend/cuda/loops.cuh (the uncontracted *_rn arithmetic), core/tensor.
// Keep: one formula, so every path rounds as rotary_embedding(_backward) on the CPU does.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "blu/backend/cuda/loops.cuh"
#include "blu/core/tensor.h"

namespace blu::cuda {

// The pair a = x[j], b = x[j + D/2] of a row at position t; c1, s1 the tables at (t, j), c2, s2 at
// (t, j + D/2):
//   forward:   y1 = a·c1 − b·s1,  y2 = b·c2 + a·s2
//   backward:  y1 = a·c1 + b·s2,  y2 = b·c2 − a·s1   (the forward's transpose)
template <bool kBackward, typename A>
__device__ __forceinline__ void rope_pair(A a, A b, A c1, A s1, A c2, A s2, A& y1, A& y2) {
  if constexpr (kBackward) {
    y1 = add_rn(mul_rn(a, c1), mul_rn(b, s2));
    y2 = sub_rn(mul_rn(b, c2), mul_rn(a, s1));
  } else {
    y1 = sub_rn(mul_rn(a, c1), mul_rn(b, s1));
    y2 = add_rn(mul_rn(b, c2), mul_rn(a, s2));
  }
}

// g: a contiguous [B, T, heads, D] (or [B, T, 3, H, D]) buffer of f32, bf16 or f16; heads
// [first, first + count) of each (b, t) row are rotated back by the f32 [T, D] tables cos, sin.
void rotary_backward_heads_in_place(cudaStream_t stream, const Tensor& g, int64_t first, int64_t count,
                                    const Tensor& cos, const Tensor& sin);

}  // namespace blu::cuda
