// ops/nn: OpDefs of the neural-network functions and their dedicated backward ops. The wrappers
// make inputs contiguous where the kernels index rows directly (softmax, cross-entropy, layer
// norm); the backward ops have no backward of their own (no double backward through these).
#include "blu/ops/nn.h"

#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

namespace blu {

namespace {


void check_floating(const char* op, const char* what, const Tensor& t) {
  BLU_CHECK(is_floating(t.dtype()), op, ": expected ", what, " of a floating dtype (f32, f64, bf16, f16), got ",
            t.dtype());
}
void check_index(const char* op, const char* what, const Tensor& t) {
  BLU_CHECK(t.dtype() == DType::i32 || t.dtype() == DType::i64, op, ": expected ", what,
            " of an index dtype (i32 or i64), got ", t.dtype());
}

// --- softmax / log_softmax -------------------------------------------------------------------
// Attrs: dim (already wrapped; 0 for a 0-d input). Input contiguous.
std::vector<TensorMeta> infer_softmax(std::span<const Tensor> in, const Attrs&) {
  check_floating("softmax", "input", in[0]);
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
// Inputs (grad, output); the gradient of the input.
std::vector<TensorMeta> infer_softmax_backward(std::span<const Tensor> in, const Attrs&) {
  BLU_ASSERT(in[0].shape() == in[1].shape() && in[0].dtype() == in[1].dtype(), "softmax_backward: grad ",
             in[0].str(), " vs output ", in[1].str());
  return {TensorMeta{in[1].shape(), in[1].dtype(), in[1].device()}};
}
const OpDef kSoftmaxBackward{.name = "softmax_backward", .infer = infer_softmax_backward};
const OpDef kLogSoftmaxBackward{.name = "log_softmax_backward", .infer = infer_softmax_backward};

std::vector<Tensor> softmax_bw(const BackwardContext& c, std::span<const Tensor> g) {
  return {dispatch1(kSoftmaxBackward, {contiguous(g[0]), c.output(0)}, Attrs{{"dim", c.attrs.i("dim")}})};
}
std::vector<Tensor> log_softmax_bw(const BackwardContext& c, std::span<const Tensor> g) {
  return {dispatch1(kLogSoftmaxBackward, {contiguous(g[0]), c.output(0)}, Attrs{{"dim", c.attrs.i("dim")}})};
}
const OpDef kSoftmax{.name = "softmax", .infer = infer_softmax, .backward = softmax_bw, .save_outputs = 1};
const OpDef kLogSoftmax{.name = "log_softmax", .infer = infer_softmax, .backward = log_softmax_bw, .save_outputs = 1};

Tensor softmax_like(const OpDef& op, const Tensor& x, int64_t dim) {
  BLU_CHECK(x.defined(), op.name, ": input must be defined");
  return dispatch1(op, {contiguous(x)}, Attrs{{"dim", wrap_dim(dim, x.dim())}});
}

// --- cross_entropy ---------------------------------------------------------------------------
// Inputs (logits [N, C] or [C], target [N] or 0-d); attrs ignore_index, reduction, classes
// (1 ≤ classes ≤ C): only the first `classes` columns of a row are classes (GPT-2's padded
// vocabulary); the rest take no part in the loss and get a zero gradient.
// Outputs: the loss, and the per-row logsumexp [N] (not differentiable, saved for backward),
// both in the statistics dtype — fp32 for fp32/bf16/f16 logits (as PyTorch's autocast computes
// cross-entropy in fp32: a bf16 loss would round to 8 bits), f64 for f64.
std::vector<TensorMeta> infer_cross_entropy(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& x = in[0];
  const Tensor& t = in[1];
  check_floating("cross_entropy", "logits", x);
  check_index("cross_entropy", "target", t);
  BLU_CHECK(x.dim() == 1 || x.dim() == 2, "cross_entropy: expected logits [N, C] or [C], got ", x.shape());
  BLU_CHECK(x.shape().back() > 0, "cross_entropy: expected at least one class, got logits ", x.shape());
  if (x.dim() == 2) {
    BLU_CHECK(t.dim() == 1 && t.shape()[0] == x.shape()[0], "cross_entropy: logits ", x.shape(),
              " need a target of shape [", x.shape()[0], "], got ", t.shape());
  } else {
    BLU_CHECK(t.dim() == 0, "cross_entropy: logits ", x.shape(), " need a 0-d target, got ", t.shape());
  }
  const int64_t k = a.i("classes");
  BLU_CHECK(k >= 1 && k <= x.shape().back(), "cross_entropy: expected num_classes in [1, ", x.shape().back(),
            "] (the logits' last dim) or -1, got ", k);
  const Shape rows = x.dim() == 2 ? Shape{x.shape()[0]} : Shape{};
  const auto red = Reduction(a.i("reduction"));
  return {TensorMeta{red == Reduction::none ? rows : Shape{}, stats_dtype(x.dtype()), x.device()},
          TensorMeta{rows, stats_dtype(x.dtype()), x.device()}};
}
// Inputs (grad of the loss (statistics dtype), logits, target, logsumexp); the gradient of the
// logits, in their dtype.
std::vector<TensorMeta> infer_cross_entropy_backward(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[1].shape(), in[1].dtype(), in[1].device()}};
}
const OpDef kCrossEntropyBackward{.name = "cross_entropy_backward", .infer = infer_cross_entropy_backward};
// The same written over the logits: inputs (logits, overwritten by their gradient; grad of the
// loss, target, logsumexp). Each element is read before it is written, by the same thread.
std::vector<TensorMeta> infer_cross_entropy_backward_inplace(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
const OpDef kCrossEntropyBackwardInplace{.name = "cross_entropy_backward_",
                                         .infer = infer_cross_entropy_backward_inplace,
                                         .inplace = true};

std::vector<Tensor> cross_entropy_bw(const BackwardContext& c, std::span<const Tensor> g) {
  // Logits no one else holds take their own gradient (Note [Donated buffers], ops/dispatch.h).
  if (const Tensor x = c.donated_input(0); x.defined())
    return {dispatch1(kCrossEntropyBackwardInplace, {x, contiguous(g[0]), c.input(1), c.output(1)}, c.attrs), Tensor()};
  Tensor gx = dispatch1(kCrossEntropyBackward, {contiguous(g[0]), c.input(0), c.input(1), c.output(1)}, c.attrs);
  return {gx, Tensor()};
}
const OpDef kCrossEntropy{.name = "cross_entropy",
                          .infer = infer_cross_entropy,
                          .backward = cross_entropy_bw,
                          .save_inputs = 0b11,
                          .save_outputs = 0b10,
                          .diff_outputs = 1};

// --- layer_norm ------------------------------------------------------------------------------
// Inputs (x [..., C] contiguous, weight [C] or undefined, bias [C] or undefined); attr eps.
// Outputs: y, and mean and rstd of shape x.shape[:-1] (not differentiable, saved for backward).
std::vector<TensorMeta> infer_layer_norm(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& x = in[0];
  check_floating("layer_norm", "input", x);
  BLU_CHECK(x.dim() >= 1, "layer_norm: expected an input with at least one dim, got a 0-d tensor");
  BLU_CHECK(a.f("eps") >= 0, "layer_norm: expected eps >= 0, got ", a.f("eps"));
  const int64_t C = x.shape().back();
  for (int i : {1, 2}) {
    const Tensor& p = in[size_t(i)];
    if (!p.defined()) continue;
    const char* what = i == 1 ? "weight" : "bias";
    BLU_CHECK(p.shape() == Shape{C}, "layer_norm: expected ", what, " of shape [", C, "] for input ", x.shape(),
              ", got ", p.shape());
    BLU_CHECK(p.dtype() == x.dtype(), "layer_norm: ", what, " dtype ", p.dtype(), " differs from input dtype ",
              x.dtype());
  }
  const Shape rows(x.shape().begin(), x.shape().end() - 1);
  const DType sd = stats_dtype(x.dtype());
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, TensorMeta{rows, sd, x.device()},
          TensorMeta{rows, sd, x.device()}};
}
// Inputs (grad, x, weight or undefined, mean, rstd[, pending]); outputs grad_x, grad_weight,
// grad_bias. pending (x's shape and dtype, contiguous): added into grad_x after grad_x is rounded
// to x's dtype, the sum rounded again (Note [Folded gradient sums]). Attr param_dtype (optional):
// f32 for the last two under a 16-bit x (Note [Wide gradients]).
std::vector<TensorMeta> infer_layer_norm_backward(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& x = in[1];
  const DType pd = a.has("param_dtype") ? a.get<DType>("param_dtype") : x.dtype();
  BLU_ASSERT(pd == x.dtype() || (pd == DType::f32 && (x.dtype() == DType::bf16 || x.dtype() == DType::f16)),
             "layer_norm_backward: parameter gradients in ", pd, " for input ", x.str());
  check_pending_grad("layer_norm_backward", in, 5, x);
  const TensorMeta p{Shape{x.shape().back()}, pd, x.device()};
  return {TensorMeta{x.shape(), x.dtype(), x.device()}, p, p};
}
const OpDef kLayerNormBackward{
    .name = "layer_norm_backward", .infer = infer_layer_norm_backward, .optional_inputs = 0b100100};

std::vector<Tensor> layer_norm_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor w = c.inputs.at(1);  // undefined when the call had no weight
  // Parameter gradients in fp32 when asked for (the column sums are fp32 anyway).
  Attrs attrs;
  const DType xd = c.input_metas[0].dtype;
  if ((c.needs_grad[1] && c.grad_dtype(1) != xd) || (c.needs_grad[2] && c.grad_dtype(2) != xd))
    attrs = Attrs{{"param_dtype", DType::f32}};
  std::vector<Tensor> in = {contiguous(g[0]), c.input(0), w, c.output(1), c.output(2)};
  c.take_pending_grad(0, in);
  auto gs = dispatch(kLayerNormBackward, std::move(in), attrs);
  auto param = [&](size_t i) {
    if (!c.needs_grad[i]) return Tensor();
    return gs[i].dtype() == c.grad_dtype(i) ? gs[i] : to_dtype(gs[i], c.grad_dtype(i));
  };
  return {c.needs_grad[0] ? gs[0] : Tensor(), param(1), param(2)};
}
const OpDef kLayerNorm{.name = "layer_norm",
                       .infer = infer_layer_norm,
                       .shard = shard_rule_last_dim_norm,
                       .backward = layer_norm_bw,
                       .save_inputs = 0b011,
                       .save_outputs = 0b110,
                       .diff_outputs = 1,
                       .optional_inputs = 0b110,
                       .wide_grads = 0b110,
                       .folds_grads = 0b1};

// --- embedding -------------------------------------------------------------------------------
// Inputs (weight [V, C], indices contiguous i32/i64); output [indices..., C].
std::vector<TensorMeta> infer_embedding(std::span<const Tensor> in, const Attrs&) {
  const Tensor& w = in[0];
  check_floating("embedding", "weight", w);
  check_index("embedding", "indices", in[1]);
  BLU_CHECK(w.dim() == 2, "embedding: expected weight [V, C], got ", w.shape());
  Shape s = in[1].shape();
  s.push_back(w.shape()[1]);
  return {TensorMeta{s, w.dtype(), w.device()}};
}
// Inputs (grad [indices..., C], indices); attr num_weights; output [V, C].
std::vector<TensorMeta> infer_embedding_backward(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& g = in[0];
  return {TensorMeta{Shape{a.i("num_weights"), g.shape().back()}, g.dtype(), g.device()}};
}
const OpDef kEmbeddingBackward{.name = "embedding_backward", .infer = infer_embedding_backward};

std::vector<Tensor> embedding_bw(const BackwardContext& c, std::span<const Tensor> g) {
  Tensor gw = dispatch1(kEmbeddingBackward, {contiguous(g[0]), c.input(1)},
                        Attrs{{"num_weights", c.input_shape(0)[0]}});
  return {gw, Tensor()};
}
// Sharding: a vocabulary shard (weight shard(-2)) gives this rank's rows for the ids it owns — a
// partial sum once the caller zeroes the rows of the ids it does not (dist/tensor_parallel.h); a
// feature shard (shard(-1)) gives shard(-1); a whole weight, the ids' placement.
bool shard_embedding(std::span<const Placement> in, std::span<const Tensor>, const Attrs&, std::vector<Placement>& out) {
  const Placement &w = in[0], &ids = in[1];
  if (w.is_partial() || ids.is_partial()) return false;
  if (w.is_shard()) {
    if (!ids.is_replicate()) return false;
    out[0] = w.dim == -2 ? Placement::partial() : Placement::shard(-1);
    return true;
  }
  out[0] = ids;  // ids [..]: a shard of the ids along dim d is one of the rows along d - 1
  if (ids.is_shard()) out[0] = Placement::shard(ids.dim - 1);
  return true;
}
const OpDef kEmbedding{.name = "embedding", .infer = infer_embedding, .shard = shard_embedding, .backward = embedding_bw, .save_inputs = 0b10};

// Inputs (grad_weight [V, C] contiguous, written; grad [M, C] contiguous, indices [M]); attrs scale,
// first_row (-1: the whole table, an index outside [0, V) is an error; >= 0: grad_weight is the
// window of rows [first_row, first_row + V), indices outside it are skipped).
std::vector<TensorMeta> infer_embedding_backward_add(std::span<const Tensor> in, const Attrs&) {
  const Tensor &w = in[0], &g = in[1];
  check_floating("embedding_backward_add_", "grad_weight", w);
  check_index("embedding_backward_add_", "indices", in[2]);
  BLU_CHECK(w.dim() == 2 && w.is_contiguous(), "embedding_backward_add_: expected a contiguous grad_weight [V, C], got ",
            w.str());
  BLU_CHECK(g.dtype() == w.dtype() && g.device() == w.device() && g.dim() == 2 && g.shape()[1] == w.shape()[1] &&
                g.shape()[0] == in[2].numel(),
            "embedding_backward_add_: expected grad_out [", in[2].numel(), ", ", w.shape()[1], "] ",
            dtype_name(w.dtype()), " on ", w.device().str(), " (one row per index), got ", g.str());
  return {TensorMeta{w.shape(), w.dtype(), w.device()}};
}
const OpDef kEmbeddingBackwardAdd{.name = "embedding_backward_add_", .infer = infer_embedding_backward_add,
                                  .inplace = true};

// --- dropout ---------------------------------------------------------------------------------
// Input x (any layout); attrs p, seed, offset. Element i (row-major) is kept iff the Philox
// uniform of (seed, offset + i/4, lane i%4) is >= p; kept values are scaled by 1/(1-p).
// The backward is the same op applied to the gradient: the mask is regenerated, never stored.
std::vector<TensorMeta> infer_dropout(std::span<const Tensor> in, const Attrs& a) {
  check_floating("dropout", "input", in[0]);
  const double p = a.f("p");
  BLU_CHECK(p >= 0 && p <= 1, "dropout: expected p in [0, 1], got ", p);
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
const OpDef& dropout_def();
std::vector<Tensor> dropout_bw(const BackwardContext& c, std::span<const Tensor> g) {
  return {dispatch1(dropout_def(), {g[0]}, c.attrs)};
}
const OpDef kDropout{.name = "dropout", .infer = infer_dropout, .shard = shard_rule_pointwise, .backward = dropout_bw};
const OpDef& dropout_def() { return kDropout; }

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_like(kSoftmax, x, dim); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_like(kLogSoftmax, x, dim); }

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, Reduction reduction,
                     int64_t num_classes) {
  BLU_CHECK(logits.defined() && target.defined(), "cross_entropy: logits and target must be defined");
  const int64_t classes = num_classes == -1 && logits.dim() > 0 ? logits.shape().back() : num_classes;
  return dispatch(kCrossEntropy, {contiguous(logits), contiguous(target)},
                  Attrs{{"ignore_index", ignore_index}, {"reduction", int64_t(reduction)}, {"classes", classes}})[0];
}

namespace {
Attrs shard_attrs(const Tensor& logits, const Tensor& target, int64_t classes, int64_t class_offset, int64_t vocab,
                  int64_t ignore_index) {
  BLU_CHECK(logits.defined() && target.defined() && logits.dim() == 2 && target.dim() == 1 &&
                target.size(0) == logits.size(0),
            "cross_entropy_shard: expected logits [N, C] and target [N], got ",
            logits.defined() ? logits.shape() : Shape{}, " and ", target.defined() ? target.shape() : Shape{});
  BLU_CHECK(class_offset >= 0 && classes >= 1 && class_offset + classes <= vocab, "cross_entropy_shard: the classes [",
            class_offset, ", ", class_offset + classes, ") are not a part of a vocabulary of ", vocab);
  return Attrs{{"ignore_index", ignore_index},
               {"reduction", int64_t(Reduction::none)},
               {"classes", classes},
               {"class_offset", class_offset},
               {"vocab", vocab}};
}
}  // namespace

CrossEntropyShard cross_entropy_shard(const Tensor& logits, const Tensor& target, int64_t classes,
                                      int64_t class_offset, int64_t vocab, int64_t ignore_index) {
  const Attrs a = shard_attrs(logits, target, classes, class_offset, vocab, ignore_index);
  NoGradGuard no_grad;
  std::vector<Tensor> out = dispatch(kCrossEntropy, {contiguous(logits), contiguous(target)}, a);
  return {out[0], out[1]};
}

Tensor cross_entropy_shard_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                    const Tensor& grad_rows, int64_t classes, int64_t class_offset, int64_t vocab,
                                    int64_t ignore_index, bool overwrite) {
  const Attrs a = shard_attrs(logits, target, classes, class_offset, vocab, ignore_index);
  const DType sd = stats_dtype(logits.dtype());
  BLU_CHECK(lse.shape() == target.shape() && grad_rows.shape() == target.shape() && lse.dtype() == sd &&
                grad_rows.dtype() == sd,
            "cross_entropy_shard_backward: expected lse and grad_rows [", target.size(0), "] ", sd, ", got ",
            lse.shape(), " ", lse.dtype(), " and ", grad_rows.shape(), " ", grad_rows.dtype());
  NoGradGuard no_grad;
  if (overwrite) {
    BLU_CHECK(logits.is_contiguous(), "cross_entropy_shard_backward: logits to overwrite must be contiguous");
    return dispatch1(kCrossEntropyBackwardInplace, {logits, contiguous(grad_rows), contiguous(target), contiguous(lse)},
                     a);
  }
  return dispatch1(kCrossEntropyBackward,
                   {contiguous(grad_rows), contiguous(logits), contiguous(target), contiguous(lse)}, a);
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  BLU_CHECK(x.defined(), "layer_norm: input must be defined");
  return dispatch(kLayerNorm, {contiguous(x), weight, bias}, Attrs{{"eps", eps}})[0];
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  BLU_CHECK(weight.defined() && indices.defined(), "embedding: weight and indices must be defined");
  return dispatch1(kEmbedding, {weight, contiguous(indices)});
}

namespace {
const Tensor& embedding_backward_add_rows(const Tensor& grad_weight, const Tensor& grad_out, const Tensor& indices,
                                          int64_t first_row, double scale) {
  BLU_CHECK(grad_weight.defined() && grad_out.defined() && indices.defined(),
            "embedding_backward_add_: grad_weight, grad_out and indices must be defined");
  const int64_t C = grad_out.dim() > 0 ? grad_out.shape().back() : 0;
  dispatch(kEmbeddingBackwardAdd, {grad_weight, reshape(contiguous(grad_out), {indices.numel(), C}), contiguous(indices)},
           Attrs{{"scale", scale}, {"first_row", first_row}});
  return grad_weight;
}
}  // namespace

const Tensor& embedding_backward_add_(const Tensor& grad_weight, const Tensor& grad_out, const Tensor& indices,
                                      double scale) {
  return embedding_backward_add_rows(grad_weight, grad_out, indices, -1, scale);
}

const Tensor& embedding_backward_add_window_(const Tensor& grad_window, const Tensor& grad_out, const Tensor& indices,
                                             int64_t first_row, double scale) {
  BLU_CHECK(first_row >= 0, "embedding_backward_add_window_: first_row must be >= 0, got ", first_row);
  return embedding_backward_add_rows(grad_window, grad_out, indices, first_row, scale);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  BLU_CHECK(x.defined(), "dropout: input must be defined");
  BLU_CHECK(p >= 0 && p <= 1, "dropout: expected p in [0, 1], got ", p);
  if (!training || p == 0) return x;
  Generator& g = gen ? *gen : default_generator();
  const uint64_t offset = g.draw(uint64_t(x.numel()));
  return dispatch1(kDropout, {x},
                   Attrs{{"p", p}, {"seed", int64_t(g.seed())}, {"offset", int64_t(offset)}});
}

}  // namespace blu
