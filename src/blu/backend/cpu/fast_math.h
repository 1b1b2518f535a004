// backend/cpu/fast_math: float exp and tanh written as arithmetic the compiler vectorises (no libm
// call per element), for the loops where a libm call per element dominated the CPU step: GELU's
// tanh form (backend/cpu/elementwise.cpp) and softmax (backend/cpu/nn.cpp).
// Note [Vectorisable tanh]: measured on gpt2:demo-byte's CPU step (B 16, T 64), GELU's forward and
// backward took 55% of it with std::tanh. Here e^y = 2^n e^r, n = round(y / ln 2), r = y - n ln 2
// (ln 2 in two parts, so r is exact) and e^r by its Taylor series to r^7 (|r| <= ln2/2: below 3e-9
// relative); tanh(x) is the odd Taylor series to x^13 for |x| < 0.4 (the next term is below 2e-9
// relative), else sign(x) (1 - 2 / (e^(2|x|) + 1)). Measured within 2 float ulp of tanh in double
// over every third float in [-20, 20]. double keeps libm (the gradchecks' oracle).
// The compiler's CPU kernels include this header (compiler/codegen/cpu_kernel.cpp), so that a
// compiled step stays bitwise the eager one.
// Depends on nothing. Keep: branch-free (selects, not ifs) and inlined, or the loops stay scalar;
// the sources that use them build with -fno-trapping-math (CMakeLists.txt) for the same reason;
// bump kFastMathVersion with any change of the arithmetic (it is part of the compiled kernels'
// cache key).
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

namespace blu::cpu {

inline constexpr int kFastMathVersion = 1;

// e^y in float: values below e^-86.6 (2.4e-38, the bottom of float's normal range) flush to 0,
// inf above 88.72 (float's largest e^y), NaN kept.
[[gnu::always_inline]] inline float exp_arith(float y) {
  float c = y > -86.6f ? y : -86.6f;  // NaN goes to the bound here and is returned below
  c = c < 88.72f ? c : 88.72f;
  const float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (c * 1.44269504088896341f + kMagic) - kMagic;  // in [-125, 128]
  const float r = (c - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  const float p =
      1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720 + r * (1.f / 5040)))))));
  const float v = (2.f * p) * std::bit_cast<float>((int32_t(n) + 126) << 23);  // 2^n as 2 * 2^(n-1)
  return y > -86.6f ? (y < 88.72f ? v : INFINITY) : (y == y ? 0.f : y);
}

[[gnu::always_inline]] inline float tanh_arith(float x) {
  const float a = std::fabs(x), x2 = x * x;
  const float small =
      x + x * x2 *
              (-1.f / 3 + x2 * (2.f / 15 + x2 * (-17.f / 315 + x2 * (62.f / 2835 + x2 * (-1382.f / 155925 +
                                                                                        x2 * (21844.f / 6081075))))));
  const float e = exp_arith(2.f * (a < 44.f ? a : 44.f));
  const float big = std::copysign(1.f - 2.f / (e + 1.f), x);
  return a < 0.4f ? small : (x == x ? big : x);
}

}  // namespace blu::cpu
