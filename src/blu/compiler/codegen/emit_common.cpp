// compiler/codegen/emit_common: see emit_common.h.
#include "blu/compiler/codegen/emit_common.h"

namespace blu::compiler {

bool is_float_dtype(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }

bool is_comparison(const std::string& name) {
  return name == "eq" || name == "ne" || name == "lt" || name == "le" || name == "gt" || name == "ge";
}

std::string comparison_expr(const std::string& name, const std::string& a, const std::string& b) {
  const char* op = name == "eq" ? " == " : name == "ne" ? " != " : name == "lt" ? " < " : name == "le" ? " <= "
                 : name == "gt" ? " > " : " >= ";
  return "(" + a + op + b + ")";
}

std::string clamp_backward_expr(const std::string& g, const std::string& x, const std::string& lo,
                                const std::string& hi, const std::string& A) {
  return "(" + x + " >= " + lo + " && " + x + " <= " + hi + " ? " + g + " : " + A + "(0))";
}

bool emit_pointwise_supported(const Op& op) {
  const OpClass c = op_class(op.name);
  if (c == OpClass::unary) return true;
  if (c == OpClass::binary)
    return op.name == "add" || op.name == "sub" || op.name == "mul" || op.name == "div" || op.name == "pow" ||
           is_comparison(op.name);
  if (op.name == "silu_backward" || op.name == "swiglu" || op.name == "gelu_backward" || op.name == "where" ||
      op.name == "clamp_backward" || op.name == "gelu_and_backward")
    return true;
  if (op.name == "swiglu_backward") return !op.attrs.has("joined") || !op.attrs.b("joined");
  return false;
}

bool emit_layout_supported(const Graph& g, const FusedRegion& r, const Op& op) {
  // Two outputs (the gradient pairs) are written element by element, not as rows.
  if ((op.name == "swiglu_backward" || op.name == "gelu_and_backward") && r.shape == RegionShape::rows) return false;
  if (op.name == "softmax" || op.name == "softmax_backward" || op.name == "log_softmax" ||
      op.name == "log_softmax_backward") {
    const Value& y = g.values[size_t(op.outputs[0])];
    const int64_t d = op.attrs.i("dim");
    if (y.shape.empty() || !(d == -1 || d == int64_t(y.shape.size()) - 1)) return false;  // rows of the last dim
  }
  return true;
}

bool emit_dtypes_supported(const Graph& g, const FusedRegion& r, const Op& op) {
  for (int v : op.outputs) {
    const DType t = g.values.at(size_t(v)).dtype;
    if (!(is_float_dtype(t) || (t == DType::b8 && is_comparison(op.name) && r.shape == RegionShape::pointwise)))
      return false;
  }
  for (size_t k = 0; k < op.inputs.size(); ++k) {
    const int v = op.inputs[k];
    if (v < 0) continue;
    const DType t = g.values[size_t(v)].dtype;
    const bool target = (op.name == "cross_entropy" && k == 1) || (op.name == "cross_entropy_backward" && k == 2);
    const bool cond = op.name == "where" && k == 0;
    if (!(is_float_dtype(t) || (target && (t == DType::i32 || t == DType::i64)) || (cond && t == DType::b8))) return false;
  }
  return true;
}

bool emit_adamw_supported(const Graph& g, const FusedRegion& r, const Op& op) {
  if (r.shape != RegionShape::pointwise || op.attrs.i("gate") >= 0 || op.inputs.size() != size_t(op.attrs.b("copies") ? 5 : 4) ||
      op.attrs.has("split"))  // split masters (ops/optim.h) run their own kernel
    return false;
  for (int v : op.inputs)
    if (v < 0 || !g.values[size_t(v)].contiguous()) return false;
  // bf16 moments (Note [Stochastic bf16 moments]) run the library's kernel.
  return g.values[size_t(op.inputs[2])].dtype == DType::f32;
}

bool emit_row_supported(const Op& op) {
  if (op.attrs.has("class_offset")) return false;  // cross-entropy on a shard of the classes
  return op.name == "layer_norm" || op.name == "rms_norm" || op.name == "layer_norm_backward" ||
         op.name == "rms_norm_backward" || op.name == "cross_entropy" || op.name == "cross_entropy_backward" ||
         op.name == "softmax" || op.name == "softmax_backward" || op.name == "log_softmax" ||
         op.name == "log_softmax_backward";
}

bool rows_region_values_fit(const Graph& g, const FusedRegion& r) {
  if (r.shape != RegionShape::rows) return true;
  const int64_t space_n = numel(region_space(g, r));
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    if (emit_row_supported(op) || op.name == "adamw_step") continue;
    for (int v : op.outputs) {
      const int64_t n = numel(g.values.at(size_t(v)).shape);
      if (n != space_n && n != 1) return false;
    }
  }
  return true;
}

Shape region_space(const Graph& g, const FusedRegion& r) {
  Shape space;
  for (int oi : r.ops) {
    for (int v : g.ops[size_t(oi)].outputs)
      if (numel(g.values[size_t(v)].shape) > numel(space)) space = g.values[size_t(v)].shape;
    for (int v : g.ops[size_t(oi)].inputs)
      if (v >= 0 && numel(g.values[size_t(v)].shape) > numel(space)) space = g.values[size_t(v)].shape;
  }
  return space;
}

std::string index_expr(const Value& v, const Shape& space, const std::string& i) {
  if (v.shape == space || numel(v.shape) == numel(space)) return i;
  const Shape vs = contiguous_strides(v.shape);
  std::string e;
  int64_t inner = 1;
  const size_t off = space.size() - v.shape.size();
  for (size_t d = space.size(); d-- > 0;) {
    if (d >= off && v.shape[d - off] == space[d] && space[d] > 1) {
      const std::string term = "(" + i + " / " + std::to_string(inner) + " % " + std::to_string(space[d]) + ") * " +
                               std::to_string(vs[d - off]);
      e += (e.empty() ? "" : " + ") + term;
    }
    inner *= space[d];
  }
  return e.empty() ? "0" : "(" + e + ")";
}

}  // namespace blu::compiler
