// core/split_f32: an fp32 value held exactly as two 16-bit halves whose high half is a bf16
// (Note [Split fp32]), for AdamW's split master weights (optim/master_split.h) and the CPU
// update kernel; backend/cuda/round16.cuh has the device's same functions.
// Depends on nothing but the standard library. Keep: bit for bit what round16.cuh computes.
#pragma once
#include <cstdint>
#include <cstring>

namespace blu {

// Note [Split fp32]
// An fp32 x held exactly in two 16-bit halves, so that the high half is also x as a bf16 (AdamW's
// split masters, optim/master_split.h): hi is x rounded to bf16 to nearest with ties away from
// zero, lo the signed difference of the bit patterns, bits(x) - (hi << 16), in [-32768, 32767] as
// an int16 (with ties to even a tie below an even hi would need +32768). bits(x) = (hi << 16) + lo.
// hi differs from bf16(x) (ties to even) only on exact ties, one pattern in 65,536. A NaN keeps
// its top half made quiet, lo 0.
inline void split_f32(float x, uint16_t& hi, uint16_t& lo) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    hi = uint16_t(u >> 16 | 0x40u);
    lo = 0;
    return;
  }
  hi = uint16_t((u + 0x8000u) >> 16);  // the magnitude rounded half up: the sign bit never carries
  lo = uint16_t(u - (uint32_t(hi) << 16));
}
inline float join_f32(uint16_t hi, uint16_t lo) {
  const uint32_t u = (uint32_t(hi) << 16) + uint32_t(int32_t(int16_t(lo)));
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace blu
