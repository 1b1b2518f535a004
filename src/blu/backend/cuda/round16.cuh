// backend/cuda/round16: float → bf16 / f16 bits exactly as core/dtype.h rounds on the CPU (nearest
// even; a NaN becomes the CPU's quiet NaN, where the intrinsics alone would differ), for the
// kernels that must match the CPU's casts bit for bit (copy.cu, optim.cu), and the stochastic
// rounding of AdamW's bf16 moments.
// Depends on the CUDA headers only. Keep: the same bits as bf16::round / f16::from_float.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace blu::cuda {

__device__ __forceinline__ uint16_t bf16_bits_rn(float f) {
  if (f != f) return 0x7fc0;
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ uint16_t f16_bits_rn(float f) {
  if (f != f) return uint16_t((__float_as_uint(f) >> 16 & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(f));
}

// split_f32 / join_f32 of core/split_f32.h (Note [Split fp32]), bit for bit.
__device__ __forceinline__ void split_f32(float x, uint16_t& hi, uint16_t& lo) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    hi = uint16_t(u >> 16 | 0x40u);
    lo = 0;
    return;
  }
  hi = uint16_t((u + 0x8000u) >> 16);
  lo = uint16_t(u - (uint32_t(hi) << 16));
}
__device__ __forceinline__ float join_f32(uint16_t hi, uint16_t lo) {
  return __uint_as_float((uint32_t(hi) << 16) + uint32_t(int32_t(int16_t(lo))));
}

// bf16_bits_sr / sr_element_key of core/round_stochastic.h (Note [Stochastic bf16 moments]), bit for bit.
__device__ __forceinline__ uint32_t sr_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ uint32_t sr_element_key(uint32_t key, float p) {
  return key ^ sr_mix(__float_as_uint(p) + 0x9e3779b9u);
}
__device__ __forceinline__ uint16_t bf16_bits_sr(float f, uint32_t key) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + (sr_mix(u ^ key) & 0xffffu)) >> 16);
}

}  // namespace blu::cuda
