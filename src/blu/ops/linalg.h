// ops/linalg: matrix products. CPU kernels call OpenBLAS (cblas_sgemm/dgemm; the 16-bit types
// go through fp32); the CUDA backend will call cuBLASLt. Depends on ops/dispatch.
// Keep: matmul follows torch.matmul's rules (1-D operands, batched, broadcast batch dims).
#pragma once
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

// torch.matmul semantics: 1-D·1-D dot, 2-D·2-D, batched with broadcast batch dims, 1-D operands
// promoted and the added dim removed. Equal floating dtypes.
Tensor matmul(const Tensor& a, const Tensor& b);
// x[..., in] · w[out, in]ᵀ + bias[out] (bias may be undefined), as torch.nn.functional.linear.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor());
// linear's weight and bias gradients in one op: {gᵀ·x, Σ_rows g} for g[R, out], x[R, in]
// (CUDA: one GEMM with the bias-gradient epilogue). Differentiable.
std::vector<Tensor> linear_weight_grad(const Tensor& g, const Tensor& x);

}  // namespace blu
