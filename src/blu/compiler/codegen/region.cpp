// compiler/codegen/region: op classes, a region's inputs/outputs and its canonical text.
#include "blu/compiler/codegen/region.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "blu/core/error.h"
#include "blu/core/tensor.h"

namespace blu::compiler {

OpClass op_class(const std::string& name) {
  static const std::unordered_map<std::string, OpClass> table = [] {
    std::unordered_map<std::string, OpClass> t;
    for (const char* n : {"neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "abs",
                          "sign", "clamp", "pow_scalar", "add_scalar", "mul_scalar", "cast"})
      t[n] = OpClass::unary;
    for (const char* n : {"add", "sub", "mul", "div", "pow", "eq", "ne", "lt", "le", "gt", "ge"}) t[n] = OpClass::binary;
    for (const char* n : {"where", "gelu_backward", "silu_backward", "swiglu", "swiglu_backward", "clamp_backward",
                          "gelu_and_backward"})
      t[n] = OpClass::pointwise;
    for (const char* n : {"layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "softmax",
                          "softmax_backward", "log_softmax", "log_softmax_backward", "cross_entropy",
                          "cross_entropy_backward"})
      t[n] = OpClass::row;
    t["adamw_step"] = OpClass::adamw;
    for (const char* n : {"matmul", "linear", "linear_weight_grad", "linear_weight_grad_into", "gelu_linear",
                          "flash_attention", "flash_attention_backward", "embedding", "embedding_backward",
                          "embedding_backward_add_", "rotary_embedding", "rotary_embedding_backward"})
      t[n] = OpClass::library;
    return t;
  }();
  auto it = table.find(name);
  return it == table.end() ? OpClass::other : it->second;
}

void compute_region_io(const Graph& g, FusedRegion& r) {
  const std::set<int> members(r.ops.begin(), r.ops.end());
  std::set<int> defined;
  r.inputs.clear();
  r.outputs.clear();
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    for (int v : op.inputs)
      if (v >= 0 && !defined.count(v) && std::find(r.inputs.begin(), r.inputs.end(), v) == r.inputs.end())
        r.inputs.push_back(v);
    for (int v : op.outputs) defined.insert(v);
  }
  std::set<int> read_outside(g.outputs.begin(), g.outputs.end());
  for (size_t oi = 0; oi < g.ops.size(); ++oi)
    if (!members.count(int(oi)))
      for (int v : g.ops[oi].inputs) read_outside.insert(v);
  for (int oi : r.ops)
    for (int v : g.ops.at(size_t(oi)).outputs)
      if (read_outside.count(v)) r.outputs.push_back(v);
}

bool is_step_scalar(std::string_view name, const AttrValue& v) {
  return std::holds_alternative<double>(v) || (name == "step" && std::holds_alternative<int64_t>(v));
}

std::vector<double> region_scalars(const Graph& g, const FusedRegion& r) {
  std::vector<double> s;
  for (int oi : r.ops)
    for (const auto& [k, v] : g.ops.at(size_t(oi)).attrs.items())
      if (is_step_scalar(k, v))
        s.push_back(std::holds_alternative<double>(v) ? std::get<double>(v) : double(std::get<int64_t>(v)));
  return s;
}

int region_scalar_slot(const Graph& g, const FusedRegion& r, int oi, std::string_view name) {
  int slot = 0;
  for (int o : r.ops)
    for (const auto& [k, v] : g.ops.at(size_t(o)).attrs.items())
      if (is_step_scalar(k, v)) {
        if (o == oi && k == name) return slot;
        ++slot;
      }
  BLU_CHECK(false, "fused region: op ", oi, " has no per-step scalar '", name, "'");
}

std::string region_text(const Graph& g, const FusedRegion& r) {
  std::map<int, std::string> names;
  for (size_t i = 0; i < r.inputs.size(); ++i) names[r.inputs[i]] = "in" + std::to_string(i);
  int next = 0;
  auto type_of = [&](int v) {
    const Value& val = g.values.at(size_t(v));
    std::ostringstream os;
    os << dtype_name(val.dtype) << "[";
    for (size_t k = 0; k < val.shape.size(); ++k) os << (k ? "," : "") << val.shape[k];
    os << "]";
    if (val.strides != contiguous_strides(val.shape) || val.offset != 0) os << "strided";
    return os.str();
  };
  std::ostringstream os;
  os << "region " << (r.shape == RegionShape::rows ? "rows" : "pointwise") << "(";
  for (size_t i = 0; i < r.inputs.size(); ++i) os << (i ? ", " : "") << "in" << i << ": " << type_of(r.inputs[i]);
  os << ")\n";
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    os << "  ";
    for (size_t j = 0; j < op.outputs.size(); ++j) {
      names[op.outputs[j]] = "t" + std::to_string(next++);
      os << (j ? ", " : "") << names[op.outputs[j]] << ": " << type_of(op.outputs[j]);
    }
    os << " = " << op.name << "(";
    for (size_t k = 0; k < op.inputs.size(); ++k) os << (k ? ", " : "") << (op.inputs[k] < 0 ? "none" : names.at(op.inputs[k]));
    os << ")";
    for (const auto& [k, v] : op.attrs.items()) {
      os << " " << k << "=";
      if (is_step_scalar(k, v)) {
        os << "?";
        continue;
      }
      std::visit(
          [&](const auto& x) {
            using T = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<T, Shape>) {
              for (size_t i = 0; i < x.size(); ++i) os << (i ? "x" : "") << x[i];
            } else if constexpr (std::is_same_v<T, DType>) {
              os << dtype_name(x);
            } else if constexpr (std::is_same_v<T, double>) {
              char buf[40];
              std::snprintf(buf, sizeof buf, "%.17g", x);
              os << buf;
            } else {
              os << x;
            }
          },
          v);
    }
    os << "\n";
  }
  os << "  return";
  for (size_t i = 0; i < r.outputs.size(); ++i) os << (i ? ", " : " ") << names.at(r.outputs[i]);
  os << "\n";
  return os.str();
}

std::vector<void*> region_operand_pointers(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs) {
  std::vector<void*> p;
  for (const Tensor& t : ins) {
    BLU_CHECK(t.is_contiguous(), "fused region: input ", t.str(), " must be contiguous");
    p.push_back(t.raw_data());
  }
  for (const Tensor& t : outs) {
    BLU_CHECK(t.is_contiguous(), "fused region: output ", t.str(), " must be contiguous");
    p.push_back(t.raw_data());
  }
  return p;
}

}  // namespace blu::compiler
