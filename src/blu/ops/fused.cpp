#include "blu/ops/fused.h"

#include <algorithm>
#include <limits>

#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

std::vector<TensorMeta> infer_gelu_linear(std::span<const Tensor> in, const Attrs&) {
  const Tensor &u = in[0], &w = in[1];
  BLU_CHECK(u.dim() == 2 && w.dim() == 2, "gelu_linear: expected u [N, in] and w [out, in], got ", u.shape(), " and ",
            w.shape());
  return {};  // shapes and dtypes are checked again by the ops it is made of
}

// The forward is the composition itself, computed without recording: the node recorded for
// this op (with the backward below) replaces the two it would otherwise leave.
std::vector<Tensor> gelu_linear_compute(std::span<const Tensor> in, const Attrs&) {
  NoGradGuard no_grad;
  return {linear(gelu(in[0], /*approximate=*/true), in[1], in[2], in[3])};
}

std::vector<Tensor> gelu_linear_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor &u = c.input(0), &w = c.input(1);
  // gelu(u) is recomputed (never saved), in the same pass as u's gradient when both are needed.
  Tensor h, gu, gw, gb;
  if (c.needs_grad[0] && c.needs_grad[1]) {
    std::vector<Tensor> hg = gelu_and_backward(matmul(g[0], w), u, true);
    h = hg[0];
    gu = hg[1];
  } else if (c.needs_grad[0]) {
    gu = gelu_backward(matmul(g[0], w), u, true);
  } else {
    h = gelu(u, true);
  }
  if (c.needs_grad[1] && (c.grad_is_directed(1) || (c.needs_grad[2] && c.grad_is_directed(2)))) {
    gw = c.grad_buffer(1);  // fp32 or in place (Note [Wide gradients])
    gb = c.needs_grad[2] ? c.grad_buffer(2) : Tensor();
    linear_weight_grad_into(gw, g[0], h, gb);
  } else if (c.needs_grad[1] && c.needs_grad[2]) {
    std::vector<Tensor> wb = linear_weight_grad(g[0], h);  // the bias gradient from the same GEMM
    gw = wb[0];
    gb = wb[1];
  } else {
    if (c.needs_grad[1]) gw = matmul(transpose(g[0], 0, 1), h);
    if (c.needs_grad[2]) gb = sum(g[0], {0});
  }
  return {gu, gw, gb, c.needs_grad[3] ? g[0] : Tensor()};
}

const OpDef kGeluLinear{.name = "gelu_linear",
                        .infer = infer_gelu_linear,
                        .backward = gelu_linear_backward,
                        .save_inputs = 0b011,
                        .view = gelu_linear_compute,
                        .optional_inputs = 0b1100,
                        .wide_grads = 0b110};

// --- linear_cross_entropy (Note [Chunked loss], ops/fused.h) ---
// Inputs (x [N, C], w [V', C], target [N]); attrs ignore_index, classes, chunks. Outputs: the loss
// and, when autograd records the op, the gradients of the loss with respect to x and w (x's dtype;
// fp32 for a 16-bit w, else w's dtype), not differentiable, saved for the backward.
std::vector<TensorMeta> infer_linear_cross_entropy(std::span<const Tensor> in, const Attrs& a) {
  const Tensor &x = in[0], &w = in[1], &t = in[2];
  BLU_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_cross_entropy: expected x [N, C] and w [V, C], got ",
            x.shape(), " and ", w.shape());
  BLU_CHECK(x.dtype() == w.dtype() && is_floating(x.dtype()), "linear_cross_entropy: x ", x.str(), " and w ", w.str(),
            " must share one floating dtype");
  BLU_CHECK((t.dtype() == DType::i32 || t.dtype() == DType::i64) && t.dim() == 1 && t.size(0) == x.size(0),
            "linear_cross_entropy: expected a target [", x.size(0), "] of i32/i64 class ids, got ", t.str());
  BLU_CHECK(a.i("classes") >= 1 && a.i("classes") <= w.size(0), "linear_cross_entropy: expected num_classes in [1, ",
            w.size(0), "] (w's rows) or -1, got ", a.i("classes"));
  BLU_CHECK(a.i("chunks") >= 1, "linear_cross_entropy: expected chunks >= 1, got ", a.i("chunks"));
  return {};  // the ops it is made of make (and check) the outputs
}

std::vector<Tensor> linear_cross_entropy_compute(std::span<const Tensor> in, const Attrs& a) {
  const bool grads = GradMode::enabled() && (in[0].requires_grad() || in[1].requires_grad());
  NoGradGuard no_grad;
  const Tensor &x = in[0], &w = in[1], &t = in[2];
  const int64_t N = x.size(0), K = a.i("classes"), ignore = a.i("ignore_index");
  const int64_t pieces = std::max<int64_t>(1, std::min(a.i("chunks"), N));
  const DType sd = stats_dtype(x.dtype());
  // The rows that count, and how many, on the device: the mean's divisor is known before the first
  // piece's gradient.
  const Tensor valid = add(mul(to_dtype(eq(t, double(ignore)), sd), -1.0), 1.0);
  const Tensor count = clamp(sum(valid), 1.0, std::numeric_limits<double>::infinity());
  const Tensor grad_rows = grads ? div(valid, count) : Tensor();
  std::vector<Tensor> row_loss, gx;
  const DType wd = w.dtype() == DType::bf16 || w.dtype() == DType::f16 ? DType::f32 : w.dtype();
  Tensor gw = grads ? empty(w.shape(), wd, w.device()) : Tensor();
  for (int64_t p = 0, r0 = 0; p < pieces; ++p) {
    const int64_t rows = N / pieces + (p < N % pieces ? 1 : 0);
    const Tensor xp = narrow(x, 0, r0, rows), tp = narrow(t, 0, r0, rows);
    Tensor logits = linear(xp, w);
    const CrossEntropyShard s = cross_entropy_shard(logits, tp, K, 0, K, ignore);
    row_loss.push_back(s.row_loss);
    if (grads) {
      const Tensor gl = cross_entropy_shard_backward(logits, tp, s.lse, narrow(grad_rows, 0, r0, rows), K, 0, K, ignore,
                                                     /*overwrite=*/true);
      gx.push_back(matmul(gl, w));
      linear_weight_grad_into(gw, gl, xp, Tensor(), /*accumulate=*/p > 0);
    }
    r0 += rows;
  }
  Tensor loss = div(sum(pieces == 1 ? row_loss[0] : cat(row_loss, 0)), count);
  if (!grads) return {loss};
  return {loss, pieces == 1 ? gx[0] : cat(gx, 0), gw};
}

// The loss's incoming gradient s (0-d, statistics dtype) scales the gradients the forward made —
// in place when the node's saved copies are the last references (Note [Donated buffers]), so the
// backward adds no [V', C] buffer at the step's peak. When s is backward()'s own seed (exactly 1:
// BackwardContext::grad_is_one) there is nothing to scale: a donated gradient is returned as it
// is and the weight's is copied into its destination without the multiply, the same bits with
// three passes over x's gradient and one over w's fewer (GPT-2 124M: ~0.5 GB a step).
std::vector<Tensor> linear_cross_entropy_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor& s = g[0];
  const bool one = c.grad_is_one(0);
  Tensor dx, dw;
  if (c.needs_grad[0]) {
    const Tensor& gx = c.output(1);
    if (const Tensor d = one ? c.donated_output(1) : Tensor(); d.defined()) {
      dx = d;
    } else if (gx.dtype() != s.dtype()) {  // 16-bit: the product in fp32, rounded once ([N, C]: small)
      dx = to_dtype(mul(to_dtype(gx, s.dtype()), s), gx.dtype());
    } else if (const Tensor d = c.donated_output(1); d.defined()) {
      dx = mul_(d, s);
    } else {
      dx = mul(gx, s);
    }
  }
  if (c.needs_grad[1]) {
    const Tensor& gw = c.output(2);
    const Tensor sw = s.dtype() == gw.dtype() ? s : to_dtype(s, gw.dtype());
    if (const Tensor dst = c.grad_destination(1); dst.defined() && dst.dtype() == gw.dtype()) {
      dw = one ? copy_(dst, gw) : mul_(copy_(dst, gw), sw);
    } else if (const Tensor d = c.donated_output(2); d.defined()) {
      dw = one ? d : mul_(d, sw);
    } else {
      dw = mul(gw, sw);
    }
    if (dw.dtype() != c.grad_dtype(1)) dw = to_dtype(dw, c.input_metas[1].dtype);
  }
  return {dx, dw, Tensor()};
}

const OpDef kLinearCrossEntropy{.name = "linear_cross_entropy",
                                .infer = infer_linear_cross_entropy,
                                .backward = linear_cross_entropy_backward,
                                .save_outputs = 0b110,
                                .view = linear_cross_entropy_compute,
                                .diff_outputs = 1,
                                .wide_grads = 0b010};

}  // namespace

Tensor linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& target, int64_t ignore_index,
                            int64_t num_classes, int64_t chunks) {
  BLU_CHECK(x.defined() && w.defined() && target.defined(), "linear_cross_entropy: x, w and target must be defined");
  BLU_CHECK(w.dim() == 2, "linear_cross_entropy: expected w [V, C], got ", w.shape());
  const int64_t classes = num_classes == -1 ? w.size(0) : num_classes;
  return dispatch(kLinearCrossEntropy, {contiguous(x), contiguous(w), contiguous(target)},
                  Attrs{{"ignore_index", ignore_index}, {"classes", classes}, {"chunks", chunks}})[0];
}

Tensor gelu_linear(const Tensor& u, const Tensor& w, const Tensor& bias, const Tensor& residual) {
  BLU_CHECK(u.dim() >= 1, "gelu_linear: expected an input with at least one dim, got 0-d");
  BLU_CHECK(w.dim() == 2, "gelu_linear: expected a 2-D weight [out, in], got ", w.shape());
  Shape out_shape = u.shape();
  out_shape.back() = w.shape()[0];
  Tensor r;
  if (residual.defined()) {
    BLU_CHECK(residual.shape() == out_shape, "gelu_linear: expected a residual of shape ", out_shape,
              " (the output's), got ", residual.shape());
    r = reshape(residual, {-1, w.shape()[0]});
  }
  Tensor y = dispatch1(kGeluLinear, {reshape(u, {-1, u.shape().back()}), w, bias, r});
  return reshape(y, out_shape);
}

}  // namespace blu
