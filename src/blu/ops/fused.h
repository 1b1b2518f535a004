// ops/fused: compositions that exist to save memory or traffic, each one autograd node with its
// own backward. Depends on ops/dispatch and the ops it composes.
//   gelu_linear(u, w, b[, residual]) = linear(gelu_tanh(u), w, b, residual), saving u (and w) but
//   not gelu(u): the backward recomputes gelu(u). In a transformer MLP this drops the 4·C-wide
//   GELU output from the saved activations (the pre-activation u is kept once for both GELU and
//   the projection); the residual is the block's skip connection, added by the same GEMM.
//   linear_cross_entropy(x, w, target) = cross_entropy(linear(x, w), target), mean over the rows,
//   without the logits: Note [Chunked loss].
// Keep: results and gradients equal the unfused composition (tested by the op table).
#pragma once
#include <cstdint>

#include "blu/core/tensor.h"

namespace blu {

Tensor gelu_linear(const Tensor& u, const Tensor& w, const Tensor& bias = Tensor(), const Tensor& residual = Tensor());

// Note [Chunked loss]
// A language model's head makes logits [N, V] — for GPT-2 124M at B=16, T=1024 a 1.5 GiB bf16
// buffer, the largest of the step, alive from the head's forward to cross-entropy's backward, so
// at the step's peak. linear_cross_entropy never holds them whole: it runs the rows in `chunks`
// pieces, and for each piece makes its logits, its rows' losses and logsumexps, and at once the
// gradient of the mean loss with respect to those logits (written over them), which two GEMMs turn
// into the piece's rows of x's gradient and its share of w's (accumulated in fp32 for 16-bit
// weights, as the unchunked GEMM accumulates). The piece's logits are then dropped. What lives to
// the backward is x's gradient [N, C] and w's [V, C], which the backward scales by the loss's
// incoming gradient (a 16-bit x's through fp32; nothing to scale when that is backward()'s own
// seed, exactly 1: BackwardContext::grad_is_one): the same arithmetic as the unchunked head but
// for the order of the w-gradient's sums (chunk by chunk) and that scaling, done after the
// rounding to x's dtype instead of before. No GEMM is added: the backward's two are done in the
// forward. Without autograd (no grad mode, or neither x nor w requiring one) only the losses are
// computed, piece by piece.
// x [N, C], w [V', C] of one floating dtype; target [N] i32/i64; only the first num_classes (-1:
// V') of w's rows are classes (GPT-2's padded vocabulary); rows whose target is ignore_index count
// for nothing (a mean over no row is 0). Returns the 0-d loss in the statistics dtype (f32, f64
// for f64). chunks ≥ 1 (at most N pieces are made).
Tensor linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& target, int64_t ignore_index,
                            int64_t num_classes, int64_t chunks);

}  // namespace blu
