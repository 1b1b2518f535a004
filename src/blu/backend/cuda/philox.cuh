// backend/cuda/philox: Philox-4x32-10 and the uniform/normal transforms of core/rng.h written
// once for host and device, so CUDA random kernels draw what the CPU kernels draw.
// Depends on nothing (compiles as plain C++ too, for host-side tests). Keep: bit for bit equal to
// blu::Philox::block and to the CPU kernels' transforms in backend/cpu/elementwise.cpp.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define BLU_PHILOX_HD __host__ __device__ __forceinline__
#else
#define BLU_PHILOX_HD inline
#endif

namespace blu::cuda {

struct PhiloxOut {
  uint32_t v[4];
};

// Key = seed, counter = (counter, 0): the block element i of a draw at `offset` uses is
// offset + i/4, lane i%4.
BLU_PHILOX_HD PhiloxOut philox_block(uint64_t seed, uint64_t counter) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = uint32_t(p1);
    c2 = n2;
    c3 = uint32_t(p0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return PhiloxOut{{c0, c1, c2, c3}};
}

// [0, 1) from the top `bits` bits (Philox::uniform).
BLU_PHILOX_HD float philox_uniform(uint32_t u, int bits) {
  return float(u >> (32 - bits)) * (1.0f / float(1u << bits));
}

// Box–Muller on the lane pair (0,1) or (2,3) of one block: cos for the even lane, sin for the odd.
// log, sin and cos are taken in double and rounded once to float: glibc's float versions are not
// correctly rounded and CUDA's differ from them, while these roundings agree on every possible
// input (tests/cuda checks that each double result lies far from a float rounding boundary).
BLU_PHILOX_HD float philox_normal(const PhiloxOut& r, int lane) {
  const int pair = lane & ~1;
  const float u1 = 1.0f - philox_uniform(r.v[pair], 24);  // (0, 1]
  const float u2 = philox_uniform(r.v[pair + 1], 24);
  const float lg = float(::log(double(u1)));
  const float rad = ::sqrtf(-2.0f * lg);
  const float ang = 6.28318548202514648438f * u2;  // 2 * float(pi), exact
  const float sc = float((lane & 1) ? ::sin(double(ang)) : ::cos(double(ang)));
  return rad * sc;
}

}  // namespace blu::cuda
