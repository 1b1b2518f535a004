#include "blu/ops/fused.h"

#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/linalg.h"
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

}  // namespace

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
