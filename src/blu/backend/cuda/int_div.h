// backend/cuda/int_div: division by a run-time constant as a multiply-high and a shift, for
// index→offset maps (integer division is slow on the GPU). Host and device; plain C++ compiles it
// too, so host tests check it against `/`.
// Depends on nothing. Keep: exact for every n, d in [1, 2^31) (n may be 0).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define BLU_HD __host__ __device__
#else
#define BLU_HD
#endif

namespace blu::cuda {

// n / d for n, d < 2^31 by a multiply-high and a shift (round-up magic number method):
// s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, n / d = (mulhi(n, m) + n) >> s.
struct Div32 {
  uint32_t d = 1, m = 1, s = 0;
  Div32() = default;
  explicit Div32(uint32_t divisor) : d(divisor) {
    s = 0;
    while ((uint64_t(1) << s) < divisor) ++s;
    m = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << s) - divisor)) / divisor + 1);
  }
  BLU_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, m);
#else
    const uint32_t t = uint32_t((uint64_t(n) * m) >> 32);
#endif
    return (t + n) >> s;
  }
};

}  // namespace blu::cuda
