#include "blu/core/dtype.h"

#include <array>

namespace blu {

uint16_t f16::from_float(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN: quiet
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero) in f16: value = abs * 2^24 rounded to an integer, RNE.
    if (abs < 0x33000000u) return uint16_t(sign);  // < 2^-25: rounds to zero (2^-25 ties to even 0)
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // mantissa (24 bits) * 2^(exp-127-23) * 2^24 → shift right by 126-exp
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  // Normal: rebias exponent 127 → 15, round mantissa 23 → 10 bits, RNE; a carry bumps the exponent.
  uint32_t r = abs - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

float f16::to_float(uint16_t h) {
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

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::bf16: case DType::f16: return 2;
    case DType::u8: case DType::b8: return 1;
  }
  BLU_ASSERT(false, "unknown dtype ", int(t));
}

std::string_view dtype_name(DType t) {
  static constexpr std::array<std::string_view, kNumDTypes> names = {"f32", "f64", "bf16", "f16",
                                                                      "i32", "i64", "u8",   "bool"};
  BLU_ASSERT(int(t) < kNumDTypes, "unknown dtype ", int(t));
  return names[int(t)];
}

DType dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "float" || n == "F32") return DType::f32;
  if (n == "f64" || n == "float64" || n == "double" || n == "F64") return DType::f64;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::bf16;
  if (n == "f16" || n == "float16" || n == "half" || n == "F16") return DType::f16;
  if (n == "i32" || n == "int32" || n == "I32") return DType::i32;
  if (n == "i64" || n == "int64" || n == "long" || n == "I64") return DType::i64;
  if (n == "u8" || n == "uint8" || n == "U8") return DType::u8;
  if (n == "bool" || n == "b8" || n == "BOOL") return DType::b8;
  BLU_CHECK(false, "unknown dtype name '", n, "' (expected one of f32 f64 bf16 f16 i32 i64 u8 bool)");
}

DType promote(DType a, DType b) {
  if (a == b) return a;
  const bool fa = is_floating(a), fb = is_floating(b);
  if (fa != fb) return fa ? a : b;  // float wins over integer
  if (fa) {
    if (a == DType::f64 || b == DType::f64) return DType::f64;
    return DType::f32;  // f32 with a 16-bit type, or bf16 with f16
  }
  if (a == DType::b8) return b;
  if (b == DType::b8) return a;
  if (a == DType::i64 || b == DType::i64) return DType::i64;
  if (a == DType::i32 || b == DType::i32) return DType::i32;
  return DType::u8;
}

}  // namespace blu
