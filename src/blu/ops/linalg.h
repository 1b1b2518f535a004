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
// x[..., in] · w[out, in]ᵀ + bias[out] (bias may be undefined), as torch.nn.functional.linear;
// plus `residual` (shape [..., out], optional) in the same pass — residual + linear(x, w, bias)
// with one rounding (CUDA: the GEMM reads it as C with beta = 1), a transformer's residual add.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(), const Tensor& residual = Tensor());
// linear's weight and bias gradients in one op: {gᵀ·x, Σ_rows g} for g[R, out], x[R, in]
// (CUDA: one GEMM with the bias-gradient epilogue). Differentiable.
std::vector<Tensor> linear_weight_grad(const Tensor& g, const Tensor& x);
// The same products written into given tensors: gw = gᵀ·x and, when gb is defined, gb = Σ_rows g.
// Each output is in g's dtype or, for a 16-bit g, in f32 — the fp32 accumulation stored unrounded
// (how backward formulas hand an fp32 master weight its gradient: Note [Wide gradients]).
// `accumulate`: gw += gᵀ·x instead (CUDA: the GEMM reads gw as C with beta = 1; no bias gradient
// then). Not differentiable (backward formulas call it under no-grad).
void linear_weight_grad_into(const Tensor& gw, const Tensor& g, const Tensor& x, const Tensor& gb = Tensor(),
                             bool accumulate = false);

}  // namespace blu
