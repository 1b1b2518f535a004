// core/dtype: the element types a tensor can hold, their sizes and names, and the two 16-bit
// floating formats (bf16, f16) with conversions that round to nearest-even exactly as PyTorch does.
// Depends on nothing but the standard library. Keep: every DType has a size, a name and a
// C++ scalar type reachable through BLU_DISPATCH_*.
#pragma once
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>

#include "blu/core/error.h"

namespace blu {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, b8 };
inline constexpr int kNumDTypes = 8;

// bf16: the top half of an fp32. Conversion rounds to nearest, ties to even; NaN stays a quiet NaN.
struct bf16 {
  uint16_t bits = 0;
  static constexpr bf16 from_bits(uint16_t b) { bf16 v; v.bits = b; return v; }
  bf16() = default;
  bf16(float f) : bits(round(f)) {}  // NOLINT: implicit like a builtin float type
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t round(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};

// f16: IEEE binary16 with subnormals. Conversion rounds to nearest, ties to even; overflow gives inf.
struct f16 {
  uint16_t bits = 0;
  static constexpr f16 from_bits(uint16_t b) { f16 v; v.bits = b; return v; }
  f16() = default;
  f16(float f) : bits(from_float(f)) {}  // NOLINT
  operator float() const { return to_float(bits); }
  // Branch-free (selects, no early returns), so loops that convert vectorise; checked equal to the
  // step-by-step rounding for all 2^32 float bit patterns.
  static uint16_t from_float(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t abs = x & 0x7fffffffu;
    // Normal results: rebias the exponent 127 -> 15 and round the mantissa 23 -> 10 bits, to nearest
    // even; a carry bumps the exponent.
    uint32_t normal = abs - 0x38000000u;
    normal = (normal + 0xfffu + ((normal >> 13) & 1u)) >> 13;
    // Subnormal results (|f| < 2^-14): in |f| + 0.5 (one rounding, ulp 2^-24) the low mantissa bits
    // are |f| rounded to a multiple of 2^-24, to nearest even — the f16 bits (2^-14 itself: 0x400).
    float a;
    std::memcpy(&a, &abs, 4);
    const float t = a + 0.5f;
    uint32_t tb;
    std::memcpy(&tb, &t, 4);
    uint32_t h = abs < 0x38800000u ? tb - 0x3f000000u : normal;
    h = abs >= 0x477ff000u ? 0x7c00u : h;  // rounds to >= 65520: inf
    h = abs > 0x7f800000u ? 0x7e00u : h;   // NaN: quiet
    return uint16_t(sign | h);
  }
  // Inline, as from_float: the CPU compiler's generated kernels (compiler/codegen/cpu_kernel.cpp),
  // shared objects loaded into the app, include this header and link against nothing of it.
  static float to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t x;
    if (exp == 0x1f) {
      x = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      x = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
      x = sign;
    } else {
      // Subnormal: normalise.
      int e = -1;
      do { ++e; mant <<= 1; } while (!(mant & 0x400u));
      x = sign | uint32_t(112 - e) << 23 | ((mant & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "f32", "bf16", ...
DType dtype_from_name(std::string_view name);  // accepts our names and PyTorch's ("float32", ...)
inline bool is_floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }
inline bool is_integral(DType t) { return !is_floating(t); }
// The type arithmetic between a and b is done in (PyTorch's promotion for same-kind operands).
DType promote(DType a, DType b);
inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };

}  // namespace blu

// BLU_DISPATCH_*(dtype, NAME, body): run `body` with `scalar_t` bound to the C++ type of dtype.
#define BLU_DTYPE_CASE(DT, T, ...) \
  case ::blu::DType::DT: {         \
    using scalar_t = T;            \
    __VA_ARGS__;                   \
    break;                         \
  }
#define BLU_DISPATCH_FLOATING(dtype, name, ...)                                                     \
  switch (dtype) {                                                                                  \
    BLU_DTYPE_CASE(f32, float, __VA_ARGS__)                                                         \
    BLU_DTYPE_CASE(f64, double, __VA_ARGS__)                                                        \
    BLU_DTYPE_CASE(bf16, ::blu::bf16, __VA_ARGS__)                                                  \
    BLU_DTYPE_CASE(f16, ::blu::f16, __VA_ARGS__)                                                    \
    default: BLU_CHECK(false, name, ": expected a floating dtype (f32, f64, bf16, f16), got ", dtype); \
  }
#define BLU_DISPATCH_ALL(dtype, name, ...)                   \
  switch (dtype) {                                           \
    BLU_DTYPE_CASE(f32, float, __VA_ARGS__)                  \
    BLU_DTYPE_CASE(f64, double, __VA_ARGS__)                 \
    BLU_DTYPE_CASE(bf16, ::blu::bf16, __VA_ARGS__)           \
    BLU_DTYPE_CASE(f16, ::blu::f16, __VA_ARGS__)             \
    BLU_DTYPE_CASE(i32, int32_t, __VA_ARGS__)                \
    BLU_DTYPE_CASE(i64, int64_t, __VA_ARGS__)                \
    BLU_DTYPE_CASE(u8, uint8_t, __VA_ARGS__)                 \
    BLU_DTYPE_CASE(b8, bool, __VA_ARGS__)                    \
    default: BLU_ASSERT(false, name, ": unknown dtype");     \
  }
#define BLU_DISPATCH_INDEX(dtype, name, ...)                                                \
  switch (dtype) {                                                                          \
    BLU_DTYPE_CASE(i32, int32_t, __VA_ARGS__)                                               \
    BLU_DTYPE_CASE(i64, int64_t, __VA_ARGS__)                                               \
    default: BLU_CHECK(false, name, ": expected an index dtype (i32 or i64), got ", dtype); \
  }
