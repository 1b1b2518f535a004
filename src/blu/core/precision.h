// core/precision: process-wide numeric settings the backends read, in the spirit of
// torch.set_float32_matmul_precision. "ieee" (the default) makes f32 matrix products exact fp32
// (fp32 inputs, fp32 products and sums); "tf32" lets an accelerator round f32 inputs to TF32
// (10-bit mantissa) inside its tensor cores while still accumulating in fp32. Readers: the CUDA
// GEMMs (cuBLASLt compute type) and the CUDA f32 flash attention, which under "ieee" runs on
// tensor cores as 3xTF32 (each operand split into two TF32 parts: fp32-level accuracy, ~1e-6
// relative, not bitwise IEEE — as PyTorch's fp32 attention) and under "tf32" as 1xTF32.
// Depends on nothing. Lives in core/ so that backend/ reads it without including ops/ (ops/precision.h
// re-exports it for callers). Keep: backend-independent — the CPU backend ignores it, and it only ever
// affects f32 operands (f64 stays f64; bf16/f16 always accumulate in fp32).
#pragma once
#include <string_view>

namespace blu {

enum class MatmulPrecision { ieee, tf32 };

// BLU_CHECK: `name` is "ieee" or "tf32" ("highest" and "high" are accepted as PyTorch's names).
void set_matmul_precision(std::string_view name);
void set_matmul_precision(MatmulPrecision p);
MatmulPrecision matmul_precision();
std::string_view matmul_precision_name(MatmulPrecision p);

}  // namespace blu
