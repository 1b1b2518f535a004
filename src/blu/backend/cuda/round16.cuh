// backend/cuda/round16: float → bf16 / f16 bits exactly as core/dtype.h rounds on the CPU (nearest
// even; a NaN becomes the CPU's quiet NaN, where the intrinsics alone would differ), for the
// kernels that must match the CPU's casts bit for bit (copy.cu, optim.cu).
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

}  // namespace blu::cuda
