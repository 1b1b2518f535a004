#include "blu/core/dtype.h"

#include <array>

namespace blu {

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
