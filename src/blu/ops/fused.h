// ops/fused: compositions that exist to save memory or traffic, each one autograd node with its
// own backward. Depends on ops/dispatch and the ops it composes.
//   gelu_linear(u, w, b[, residual]) = linear(gelu_tanh(u), w, b, residual), saving u (and w) but
//   not gelu(u): the backward recomputes gelu(u). In a transformer MLP this drops the 4·C-wide
//   GELU output from the saved activations (the pre-activation u is kept once for both GELU and
//   the projection); the residual is the block's skip connection, added by the same GEMM.
// Keep: results and gradients equal the unfused composition (tested by the op table).
#pragma once
#include "blu/core/tensor.h"

namespace blu {

Tensor gelu_linear(const Tensor& u, const Tensor& w, const Tensor& bias = Tensor(), const Tensor& residual = Tensor());

}  // namespace blu
