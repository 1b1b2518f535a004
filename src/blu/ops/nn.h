// ops/nn: the neural-network functions — softmax, log_softmax, cross-entropy, layer norm,
// embedding, dropout, and the Llama family's RMSNorm, rotary position embedding, SiLU and SwiGLU
// — each a dedicated kernel with its own backward (they are the hot ops of transformer training).
// Depends on ops/dispatch. Keep: numerics as torch.nn.functional.
#pragma once
#include "blu/core/reduction.h"  // Reduction, re-exported for callers
#include "blu/core/rng.h"
#include "blu/core/tensor.h"

namespace blu {

// The dtype the statistics of a floating tensor are kept in (a cross-entropy's logsumexp, a norm's
// mean and rstd): f64 for f64, f32 otherwise (16-bit inputs compute in f32).
inline DType stats_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// logits [N, C] (or [C]), target [N] (or 0-d) of i32/i64 class ids. Entries equal to
// ignore_index contribute nothing; `mean` divides by the number of non-ignored targets.
// Targets outside [0, C) (other than ignore_index) are a BLU_CHECK error. num_classes K (1 ≤ K ≤ C,
// -1 means C) makes only the first K columns of each row classes: the softmax runs over those, the
// other columns get a zero gradient and targets must lie in [0, K) — the same as
// cross_entropy(narrow(logits, -1, 0, K), ...) without copying the narrowed logits (GPT-2's
// padded vocabulary).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean, int64_t num_classes = -1);

// The cross-entropy's kernels on a shard of the classes, for a vocabulary-parallel loss
// (dist/tensor_parallel.h combines the shards). logits [N, C] hold the classes [class_offset,
// class_offset + classes) of a vocabulary of `vocab` in their first `classes` columns; target [N]
// indexes the whole vocabulary (ignore_index rows are ignored, others outside [0, vocab) are a
// BLU_CHECK error on the CPU, NaN on a GPU). Not differentiable. Both outputs [N] in the statistics
// dtype (fp32; f64 for f64 logits): lse, the logsumexp over the shard's classes; row_loss, lse minus
// the target's logit where the shard holds the target, else 0.
struct CrossEntropyShard {
  Tensor row_loss, lse;
};
CrossEntropyShard cross_entropy_shard(const Tensor& logits, const Tensor& target, int64_t classes,
                                      int64_t class_offset, int64_t vocab, int64_t ignore_index);
// The gradient of Σ_n grad_rows[n]·loss[n] with respect to the shard's logits, given lse [N], the
// logsumexp over the whole vocabulary: (exp(logits − lse) − one-hot)·grad_rows[n] on the classes,
// zero on the columns past them and on ignored rows; in the logits' dtype. grad_rows and lse in the
// statistics dtype. `overwrite`: written over the logits (contiguous, referred to by nothing else),
// which are returned.
Tensor cross_entropy_shard_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                    const Tensor& grad_rows, int64_t classes, int64_t class_offset, int64_t vocab,
                                    int64_t ignore_index, bool overwrite);

// Normalises over the last dim; weight and bias ([C]) may be undefined.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);

// weight[V, C] rows picked by indices (i32/i64, any shape) → [..., C]. The gradient accumulates
// rows of repeated indices. Indices outside [0, V) are a BLU_CHECK error naming the bad index.
Tensor embedding(const Tensor& weight, const Tensor& indices);
// In place: grad_weight[indices[j]] += scale · grad_out[j] for every position j — embedding's
// backward added into an existing gradient (grad_weight [V, C] contiguous, grad_out [indices..., C]
// of its dtype). Each row's contributions are summed in position order in the accumulation type,
// scaled, and added once: deterministic. Not differentiable (DDP's embedding row exchange).
const Tensor& embedding_backward_add_(const Tensor& grad_weight, const Tensor& grad_out, const Tensor& indices,
                                      double scale = 1.0);
// The same into a window of a larger table: grad_window [R, C] holds rows [first_row, first_row + R),
// so grad_window[indices[j] - first_row] += scale · grad_out[j] for the indices inside the window;
// the others (another rank's rows: ZeRO-2's row exchange) are skipped.
const Tensor& embedding_backward_add_window_(const Tensor& grad_window, const Tensor& grad_out, const Tensor& indices,
                                             int64_t first_row, double scale = 1.0);

// Zeroes each element with probability p and scales the rest by 1/(1-p); identity when
// !training or p == 0. The mask comes from Philox (seed, offset) drawn from `gen`.
Tensor dropout(const Tensor& x, double p, bool training = true, Generator* gen = nullptr);

// --- the Llama family's ops (ops/norm_rotary.cpp, ops/swiglu.cpp) ---

// y = weight * x / sqrt(mean(x², last dim) + eps). x [..., C] floating, weight [C] of x's dtype
// (undefined: no weight). Statistics in fp32 (f64 for f64 inputs), output in x's dtype (bf16/f16
// rounded once). The weight's gradient comes out in fp32 for the 16-bit cast of an fp32 master
// weight (Note [Wide gradients], ops/dispatch.h).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-5);
// Rotary position embedding, Hugging Face's rotate-half layout: y = x·cos + rotate_half(x)·sin with
// rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). x [B, T, H, D] (D even), cos/sin [T, D] (f32, or
// x's dtype; the caller already selected the rows for the positions), computed in fp32 (f64 for f64
// x) and rounded once to x's dtype. Output contiguous [B, T, H, D]. Differentiable in x only. x may
// be any view with unit stride along D (a head slice of a fused qkv projection): read in place.
// rotate ≥ 0: only heads [0, rotate) are rotated, the others copied unchanged (a GQA model's packed
// [B, T, H + 2·Hkv, D] q/k/v projection with rotate = H + Hkv: q and k rotated and v beside them in
// the one buffer attention reads, whose gradient comes back the same way); -1: every head.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t rotate = -1);
Tensor silu(const Tensor& x);                          // x·sigmoid(x)
// silu(gate)·up, same shapes, computed in fp32 and rounded once. gate and up may be row-strided
// views (unit stride along the last dim), e.g. the two halves of one [N, 2I] projection taken
// with split/chunk: then the backward writes both gradients side by side into one [N, 2I] buffer
// and split's backward joins them as a view (no cat). The backward recomputes silu(gate).
Tensor swiglu(const Tensor& gate, const Tensor& up);

}  // namespace blu
