#include "blu/ops/elementwise.h"

#include <cmath>

#include "blu/ops/dispatch.h"
#include "blu/ops/factory.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

std::vector<TensorMeta> infer_unary_float(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(is_floating(in[0].dtype()), "expected a floating tensor, got ", in[0].str());
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}

std::vector<TensorMeta> infer_binary(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(in[0].dtype() == in[1].dtype(), "dtype mismatch: ", in[0].str(), " and ", in[1].str(),
            " (cast one with to_dtype)");
  BLU_CHECK(in[0].dtype() != DType::b8, "arithmetic on bool tensors is not supported");
  return {TensorMeta{broadcast_shapes(in[0].shape(), in[1].shape()), in[0].dtype(), in[0].device()}};
}

std::vector<TensorMeta> infer_compare(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(in[0].dtype() == in[1].dtype(), "dtype mismatch in comparison: ", in[0].str(), " and ", in[1].str());
  return {TensorMeta{broadcast_shapes(in[0].shape(), in[1].shape()), DType::b8, in[0].device()}};
}

// Backward formulas (grad mode is off while they run).
using Ctx = const BackwardContext&;
using Grads = std::span<const Tensor>;

std::vector<Tensor> neg_bw(Ctx, Grads g) { return {neg(g[0])}; }
std::vector<Tensor> exp_bw(Ctx c, Grads g) { return {mul(g[0], c.output(0))}; }
std::vector<Tensor> log_bw(Ctx c, Grads g) { return {div(g[0], c.input(0))}; }
std::vector<Tensor> sqrt_bw(Ctx c, Grads g) { return {div(g[0], mul(c.output(0), 2.0))}; }
std::vector<Tensor> rsqrt_bw(Ctx c, Grads g) {
  const Tensor& y = c.output(0);
  return {mul(mul(g[0], mul(y, mul(y, y))), -0.5)};
}
std::vector<Tensor> tanh_bw(Ctx c, Grads g) {
  const Tensor& y = c.output(0);
  return {mul(g[0], add(neg(mul(y, y)), 1.0))};
}
std::vector<Tensor> sigmoid_bw(Ctx c, Grads g) {
  const Tensor& y = c.output(0);
  return {mul(g[0], mul(y, add(neg(y), 1.0)))};
}
std::vector<Tensor> relu_bw(Ctx c, Grads g) {
  return {where(gt(c.output(0), 0.0), g[0], zeros({}, g[0].dtype(), g[0].device()))};
}
const OpDef kGeluBackward{.name = "gelu_backward", .infer = infer_unary_float};
std::vector<TensorMeta> infer_gelu_and_backward(std::span<const Tensor> in, const Attrs& a) {
  const TensorMeta m = infer_unary_float(in.subspan(1), a)[0];
  return {m, m};
}
const OpDef kGeluAndBackward{.name = "gelu_and_backward", .infer = infer_gelu_and_backward};
std::vector<Tensor> gelu_bw(Ctx c, Grads g) {
  return {dispatch1(kGeluBackward, {g[0], c.input(0)}, c.attrs)};
}
std::vector<Tensor> abs_bw(Ctx c, Grads g) { return {mul(g[0], sign(c.input(0)))}; }
const OpDef kClampBackward{.name = "clamp_backward", .infer = infer_unary_float};
std::vector<Tensor> clamp_bw(Ctx c, Grads g) { return {dispatch1(kClampBackward, {g[0], c.input(0)}, c.attrs)}; }
std::vector<Tensor> pow_scalar_bw(Ctx c, Grads g) {
  const double e = c.attrs.f("value");
  if (e == 0) return {zeros_like(g[0])};
  return {mul(g[0], mul(pow(c.input(0), e - 1), e))};
}
std::vector<Tensor> add_scalar_bw(Ctx, Grads g) { return {g[0]}; }
std::vector<Tensor> mul_scalar_bw(Ctx c, Grads g) { return {mul(g[0], c.attrs.f("value"))}; }

Tensor maybe(bool need, Tensor t) { return need ? std::move(t) : Tensor(); }
std::vector<Tensor> add_bw(Ctx c, Grads g) {
  return {maybe(c.needs_grad[0], sum_to(g[0], c.input_shape(0))), maybe(c.needs_grad[1], sum_to(g[0], c.input_shape(1)))};
}
std::vector<Tensor> sub_bw(Ctx c, Grads g) {
  return {maybe(c.needs_grad[0], sum_to(g[0], c.input_shape(0))),
          c.needs_grad[1] ? sum_to(neg(g[0]), c.input_shape(1)) : Tensor()};
}
std::vector<Tensor> mul_bw(Ctx c, Grads g) {
  return {c.needs_grad[0] ? sum_to(mul(g[0], c.input(1)), c.input_shape(0)) : Tensor(),
          c.needs_grad[1] ? sum_to(mul(g[0], c.input(0)), c.input_shape(1)) : Tensor()};
}
std::vector<Tensor> div_bw(Ctx c, Grads g) {
  const Tensor& b = c.input(1);
  Tensor ga = div(g[0], b);
  return {c.needs_grad[0] ? sum_to(ga, c.input_shape(0)) : Tensor(),
          c.needs_grad[1] ? sum_to(neg(mul(ga, div(c.input(0), b))), c.input_shape(1)) : Tensor()};
}
std::vector<Tensor> pow_bw(Ctx c, Grads g) {
  const Tensor &a = c.input(0), &b = c.input(1);
  Tensor ga, gb;
  if (c.needs_grad[0]) ga = sum_to(mul(g[0], mul(b, pow(a, add(b, -1.0)))), c.input_shape(0));
  if (c.needs_grad[1]) {
    // d/db a^b = a^b log a, taken as 0 where a == 0 (PyTorch's convention).
    Tensor lg = where(eq(a, 0.0), zeros({}, a.dtype(), a.device()), log(a));
    gb = sum_to(mul(g[0], mul(c.output(0), lg)), c.input_shape(1));
  }
  return {ga, gb};
}

std::vector<TensorMeta> infer_where(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(in[0].dtype() == DType::b8, "where: condition must be bool, got ", in[0].str());
  BLU_CHECK(in[1].dtype() == in[2].dtype(), "where: dtype mismatch between ", in[1].str(), " and ", in[2].str());
  return {TensorMeta{broadcast_shapes(in[0].shape(), broadcast_shapes(in[1].shape(), in[2].shape())), in[1].dtype(),
                     in[1].device()}};
}
std::vector<Tensor> where_bw(Ctx c, Grads g) {
  const Tensor& cond = c.input(0);
  Tensor z = zeros({}, g[0].dtype(), g[0].device());
  return {Tensor(), c.needs_grad[1] ? sum_to(where(cond, g[0], z), c.input_shape(1)) : Tensor(),
          c.needs_grad[2] ? sum_to(where(cond, z, g[0]), c.input_shape(2)) : Tensor()};
}

std::vector<TensorMeta> infer_inplace_binary(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(in[0].dtype() == in[1].dtype(), "dtype mismatch: ", in[0].str(), " and ", in[1].str());
  BLU_CHECK(broadcast_shapes(in[0].shape(), in[1].shape()) == in[0].shape(), "in-place: ", in[1].shape(),
            " does not broadcast to ", in[0].shape());
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
std::vector<TensorMeta> infer_inplace_unary(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}

constexpr uint32_t kIn0 = 1, kIn1 = 2, kIn01 = 3, kOut0 = 1;

const OpDef kNeg{.name = "neg", .infer = infer_unary_float, .shard = shard_rule_linear_unary, .backward = neg_bw};
const OpDef kExp{.name = "exp", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = exp_bw, .save_outputs = kOut0};
const OpDef kLog{.name = "log", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = log_bw, .save_inputs = kIn0};
const OpDef kSqrt{.name = "sqrt", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = sqrt_bw, .save_outputs = kOut0};
const OpDef kRsqrt{.name = "rsqrt", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = rsqrt_bw, .save_outputs = kOut0};
const OpDef kTanh{.name = "tanh", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = tanh_bw, .save_outputs = kOut0};
const OpDef kSigmoid{.name = "sigmoid", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = sigmoid_bw, .save_outputs = kOut0};
const OpDef kRelu{.name = "relu", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = relu_bw, .save_outputs = kOut0};
const OpDef kGelu{.name = "gelu", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = gelu_bw, .save_inputs = kIn0};
const OpDef kAbs{.name = "abs", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = abs_bw, .save_inputs = kIn0};
const OpDef kSign{.name = "sign", .infer = infer_unary_float, .shard = shard_rule_pointwise};
const OpDef kClamp{.name = "clamp", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = clamp_bw, .save_inputs = kIn0};
const OpDef kPowScalar{.name = "pow_scalar", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = pow_scalar_bw, .save_inputs = kIn0};
const OpDef kAddScalar{.name = "add_scalar", .infer = infer_unary_float, .shard = shard_rule_pointwise, .backward = add_scalar_bw};
const OpDef kMulScalar{.name = "mul_scalar", .infer = infer_unary_float, .shard = shard_rule_linear_unary, .backward = mul_scalar_bw};
const OpDef kAdd{.name = "add", .infer = infer_binary, .shard = shard_rule_add, .backward = add_bw};
const OpDef kSub{.name = "sub", .infer = infer_binary, .shard = shard_rule_add, .backward = sub_bw};
const OpDef kMul{.name = "mul", .infer = infer_binary, .shard = shard_rule_mul, .backward = mul_bw, .save_inputs = kIn01};
const OpDef kDiv{.name = "div", .infer = infer_binary, .shard = shard_rule_pointwise, .backward = div_bw, .save_inputs = kIn01};
const OpDef kPow{.name = "pow", .infer = infer_binary, .shard = shard_rule_pointwise, .backward = pow_bw, .save_inputs = kIn01, .save_outputs = kOut0};
const OpDef kEq{.name = "eq", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kNe{.name = "ne", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kLt{.name = "lt", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kLe{.name = "le", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kGt{.name = "gt", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kGe{.name = "ge", .infer = infer_compare, .shard = shard_rule_pointwise};
const OpDef kWhere{.name = "where", .infer = infer_where, .shard = shard_rule_pointwise, .backward = where_bw, .save_inputs = kIn0};
const OpDef kAddInplace{.name = "add_", .infer = infer_inplace_binary, .inplace = true};
const OpDef kMulInplace{.name = "mul_", .infer = infer_inplace_binary, .inplace = true};
const OpDef kMulScalarInplace{.name = "mul_scalar_", .infer = infer_inplace_unary, .inplace = true};

Tensor scalar_like(const Tensor& t, double v) { return full({}, v, t.dtype(), t.device()); }

}  // namespace

Tensor neg(const Tensor& x) { return dispatch1(kNeg, {x}); }
Tensor exp(const Tensor& x) { return dispatch1(kExp, {x}); }
Tensor log(const Tensor& x) { return dispatch1(kLog, {x}); }
Tensor sqrt(const Tensor& x) { return dispatch1(kSqrt, {x}); }
Tensor rsqrt(const Tensor& x) { return dispatch1(kRsqrt, {x}); }
Tensor tanh(const Tensor& x) { return dispatch1(kTanh, {x}); }
Tensor sigmoid(const Tensor& x) { return dispatch1(kSigmoid, {x}); }
Tensor relu(const Tensor& x) { return dispatch1(kRelu, {x}); }
Tensor gelu(const Tensor& x, bool approximate) { return dispatch1(kGelu, {x}, Attrs{{"approximate", approximate}}); }
Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool approximate) {
  return dispatch1(kGeluBackward, {grad, x}, Attrs{{"approximate", approximate}});
}
std::vector<Tensor> gelu_and_backward(const Tensor& grad, const Tensor& x, bool approximate) {
  BLU_CHECK(grad.defined() && x.defined() && grad.shape() == x.shape() && grad.dtype() == x.dtype(),
            "gelu_and_backward: grad ", grad.str(), " and x ", x.str(), " must match");
  return dispatch(kGeluAndBackward, {grad, x}, Attrs{{"approximate", approximate}});
}
Tensor abs(const Tensor& x) { return dispatch1(kAbs, {x}); }
Tensor sign(const Tensor& x) { return dispatch1(kSign, {x}); }
Tensor clamp(const Tensor& x, double lo, double hi) {
  BLU_CHECK(!(lo > hi), "clamp: lower bound ", lo, " above upper bound ", hi);
  return dispatch1(kClamp, {x}, Attrs{{"lo", lo}, {"hi", hi}});
}
Tensor pow(const Tensor& x, double e) { return dispatch1(kPowScalar, {x}, Attrs{{"value", e}}); }
Tensor add(const Tensor& x, double s) { return dispatch1(kAddScalar, {x}, Attrs{{"value", s}}); }
Tensor mul(const Tensor& x, double s) { return dispatch1(kMulScalar, {x}, Attrs{{"value", s}}); }
Tensor add(const Tensor& a, const Tensor& b) { return dispatch1(kAdd, {a, b}); }
Tensor sub(const Tensor& a, const Tensor& b) { return dispatch1(kSub, {a, b}); }
Tensor mul(const Tensor& a, const Tensor& b) { return dispatch1(kMul, {a, b}); }
Tensor div(const Tensor& a, const Tensor& b) { return dispatch1(kDiv, {a, b}); }
Tensor pow(const Tensor& a, const Tensor& b) { return dispatch1(kPow, {a, b}); }
Tensor eq(const Tensor& a, const Tensor& b) { return dispatch1(kEq, {a, b}); }
Tensor ne(const Tensor& a, const Tensor& b) { return dispatch1(kNe, {a, b}); }
Tensor lt(const Tensor& a, const Tensor& b) { return dispatch1(kLt, {a, b}); }
Tensor le(const Tensor& a, const Tensor& b) { return dispatch1(kLe, {a, b}); }
Tensor gt(const Tensor& a, const Tensor& b) { return dispatch1(kGt, {a, b}); }
Tensor ge(const Tensor& a, const Tensor& b) { return dispatch1(kGe, {a, b}); }
Tensor eq(const Tensor& a, double s) { return eq(a, scalar_like(a, s)); }
Tensor lt(const Tensor& a, double s) { return lt(a, scalar_like(a, s)); }
Tensor gt(const Tensor& a, double s) { return gt(a, scalar_like(a, s)); }
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) { return dispatch1(kWhere, {cond, a, b}); }
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  BLU_CHECK(mask.dtype() == DType::b8, "masked_fill: mask must be bool, got ", mask.str());
  BLU_CHECK(broadcast_shapes(mask.shape(), x.shape()) == x.shape(), "masked_fill: mask ", mask.shape(),
            " does not broadcast to ", x.shape());
  return where(mask, scalar_like(x, value), x);
}
const Tensor& mul_(const Tensor& a, const Tensor& b) {
  dispatch(kMulInplace, {a, b});
  return a;
}
const Tensor& add_(const Tensor& a, const Tensor& b) {
  dispatch(kAddInplace, {a, b});
  return a;
}
const Tensor& mul_(const Tensor& a, double s) {
  dispatch(kMulScalarInplace, {a}, Attrs{{"value", s}});
  return a;
}

}  // namespace blu
