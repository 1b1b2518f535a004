// ops/linalg: two primitives and the torch.matmul rules written over them.
//   "matmul": a[..., M, K] · b[..., K, N] -> [..., M, N] with *equal* batch dims (any strides,
//             stride 0 included, so expanded and transposed operands reach the kernel uncopied).
//   "linear": x[R, in] · w[out, in]ᵀ (+ bias[out]) -> [R, out], one gemm with the bias fused.
//   "linear_weight_grad": linear's weight and bias gradients from one gemm (its backward).
// Everything else — 1-D promotion, batch broadcasting, folding a batched·2-D product into one
// gemm, flattening linear's leading dims — is done here with view ops, so their gradients come
// from the view ops' own backward formulas (expand's backward is the sum over broadcast dims).
#include "blu/ops/linalg.h"

#include <algorithm>

#include "blu/ops/dispatch.h"
#include "blu/ops/early_grad.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

using Ctx = const BackwardContext&;
using Grads = std::span<const Tensor>;

Tensor mT(const Tensor& t) { return transpose(t, -1, -2); }

// --- matmul primitive ---
std::vector<TensorMeta> infer_matmul(std::span<const Tensor> in, const Attrs&) {
  const Tensor &a = in[0], &b = in[1];
  BLU_ASSERT(a.dim() >= 2 && a.dim() == b.dim(), "matmul primitive: ranks ", a.shape(), " and ", b.shape());
  BLU_CHECK(a.dtype() == b.dtype(), "matmul: dtype mismatch: ", a.str(), " and ", b.str());
  BLU_CHECK(is_floating(a.dtype()), "matmul: expected floating operands, got ", a.dtype());
  const int64_t n = a.dim();
  BLU_CHECK(a.shape()[n - 1] == b.shape()[n - 2], "matmul: inner dims differ: ", a.shape(), " · ", b.shape());
  Shape out(a.shape().begin(), a.shape().end() - 2);
  BLU_ASSERT(Shape(b.shape().begin(), b.shape().end() - 2) == out, "matmul primitive: batch dims of ", a.shape(),
             " and ", b.shape());
  out.push_back(a.shape()[n - 2]);
  out.push_back(b.shape()[n - 1]);
  return {TensorMeta{out, a.dtype(), a.device()}};
}
Tensor matmul_prim(const Tensor& a, const Tensor& b);
// d(a·b) = g·bᵀ for a, aᵀ·g for b: two more primitive calls on transposed views (no copies).
std::vector<Tensor> matmul_bw(Ctx c, Grads g) {
  return {c.needs_grad[0] ? matmul_prim(g[0], mT(c.input(1))) : Tensor(),
          c.needs_grad[1] ? matmul_prim(mT(c.input(0)), g[0]) : Tensor()};
}
const OpDef kMatmul{.name = "matmul", .infer = infer_matmul, .backward = matmul_bw, .save_inputs = 0b11};
Tensor matmul_prim(const Tensor& a, const Tensor& b) { return dispatch1(kMatmul, {a, b}); }

// --- linear primitive ---
std::vector<TensorMeta> infer_linear(std::span<const Tensor> in, const Attrs&) {
  const Tensor &x = in[0], &w = in[1], &bias = in[2], &residual = in[3];
  BLU_CHECK(w.dim() == 2, "linear: expected a 2-D weight [out, in], got ", w.shape());
  BLU_ASSERT(x.dim() == 2, "linear primitive: x ", x.shape());
  BLU_CHECK(x.dtype() == w.dtype(), "linear: dtype mismatch: input ", x.str(), " and weight ", w.str());
  BLU_CHECK(is_floating(x.dtype()), "linear: expected floating operands, got ", x.dtype());
  BLU_CHECK(x.shape()[1] == w.shape()[1], "linear: input features ", x.shape()[1], " (input ", x.shape(),
            ") differ from the weight's ", w.shape()[1], " (weight ", w.shape(), ")");
  if (bias.defined()) {
    BLU_CHECK(bias.dtype() == x.dtype(), "linear: dtype mismatch: bias ", bias.str(), " and input ", x.str());
    BLU_CHECK(bias.dim() == 1 && bias.shape()[0] == w.shape()[0], "linear: expected a bias of shape [",
              w.shape()[0], "] for weight ", w.shape(), ", got ", bias.shape());
  }
  if (residual.defined()) {
    BLU_CHECK(residual.dtype() == x.dtype(), "linear: dtype mismatch: residual ", residual.str(), " and input ",
              x.str());
    BLU_CHECK(residual.shape() == Shape({x.shape()[0], w.shape()[0]}), "linear: expected a residual of shape [",
              x.shape()[0], ", ", w.shape()[0], "], got ", residual.shape());
    BLU_ASSERT(residual.is_contiguous(), "linear primitive: residual ", residual.str());
  }
  return {TensorMeta{{x.shape()[0], w.shape()[0]}, x.dtype(), x.device()}};
}
// Sharding (Note [Sharding rules]): x [rows, in] · w [out, in]ᵀ.
//   column  x replicate (or a row shard), w shard(-2)      → shard(-1), bias shard(-1), residual alike
//   row     x shard(-1), w shard(-1)                       → partial; no bias or residual (they would
//                                                             be summed once per rank)
//   whole w x replicate / row shard / partial (no bias)    → x's placement
bool shard_linear(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs&,
                  std::vector<Placement>& out) {
  const Placement &x = in[0], &w = in[1], &b = in[2], &r = in[3];
  const bool has_b = inputs[2].defined(), has_r = inputs[3].defined();
  const bool x_rows = x.is_replicate() || (x.is_shard() && x.dim != -1);
  if (w.is_shard() && w.dim == -2 && x_rows) {
    if (has_b && b != Placement::shard(-1)) return false;
    if (has_r && r != Placement::shard(-1)) return false;
    out[0] = Placement::shard(-1);
    return true;
  }
  if (w.is_shard() && w.dim == -1 && x == Placement::shard(-1)) {
    if (has_b || has_r) return false;
    out[0] = Placement::partial();
    return true;
  }
  if (!w.is_replicate() || (has_b && !b.is_replicate())) return false;
  if (x.is_partial() && (has_b || has_r)) return false;
  if (x_rows || x.is_partial()) {
    if (has_r && r != x) return false;
    out[0] = x;
    return true;
  }
  return false;  // x split along the contracted features against a whole weight
}

// --- linear_weight_grad: (gᵀ·x, Σ_rows g) in one pass ---
// g[R, out], x[R, in] -> grad_w[out, in], grad_b[out]: linear's weight and bias gradients
// together, so a backend can take the bias gradient from the gemm that reads g anyway (CUDA: the
// cuBLASLt BGRAD epilogue) instead of a separate reduction over g.
std::vector<TensorMeta> infer_linear_weight_grad(std::span<const Tensor> in, const Attrs&) {
  const Tensor &g = in[0], &x = in[1];
  BLU_ASSERT(g.dim() == 2 && x.dim() == 2 && g.shape()[0] == x.shape()[0] && g.dtype() == x.dtype(),
             "linear_weight_grad: g ", g.str(), " and x ", x.str());
  return {TensorMeta{{g.shape()[1], x.shape()[1]}, g.dtype(), g.device()},
          TensorMeta{{g.shape()[1]}, g.dtype(), g.device()}};
}
Tensor linear_prim(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& residual = Tensor());
// grad_w = gᵀ·x, grad_b = Σ_rows g: d/dg = x·Gwᵀ + Gb (a linear), d/dx = g·Gw.
std::vector<Tensor> linear_weight_grad_bw(Ctx c, Grads gr) {
  return {c.needs_grad[0] ? linear_prim(c.input(1), gr[0], gr[1]) : Tensor(),
          c.needs_grad[1] ? matmul_prim(c.input(0), gr[0]) : Tensor()};
}
const OpDef kLinearWeightGrad{.name = "linear_weight_grad", .infer = infer_linear_weight_grad,
                              .backward = linear_weight_grad_bw, .save_inputs = 0b11};

// --- linear_weight_grad_into: (gw, g, x[, gb]), gw and gb written in place ---
// Attr accumulate (optional, 1: gw += gᵀ·x; no gb then).
std::vector<TensorMeta> infer_linear_weight_grad_into(std::span<const Tensor> in, const Attrs&) {
  const Tensor &gw = in[0], &g = in[1], &x = in[2], &gb = in[3];
  BLU_CHECK(g.dim() == 2 && x.dim() == 2 && g.shape()[0] == x.shape()[0],
            "linear_weight_grad_into: expected g [R, out] and x [R, in], got ", g.str(), " and ", x.str());
  BLU_CHECK(g.dtype() == x.dtype() && is_floating(g.dtype()), "linear_weight_grad_into: g ", g.str(), " and x ",
            x.str(), " must share one floating dtype");
  const bool narrow = g.dtype() == DType::bf16 || g.dtype() == DType::f16;
  auto check_out = [&](const Tensor& t, const Shape& shape, const char* what) {
    BLU_CHECK(t.shape() == shape, "linear_weight_grad_into: ", what, " ", t.str(), " must have shape ", shape);
    BLU_CHECK(t.dtype() == g.dtype() || (narrow && t.dtype() == DType::f32), "linear_weight_grad_into: ", what,
              " ", t.str(), " must be ", g.dtype(), narrow ? " or f32" : "");
    BLU_CHECK(t.is_contiguous(), "linear_weight_grad_into: ", what, " ", t.str(), " must be contiguous");
  };
  check_out(gw, {g.shape()[1], x.shape()[1]}, "gw");
  if (gb.defined()) check_out(gb, {g.shape()[1]}, "gb");
  return {TensorMeta{gw.shape(), gw.dtype(), gw.device()}};
}
bool linear_weight_grad_into_writes(size_t i, const Attrs&) { return i == 0 || i == 3; }
const OpDef kLinearWeightGradInto{.name = "linear_weight_grad_into",
                                  .infer = infer_linear_weight_grad_into,
                                  .inplace = true,
                                  .writes = linear_weight_grad_into_writes,
                                  .optional_inputs = 0b1000};

// y = x·wᵀ + b (+ residual): grad_x = g·w, grad_w = gᵀ·x, grad_b = Σ_rows g (the last two in one
// op when both are needed), grad_residual = g. A weight or bias gradient wanted in fp32 or in a
// given place (Note [Wide gradients]) is written there by linear_weight_grad_into.
std::vector<Tensor> linear_bw(Ctx c, Grads g) {
  Tensor gx = c.needs_grad[0] ? matmul_prim(g[0], c.input(1)) : Tensor();
  if (gx.defined()) input_grad_ready(0, gx);  // before the weight's GEMM (Note [Early input gradients])
  Tensor gr = c.needs_grad.size() > 3 && c.needs_grad[3] ? g[0] : Tensor();
  if (c.needs_grad[1] && (c.grad_is_directed(1) || (c.needs_grad[2] && c.grad_is_directed(2)))) {
    Tensor gw = c.grad_buffer(1), gb = c.needs_grad[2] ? c.grad_buffer(2) : Tensor();
    linear_weight_grad_into(gw, g[0], c.input(0), gb);
    return {gx, gw, gb, gr};
  }
  if (c.needs_grad[1] && c.needs_grad[2]) {
    std::vector<Tensor> wb = dispatch(kLinearWeightGrad, {g[0], c.input(0)});
    return {gx, wb[0], wb[1], gr};
  }
  return {gx, c.needs_grad[1] ? matmul_prim(mT(g[0]), c.input(0)) : Tensor(),
          c.needs_grad[2] ? sum(g[0], {0}) : Tensor(), gr};
}
const OpDef kLinear{.name = "linear", .infer = infer_linear, .shard = shard_linear, .backward = linear_bw, .save_inputs = 0b011,
                    .optional_inputs = 0b1100, .wide_grads = 0b110};
Tensor linear_prim(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& residual) {
  return dispatch1(kLinear, {x, w, bias, residual});
}

}  // namespace

std::vector<Tensor> linear_weight_grad(const Tensor& g, const Tensor& x) {
  BLU_CHECK(g.defined() && x.defined() && g.dim() == 2 && x.dim() == 2 && g.shape()[0] == x.shape()[0],
            "linear_weight_grad: expected g [R, out] and x [R, in], got ", g.str(), " and ", x.str());
  BLU_CHECK(g.dtype() == x.dtype(), "linear_weight_grad: dtype mismatch: ", g.str(), " and ", x.str());
  return dispatch(kLinearWeightGrad, {g, x});
}

void linear_weight_grad_into(const Tensor& gw, const Tensor& g, const Tensor& x, const Tensor& gb, bool accumulate) {
  BLU_CHECK(gw.defined() && g.defined() && x.defined(), "linear_weight_grad_into: gw, g and x must be defined");
  BLU_CHECK(!(accumulate && gb.defined()), "linear_weight_grad_into: accumulate takes no bias gradient");
  dispatch(kLinearWeightGradInto, {gw, g, x, gb}, accumulate ? Attrs{{"accumulate", int64_t(1)}} : Attrs{});
}

namespace {

void check_operands(const char* op, const Tensor& a, const Tensor& b) {
  BLU_CHECK(a.defined() && b.defined(), op, ": undefined operand");
  BLU_CHECK(a.dim() >= 1 && b.dim() >= 1, op, ": expected operands with at least 1 dim, got ", a.shape(), " and ",
            b.shape(), " (0-d tensors have no matrix product; use mul)");
  BLU_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", a.str(), " and ", b.str(), " (cast one with to_dtype)");
  BLU_CHECK(is_floating(a.dtype()), op, ": expected floating operands (f32, f64, bf16, f16), got ", a.dtype());
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_operands("matmul", a, b);
  const int64_t k_a = a.shape().back(), k_b = b.dim() == 1 ? b.shape()[0] : b.shape()[b.dim() - 2];
  BLU_CHECK(k_a == k_b, "matmul: inner dims differ: ", a.shape(), " has ", k_a, " columns but ", b.shape(), " has ",
            k_b, " rows");
  // 1-D operands become a row (a) or a column (b); the added dim is removed at the end.
  const Tensor a2 = a.dim() == 1 ? unsqueeze(a, 0) : a;
  const Tensor b2 = b.dim() == 1 ? unsqueeze(b, 1) : b;
  auto finish = [&](Tensor out) {
    if (a.dim() == 1) out = squeeze(out, -2);
    if (b.dim() == 1) out = squeeze(out, -1);
    return out;
  };
  // Batched · matrix: fold a's batch dims into its rows — one gemm instead of many (as PyTorch).
  if (a2.dim() >= 3 && b2.dim() == 2) {
    Shape out_shape(a2.shape().begin(), a2.shape().end() - 1);
    const int64_t rows = numel(out_shape);
    out_shape.push_back(b2.shape()[1]);
    return finish(reshape(matmul_prim(reshape(a2, {rows, k_a}), b2), out_shape));
  }
  // Broadcast the batch dims; expand is a view whose backward sums the gradient back.
  const Shape ba(a2.shape().begin(), a2.shape().end() - 2), bb(b2.shape().begin(), b2.shape().end() - 2);
  Shape batch(std::max(ba.size(), bb.size()));
  for (size_t i = 0; i < batch.size(); ++i) {  // aligned from the right
    const int64_t da = i < ba.size() ? ba[ba.size() - 1 - i] : 1, db = i < bb.size() ? bb[bb.size() - 1 - i] : 1;
    BLU_CHECK(da == db || da == 1 || db == 1, "matmul: batch dims ", ba, " of ", a.shape(), " and ", bb, " of ",
              b.shape(), " do not broadcast");
    batch[batch.size() - 1 - i] = da == 1 ? db : da;
  }
  Shape sa = batch, sb = batch;
  sa.insert(sa.end(), a2.shape().end() - 2, a2.shape().end());
  sb.insert(sb.end(), b2.shape().end() - 2, b2.shape().end());
  return finish(matmul_prim(a2.shape() == sa ? a2 : expand(a2, sa), b2.shape() == sb ? b2 : expand(b2, sb)));
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& residual) {
  check_operands("linear", x, w);
  BLU_CHECK(w.dim() == 2, "linear: expected a 2-D weight [out, in], got ", w.shape());
  BLU_CHECK(x.shape().back() == w.shape()[1], "linear: input features ", x.shape().back(), " (input ", x.shape(),
            ") differ from the weight's ", w.shape()[1], " (weight ", w.shape(), ")");
  // Leading dims flattened into rows: one gemm, not a batched one.
  Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  const int64_t rows = numel(out_shape);
  out_shape.push_back(w.shape()[0]);
  Tensor r;
  if (residual.defined()) {
    BLU_CHECK(residual.shape() == out_shape, "linear: expected a residual of shape ", out_shape, " (the output's), got ",
              residual.shape());
    r = reshape(contiguous(residual), {rows, w.shape()[0]});
  }
  if (x.dim() == 2) return dispatch1(kLinear, {x, w, bias, r});
  return reshape(dispatch1(kLinear, {reshape(x, {rows, w.shape()[1]}), w, bias, r}), out_shape);
}

}  // namespace blu
