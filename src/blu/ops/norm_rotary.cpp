// ops/norm_rotary: OpDefs of the Llama family's RMSNorm and rotary position embedding (declared in
// ops/nn.h), each with a dedicated backward op that has no backward of its own (no double
// backward through these). RMSNorm saves x, the weight and the per-row rstd; rotary saves only
// cos and sin (its backward is the transposed rotation of the gradient).
// Keep: statistics in the stat dtype (f32, f64 for f64); outputs rounded once to x's dtype.
#include <cstdint>

#include "blu/ops/dispatch.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// --- rms_norm --------------------------------------------------------------------------------
// Inputs (x [..., C] contiguous, weight [C] contiguous or undefined); attr eps.
// Outputs: y, and rstd = 1/sqrt(mean(x²) + eps) of shape x.shape[:-1] in the stat dtype (not
// differentiable, saved for backward).
std::vector<TensorMeta> infer_rms_norm(std::span<const Tensor> in, const Attrs& a) {
  const Tensor &x = in[0], &w = in[1];
  BLU_CHECK(is_floating(x.dtype()), "rms_norm: expected an input of a floating dtype (f32, f64, bf16, f16), got ",
            x.dtype());
  BLU_CHECK(x.dim() >= 1, "rms_norm: expected an input with at least one dim, got a 0-d tensor");
  BLU_CHECK(a.f("eps") >= 0, "rms_norm: expected eps >= 0, got ", a.f("eps"));
  const int64_t C = x.shape().back();
  if (w.defined()) {
    BLU_CHECK(w.shape() == Shape{C}, "rms_norm: expected weight of shape [", C, "] for input ", x.shape(), ", got ",
              w.shape());
    BLU_CHECK(w.dtype() == x.dtype(), "rms_norm: weight dtype ", w.dtype(), " differs from input dtype ", x.dtype());
  }
  const Shape rows(x.shape().begin(), x.shape().end() - 1);
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, TensorMeta{rows, stats_dtype(x.dtype()), x.device()}};
}
// Inputs (grad, x, weight or undefined, rstd[, pending]), grad and x contiguous; outputs grad_x and
// grad_weight. pending (x's shape and dtype, contiguous): added into grad_x after grad_x is rounded
// to x's dtype, the sum rounded again (Note [Folded gradient sums]). Attr param_dtype (optional):
// f32 for grad_weight under a 16-bit x (Note [Wide gradients]).
std::vector<TensorMeta> infer_rms_norm_backward(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& x = in[1];
  const DType pd = a.has("param_dtype") ? a.get<DType>("param_dtype") : x.dtype();
  BLU_ASSERT(pd == x.dtype() || (pd == DType::f32 && (x.dtype() == DType::bf16 || x.dtype() == DType::f16)),
             "rms_norm_backward: weight gradient in ", pd, " for input ", x.str());
  BLU_ASSERT(in[0].shape() == x.shape() && in[0].is_contiguous() && x.is_contiguous(), "rms_norm_backward: grad ",
             in[0].str(), " for input ", x.str());
  check_pending_grad("rms_norm_backward", in, 4, x);
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, TensorMeta{Shape{x.shape().back()}, pd, x.device()}};
}
const OpDef kRmsNormBackward{
    .name = "rms_norm_backward", .infer = infer_rms_norm_backward, .optional_inputs = 0b10100};

std::vector<Tensor> rms_norm_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor w = c.inputs.at(1);  // undefined when the call had no weight
  const DType xd = c.input_metas[0].dtype;
  // The weight's gradient in fp32 when asked for (its column sums are fp32 anyway).
  Attrs attrs;
  if (c.needs_grad[1] && c.grad_dtype(1) != xd) attrs = Attrs{{"param_dtype", DType::f32}};
  std::vector<Tensor> in = {contiguous(g[0]), c.input(0), w, c.output(1)};
  c.take_pending_grad(0, in);
  auto gs = dispatch(kRmsNormBackward, std::move(in), attrs);
  Tensor gw;
  if (c.needs_grad[1]) gw = gs[1].dtype() == c.grad_dtype(1) ? gs[1] : to_dtype(gs[1], c.grad_dtype(1));
  return {c.needs_grad[0] ? gs[0] : Tensor(), gw};
}
const OpDef kRmsNorm{.name = "rms_norm",
                     .infer = infer_rms_norm,
                     .shard = shard_rule_last_dim_norm,
                     .backward = rms_norm_bw,
                     .save_inputs = 0b11,
                     .save_outputs = 0b10,
                     .diff_outputs = 1,
                     .optional_inputs = 0b10,
                     .wide_grads = 0b10,
                     .folds_grads = 0b1};

// --- rotary_embedding ------------------------------------------------------------------------
// Inputs (x [B, T, H, D] with unit stride along D, any other strides; cos, sin [T, D] contiguous,
// f32 or x's dtype). Output: y [B, T, H, D] contiguous, pairs (j, j + D/2) rotated:
//   y[j] = x[j]·cos[j] − x[j+D/2]·sin[j],   y[j+D/2] = x[j+D/2]·cos[j+D/2] + x[j]·sin[j+D/2].
// The backward op takes the same inputs with the gradient in x's place and applies the
// transposed rotation:
//   dx[j] = g[j]·cos[j] + g[j+D/2]·sin[j+D/2],   dx[j+D/2] = g[j+D/2]·cos[j+D/2] − g[j]·sin[j].
// Attr "rotate" (absent: every head): heads h ≥ rotate are copied unchanged, both ways.
std::vector<TensorMeta> infer_rotary(const char* op, std::span<const Tensor> in, const Attrs& a) {
  const Tensor &x = in[0], &cos = in[1], &sin = in[2];
  BLU_CHECK(is_floating(x.dtype()), op, ": expected x of a floating dtype (f32, f64, bf16, f16), got ", x.dtype());
  BLU_CHECK(x.dim() == 4, op, ": expected x [B, T, H, D], got ", x.shape());
  const int64_t T = x.size(1), D = x.size(3);
  BLU_CHECK(D % 2 == 0, op, ": expected an even head dim D, got x ", x.shape());
  for (const Tensor* t : {&cos, &sin}) {
    const char* what = t == &cos ? "cos" : "sin";
    BLU_CHECK(t->shape() == Shape({T, D}), op, ": expected ", what, " of shape [", T, ", ", D, "] (T and D of x ",
              x.shape(), "), got ", t->shape());
    BLU_CHECK(t->dtype() == DType::f32 || t->dtype() == x.dtype(), op, ": expected ", what, " in f32 or in x's dtype ",
              x.dtype(), ", got ", t->dtype());
  }
  BLU_CHECK(cos.dtype() == sin.dtype(), op, ": cos (", cos.dtype(), ") and sin (", sin.dtype(),
            ") must share a dtype");
  BLU_ASSERT(cos.is_contiguous() && sin.is_contiguous() && (x.stride(3) == 1 || D <= 1), op, ": layouts x ",
             x.str(), ", cos ", cos.str(), ", sin ", sin.str());
  if (a.has("rotate"))
    BLU_CHECK(a.i("rotate") >= 0 && a.i("rotate") <= x.size(2), op, ": expected 0 <= rotate <= H = ", x.size(2),
              " (x ", x.shape(), "), got ", a.i("rotate"));
  return {TensorMeta{x.shape(), x.dtype(), x.device()}};
}
std::vector<TensorMeta> infer_rotary_embedding(std::span<const Tensor> in, const Attrs& a) {
  return infer_rotary("rotary_embedding", in, a);
}
std::vector<TensorMeta> infer_rotary_embedding_backward(std::span<const Tensor> in, const Attrs& a) {
  return infer_rotary("rotary_embedding_backward", in, a);
}
const OpDef kRotaryBackward{.name = "rotary_embedding_backward", .infer = infer_rotary_embedding_backward};

// The layout the kernels take: unit stride along D (other strides free); anything else is copied.
Tensor rotary_ready(const Tensor& x) { return x.dim() == 4 && x.stride(3) == 1 ? x : contiguous(x); }

std::vector<Tensor> rotary_bw(const BackwardContext& c, std::span<const Tensor> g) {
  if (!c.needs_grad[0]) return {Tensor(), Tensor(), Tensor()};
  return {dispatch1(kRotaryBackward, {rotary_ready(g[0]), c.input(1), c.input(2)}, c.attrs), Tensor(), Tensor()};
}
const OpDef kRotary{
    .name = "rotary_embedding", .infer = infer_rotary_embedding, .backward = rotary_bw, .save_inputs = 0b110};

}  // namespace

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  BLU_CHECK(x.defined(), "rms_norm: input must be defined");
  return dispatch(kRmsNorm, {contiguous(x), weight.defined() ? contiguous(weight) : weight}, Attrs{{"eps", eps}})[0];
}

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t rotate) {
  BLU_CHECK(x.defined() && cos.defined() && sin.defined(), "rotary_embedding: x, cos and sin must be defined");
  BLU_CHECK(x.dim() == 4, "rotary_embedding: expected x [B, T, H, D], got ", x.shape());
  BLU_CHECK(rotate >= -1 && rotate <= x.size(2), "rotary_embedding: expected rotate in [0, H = ", x.size(2),
            "] or -1 (every head), got ", rotate);
  Attrs a;
  if (rotate >= 0 && rotate < x.size(2)) a.set("rotate", rotate);  // every head: no attribute
  return dispatch1(kRotary, {rotary_ready(x), contiguous(cos), contiguous(sin)}, a);
}

}  // namespace blu
