// core/round_stochastic: fp32 → bf16 rounded stochastically, with the random bits drawn from a hash
// of the value itself and a key (Note [Stochastic bf16 moments]), for AdamW's bf16 moments in the
// CPU update kernel; backend/cuda/round16.cuh has the device's same functions.
// Depends on nothing but the standard library. Keep: bit for bit what round16.cuh computes.
#pragma once
#include <cstdint>
#include <cstring>

namespace blu {

// Note [Stochastic bf16 moments]
// AdamW may hold its two moments in bf16 (optim::AdamWOptions::state_dtype). The update widens them
// to fp32, computes exactly what it computes with fp32 moments (the parameter's step uses the
// unrounded fp32 moments), and stores them back rounded stochastically: the fp32 bit pattern plus a
// 16-bit r in [0, 65536), cut to its top half. The magnitude goes up to the next bf16 with
// probability (distance from the one below) / (gap), so E[round(x)] = x. Rounding to nearest would
// stall the second moment: with beta2 = 0.999 one step moves v by 0.1% of itself, under half of
// bf16's spacing (0.2-0.4% of the value), so v could neither decay nor grow once it settles.
// r is a hash of x's own bits and a key made from the step count, the moment (0: exp_avg,
// 1: exp_avg_sq) and the bits of the parameter's updated value (sr_element_key), not of the
// element's position. So an element rounds the same wherever it is held (a ZeRO shard, a compiled
// region, the CPU or a GPU), a resumed run rounds as the unbroken one does, from one step to the
// next the bits are decorrelated by the step, and elements whose moments meet on one bf16 value
// (a gradient of 0 leaves v to decay alone) part again by their parameters. NaN gives the quiet
// NaN the nearest-even cast gives (0x7fc0); infinities stay infinite (r never carries out of the
// exponent of an infinity), and a finite value past bf16's largest may round up to infinity.
inline uint32_t sr_mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// The key of one step's rounding of one moment, and of one element: the parameter's new value p.
inline uint32_t sr_key(int64_t step, uint32_t moment) { return sr_mix(uint32_t(step) * 2u + moment); }
inline uint32_t sr_element_key(uint32_t key, float p) {
  uint32_t u;
  std::memcpy(&u, &p, 4);
  return key ^ sr_mix(u + 0x9e3779b9u);
}
inline uint16_t bf16_bits_sr(float x, uint32_t key) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + (sr_mix(u ^ key) & 0xffffu)) >> 16);  // the magnitude grows: the sign never carries
}

}  // namespace blu
