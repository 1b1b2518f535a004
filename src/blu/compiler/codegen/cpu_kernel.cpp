// compiler/codegen/cpu_kernel: see cpu_kernel.h.
#include "blu/compiler/codegen/cpu_kernel.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unistd.h>

#include "blu/backend/cpu/fast_math.h"
#include "blu/compiler/codegen/emit_common.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/core/error.h"

namespace blu::compiler {
namespace {

const char* ctype(DType t) {
  switch (t) {
    case DType::i32: return "int32_t";
    case DType::i64: return "int64_t";
    case DType::b8: return "bool";
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::bf16: return "blu::bf16";
    case DType::f16: return "blu::f16";
    default: BLU_CHECK(false, "cpu codegen: dtype ", dtype_name(t), " not supported in a fused region");
  }
}
// Values in a kernel: floats in float (double for f64), a comparison's result as a bool.
const char* acc(DType t) { return t == DType::f64 ? "double" : t == DType::b8 ? "bool" : "float"; }

// A per-step scalar of the region (region.h): read from the kernel's scalar array, never baked.
struct Scalars {
  const Graph& g;
  const FusedRegion& r;
  std::string operator()(int oi, const char* name, const std::string& A) const {
    return A + "(s[" + std::to_string(region_scalar_slot(g, r, oi, name)) + "])";
  }
};

// The expression of a unary op on x (type A), as the eager kernel (backend/cpu/elementwise.cpp).
std::string unary_expr(const Op& op, int oi, const Scalars& sc, const std::string& x, const std::string& A) {
  auto num = [&](const char* a) { return sc(oi, a, A); };
  const std::string& n = op.name;
  if (n == "neg") return "-" + x;
  if (n == "exp" || n == "log" || n == "sqrt" || n == "tanh" || n == "abs") return "std::" + n + "(" + x + ")";
  if (n == "rsqrt") return A + "(1) / std::sqrt(" + x + ")";
  if (n == "sigmoid" ) return "sigmoid_of<" + A + ">(" + x + ")";
  if (n == "silu") return "(" + x + " * sigmoid_of<" + A + ">(" + x + "))";
  if (n == "relu") return "(" + x + " > " + A + "(0) ? " + x + " : (std::isnan(" + x + ") ? " + x + " : " + A + "(0)))";
  if (n == "sign") return A + "((" + x + " > " + A + "(0)) - (" + x + " < " + A + "(0)))";
  if (n == "gelu") return std::string(op.attrs.b("approximate") ? "gelu_tanh" : "gelu_erf") + "<" + A + ">(" + x + ")";
  if (n == "clamp")
    return "(std::isnan(" + x + ") ? " + x + " : std::min(std::max(" + x + ", " + num("lo") + "), " + num("hi") + "))";
  if (n == "pow_scalar") return "std::pow(" + x + ", " + num("value") + ")";
  if (n == "add_scalar") return "(" + x + " + " + num("value") + ")";
  if (n == "mul_scalar") return "(" + x + " * " + num("value") + ")";
  if (n == "cast") return x;
  BLU_CHECK(false, "cpu codegen: no emitter for unary op ", n);
}

std::string binary_expr(const std::string& n, const std::string& a, const std::string& b, const std::string& A) {
  if (n == "add") return "(" + a + " + " + b + ")";
  if (n == "sub") return "(" + a + " - " + b + ")";
  if (n == "mul") return "(" + a + " * " + b + ")";
  if (n == "div") return "(" + a + " / " + b + ")";
  if (n == "pow") return A + "(std::pow(" + a + ", " + b + "))";
  if (is_comparison(n)) return comparison_expr(n, a, b);
  BLU_CHECK(false, "cpu codegen: no emitter for binary op ", n);
}

const char* kPrelude = R"(#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include "blu/backend/cpu/fast_math.h"
#include "blu/core/dtype.h"
// GELU's tanh as the eager kernels take it: the vectorisable one in float, libm in double.
template <typename T> static inline T gelu_tanh_of(T u) {
  if constexpr (sizeof(T) == sizeof(float)) return blu::cpu::tanh_arith(u);
  else return std::tanh(u);
}
template <typename T> static inline T gelu_erf(T x) {
  return T(0.5) * x * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
}
template <typename T> static inline T gelu_tanh(T x) {
  const T k = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
  return T(0.5) * x * (T(1) + gelu_tanh_of(k * (x + T(0.044715) * x * x * x)));
}
template <typename T> static inline T gelu_bwd(T x, bool approx) {
  if (approx) {
    const T k = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
    const T u = k * (x + T(0.044715) * x * x * x);
    const T th = gelu_tanh_of(u);
    const T du = k * (T(1) + T(3 * 0.044715) * x * x);
    return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
  }
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
  const T pdf = std::exp(T(-0.5) * x * x) * T(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
  return cdf + x * pdf;
}
template <typename T> static inline T sigmoid_of(T x) { return T(1) / (T(1) + std::exp(-x)); }
template <typename T> static inline T silu_grad_of(T x) {
  const T s = sigmoid_of(x);
  return s * (T(1) + x * (T(1) - s));
}
)";

}  // namespace

bool cpu_emitter_supports(const Graph& g, const FusedRegion& r) {
  if (!rows_region_values_fit(g, r)) return false;
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    if (op.name == "adamw_step") {
      if (!emit_adamw_supported(g, r, op)) return false;
      continue;
    }
    const bool row = emit_row_supported(op);
    if (!(emit_pointwise_supported(op) || (row && r.shape == RegionShape::rows))) return false;
    if (!emit_dtypes_supported(g, r, op) || !emit_layout_supported(g, r, op)) return false;
  }
  return true;
}

// Emission. Pointwise regions: one loop over the space, each intermediate a scalar. Rows regions:
// one loop over rows; each op runs over its row in turn (intermediates of row length in row
// arrays, per-row statistics and the region's scalar values in scalars); column sums (norm weight
// gradients) accumulate in double arrays over the rows in row order, as eager's serial pass does,
// and are stored after the loop.
std::string emit_cpu_source(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(cpu_emitter_supports(g, r), "cpu codegen: region ", r.index, " holds an op without a CPU emitter");
  const Scalars sc{g, r};
  std::ostringstream os, pre, post;
  os << kPrelude << "// fast_math " << blu::cpu::kFastMathVersion << "\n" << "extern \"C\" void blu_region(void* const* p, const double* s) {\n  (void)s;\n";
  std::map<int, std::string> ptr;  // value id -> pointer name
  std::set<int> written_inputs;
  for (int oi : r.ops)
    for (int w : g.ops[size_t(oi)].writes) written_inputs.insert(g.ops[size_t(oi)].inputs[size_t(w)]);
  size_t k = 0;
  for (int v : r.inputs) {
    ptr[v] = "in" + std::to_string(k);
    const bool w = written_inputs.count(v) > 0;
    os << "  " << (w ? "" : "const ") << "auto* " << ptr[v] << " = static_cast<" << (w ? "" : "const ")
       << ctype(g.values[size_t(v)].dtype) << "*>(p[" << k++ << "]);\n";
  }
  for (size_t j = 0; j < r.outputs.size(); ++j) {
    const int v = r.outputs[j];
    if (ptr.count(v)) continue;
    ptr[v] = "out" + std::to_string(j);
    os << "  auto* " << ptr[v] << " = static_cast<" << ctype(g.values[size_t(v)].dtype) << "*>(p[" << k << "]);\n";
    ++k;
  }
  // The iteration space: the largest value of the region's ops (rows: the row op's input).
  const Shape space = region_space(g, r);
  const int64_t N = numel(space);
  const int64_t C = space.empty() ? 1 : space.back();
  const bool rows = r.shape == RegionShape::rows;
  const std::string Cs = std::to_string(C);
  std::map<int, std::string> local;  // value id -> in-loop variable (rows: array of C, or per-row scalar)
  std::set<int> per_row;             // values that are per-row scalars
  const std::string ie = rows ? "(r * " + Cs + " + k)" : "i";
  auto load = [&](int v, const std::string& i) -> std::string {
    const Value& val = g.values[size_t(v)];
    return std::string(acc(val.dtype)) + "(" + ptr.at(v) + "[" + index_expr(val, space, i) + "])";
  };
  // Element k of a row-length (or broadcast) operand, or element i in a pointwise region.
  auto elem = [&](int v) -> std::string {
    if (local.count(v)) return per_row.count(v) ? local[v] : (rows ? local[v] + "[k]" : local[v]);
    return load(v, ie);
  };
  // The per-row statistic r of v.
  auto stat = [&](int v) -> std::string {
    if (local.count(v)) return local[v];
    return "double(" + ptr.at(v) + "[r])";
  };
  auto is_out = [&](int v) { return std::find(r.outputs.begin(), r.outputs.end(), v) != r.outputs.end(); };
  if (rows) os << "  for (int64_t r = 0; r < " << N / C << "; ++r) {\n";
  else os << "  for (int64_t i = 0; i < " << N << "; ++i) {\n";
  int tmp = 0;
  // Appended rather than `"t" + std::to_string(...)`, on which GCC 12 warns falsely (-Wrestrict).
  auto fresh = [&] {
    std::string name = "t";
    return name += std::to_string(tmp++);
  };
  // Stores value v (type A expression `e`, rounded to v's dtype) as a local and, when it leaves
  // the region, to its pointer.
  auto define = [&](int v, const std::string& e) {
    const Value& val = g.values[size_t(v)];
    const std::string A = acc(val.dtype), T = ctype(val.dtype);
    const std::string var = fresh();
    if (rows && numel(val.shape) == 1 && N != 1) {
      // A scalar (the loss's gradient times 1/grad-accum before cross_entropy_backward): one value
      // per row pass, read as is (elem, stat), not a row of copies.
      os << "    const " << A << " " << var << " = " << A << "(" << T << "(" << e << "));\n";
      if (is_out(v)) os << "    " << ptr[v] << "[0] = " << T << "(" << var << ");\n";
      local[v] = var;
      per_row.insert(v);
      return;
    }
    if (rows) {
      os << "    " << A << " " << var << "[" << C << "];\n    for (int64_t k = 0; k < " << C << "; ++k) {\n"
         << "      " << var << "[k] = " << A << "(" << T << "(" << e << "));\n";
      if (is_out(v)) os << "      " << ptr[v] << "[" << ie << "] = " << T << "(" << var << "[k]);\n";
      os << "    }\n";
    } else {
      os << "    const " << A << " " << var << " = " << A << "(" << T << "(" << e << "));\n";
      if (is_out(v)) os << "    " << ptr[v] << "[i] = " << T << "(" << var << ");\n";
    }
    local[v] = var;
  };
  // A per-row statistic (double `e`), stored in its dtype.
  std::ostringstream row_os;  // a row op's code, inside its own scope; what leaves it is declared in os
  auto define_stat = [&](int v, const std::string& e) {
    const Value& val = g.values[size_t(v)];
    const std::string var = fresh();
    os << "    double " << var << ";\n";
    row_os << "      " << var << " = double(" << ctype(val.dtype) << "(" << e << "));\n";
    if (is_out(v)) row_os << "      " << ptr[v] << "[r] = " << ctype(val.dtype) << "(" << e << ");\n";
    local[v] = var;
    per_row.insert(v);
  };
  // A row array (computed in a loop body `body` that assigns `y`).
  auto define_row = [&](int v, const std::string& A, const std::string& body) {
    const Value& val = g.values[size_t(v)];
    const std::string T = ctype(val.dtype), var = fresh();
    os << "    " << A << " " << var << "[" << C << "];\n";
    row_os << "    for (int64_t k = 0; k < " << C << "; ++k) {\n      " << A << " y;\n" << body << "      " << var
           << "[k] = " << A << "(" << T << "(y));\n";
    if (is_out(v)) row_os << "      " << ptr[v] << "[r * " << C << " + k] = " << T << "(y);\n";
    row_os << "    }\n";
    local[v] = var;
  };
  // A column sum over rows (double), stored after the loop in out's dtype as eager's store does.
  auto column_sum = [&](int v, const std::string& term, const std::string& A) {
    const std::string var = fresh();
    pre << "  static thread_local double " << var << "[" << C << "];\n  for (int64_t k = 0; k < " << C << "; ++k) "
        << var << "[k] = 0;\n";
    row_os << "    for (int64_t k = 0; k < " << C << "; ++k) " << var << "[k] += " << term << ";\n";
    if (is_out(v)) {
      const DType t = g.values[size_t(v)].dtype;
      post << "  for (int64_t k = 0; k < " << C << "; ++k) " << ptr[v] << "[k] = "
           << (t == DType::f32 ? "float(" + var + "[k])" : std::string(ctype(t)) + "(" + A + "(" + var + "[k]))") << ";\n";
    }
  };
  std::ostringstream adam_pre;
  for (int oi : r.ops) {
    const Op& op = g.ops[size_t(oi)];
    auto in = [&](size_t j) { return j < op.inputs.size() ? op.inputs[j] : -1; };
    const std::string n = op.name;
    if (n == "adamw_step") {
      // As backend/cpu/optim.cpp's adamw_one: fp32 arithmetic, coefficients in double then float.
      const std::string o = std::to_string(oi);
      adam_pre << "  const double lr" << o << " = s[" << region_scalar_slot(g, r, oi, "lr") << "], b1_" << o << " = s["
               << region_scalar_slot(g, r, oi, "beta1") << "], b2_" << o << " = s["
               << region_scalar_slot(g, r, oi, "beta2") << "], wd" << o << " = s["
               << region_scalar_slot(g, r, oi, "weight_decay") << "], st" << o << " = s["
               << region_scalar_slot(g, r, oi, "step") << "];\n"
               << "  const double bc1_" << o << " = 1 - std::pow(b1_" << o << ", st" << o << "), bc2_" << o
               << " = 1 - std::pow(b2_" << o << ", st" << o << ");\n"
               << "  const float decay" << o << " = float(1 - lr" << o << " * wd" << o << "), fb1_" << o << " = float(b1_"
               << o << "), fb2_" << o << " = float(b2_" << o << "), omb1_" << o << " = float(1 - b1_" << o << "), omb2_"
               << o << " = float(1 - b2_" << o << "), bc2s" << o << " = float(std::sqrt(bc2_" << o << ")), eps" << o
               << " = float(s[" << region_scalar_slot(g, r, oi, "eps") << "]), nss" << o << " = float(-(lr" << o
               << " / bc1_" << o << "));\n";
      auto at = [&](size_t j) { return ptr.at(in(j)) + "[i]"; };
      const std::string gi = local.count(in(1)) ? "float(" + local[in(1)] + ")" : at(1);
      os << "    {\n      const float gi = " << gi << ";\n      float pi = " << at(0) << " * decay" << o << ";\n"
         << "      const float mi = " << at(2) << " * fb1_" << o << " + omb1_" << o << " * gi;\n"
         << "      const float vi = " << at(3) << " * fb2_" << o << " + omb2_" << o << " * gi * gi;\n"
         << "      const float denom = std::sqrt(vi) / bc2s" << o << " + eps" << o << ";\n"
         << "      pi = pi + nss" << o << " * mi / denom;\n      " << at(0) << " = pi;\n      " << at(2)
         << " = mi;\n      " << at(3) << " = vi;\n";
      if (op.attrs.b("copies")) os << "      " << at(4) << " = " << ctype(g.values[size_t(in(4))].dtype) << "(pi);\n";
      os << "    }\n";
      continue;
    }
    if (emit_row_supported(op)) {
      const Value& x = g.values[size_t(in(n == "layer_norm_backward" || n == "rms_norm_backward" ? 1 : n == "cross_entropy_backward" ? 1 : 0))];
      const std::string A = acc(x.dtype);
      const std::string S = x.dtype == DType::f64 ? "double" : "float";
      auto xe = [&](int v) { return "double(" + elem(v) + ")"; };
      row_os.str("");
      if (n == "softmax") {
        // As backend/cpu/nn.cpp's softmax over the last dimension: in float, e^(x - m) from
        // backend/cpu/fast_math.h summed in double; in double, libm.
        const int xv = in(0);
        const bool f32 = A == "float";
        row_os << "      " << A << " m = -std::numeric_limits<" << A << ">::infinity();\n"
               << "      for (int64_t k = 0; k < " << C << "; ++k) m = std::max(m, " << elem(xv) << ");\n"
               << "      double s0 = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) s0 += "
               << (f32 ? "double(blu::cpu::exp_arith(" + elem(xv) + " - m));\n"
                       : "std::exp(double(" + elem(xv) + " - m));\n")
               << "      const " << A << " inv = " << A << "(1.0 / s0);\n";
        define_row(op.outputs[0], A,
                   f32 ? "      y = blu::cpu::exp_arith(" + elem(xv) + " - m) * inv;\n"
                       : "      y = std::exp(" + elem(xv) + " - m) * inv;\n");
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      if (n == "log_softmax") {
        // As backend/cpu/nn.cpp: e^(x - m) in double (libm), lse = m + log(Σ) in A, y = x - lse.
        const int xv = in(0);
        row_os << "      " << A << " m = -std::numeric_limits<" << A << ">::infinity();\n"
               << "      for (int64_t k = 0; k < " << C << "; ++k) m = std::max(m, " << elem(xv) << ");\n"
               << "      double s0 = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) s0 += std::exp(double(" << elem(xv)
               << " - m));\n      const " << A << " lse = m + " << A << "(std::log(s0));\n";
        define_row(op.outputs[0], A, "      y = " + elem(xv) + " - lse;\n");
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      if (n == "log_softmax_backward") {
        const int gv = in(0), yv = in(1);
        row_os << "      double s0 = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) s0 += double(" << elem(gv)
               << ");\n      const " << A << " sa = " << A << "(s0);\n";
        define_row(op.outputs[0], A, "      y = " + elem(gv) + " - std::exp(" + elem(yv) + ") * sa;\n");
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      if (n == "softmax_backward") {
        const int gv = in(0), yv = in(1);
        row_os << "      double s0 = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) s0 += double(" << elem(gv)
               << ") * double(" << elem(yv) << ");\n      const " << A << " sa = " << A << "(s0);\n";
        define_row(op.outputs[0], A, "      y = " + elem(yv) + " * (" + elem(gv) + " - sa);\n");
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      if (n == "layer_norm" || n == "rms_norm") {
        const bool ln = n == "layer_norm";
        const int xv = in(0), wv = in(1), bv = ln ? in(2) : -1;
        row_os << "      double s0 = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) { const double v = " << xe(xv)
           << "; s0 += " << (ln ? "v" : "v * v") << "; }\n";
        if (ln)
          row_os << "      const double mean = s0 / double(" << C << ");\n      double v0 = 0;\n"
             << "      for (int64_t k = 0; k < " << C << "; ++k) { const double d = " << xe(xv) << " - mean; v0 += d * d; }\n"
             << "      const double rstd = 1.0 / std::sqrt(v0 / double(" << C << ") + " << sc(oi, "eps", "double") << ");\n";
        else
          row_os << "      const double rstd = 1.0 / std::sqrt(s0 / double(" << C << ") + " << sc(oi, "eps", "double") << ");\n";
        if (ln) {
          define_stat(op.outputs[1], "mean");
          define_stat(op.outputs[2], "rstd");
          row_os << "      const " << A << " ma = " << A << "(mean), ra = " << A << "(rstd);\n";
        } else {
          define_stat(op.outputs[1], "rstd");
          row_os << "      const " << A << " ra = " << A << "(rstd);\n";
        }
        std::string body = ln ? "      y = (" + elem(xv) + " - ma) * ra;\n" : "      y = " + elem(xv) + " * ra;\n";
        if (wv >= 0) body += "      y = y * " + elem(wv) + ";\n";
        if (bv >= 0) body += "      y = y + " + elem(bv) + ";\n";
        define_row(op.outputs[0], A, body);
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      if (n == "layer_norm_backward" || n == "rms_norm_backward") {
        const bool ln = n == "layer_norm_backward";
        const int gv = in(0), xv = in(1), wv = in(2), mv = ln ? in(3) : -1, rv = ln ? in(4) : in(3);
        const int pv = in(ln ? 5 : 4);  // the gradient waiting for x: added after rounding
        const std::string wexpr = wv >= 0 ? "double(" + elem(wv) + ")" : "1.0";
        row_os << "      const double mean = " << (ln ? stat(mv) : "0.0") << ", rstd = " << stat(rv) << ";\n"
           << "      double sg = 0, sgx = 0;\n      for (int64_t k = 0; k < " << C << "; ++k) {\n"
           << "        const double gh = " << xe(gv) << " * " << wexpr << ";\n";
        if (ln) row_os << "        sg += gh;\n        sgx += gh * (" << xe(xv) << " - mean) * rstd;\n      }\n"
                   << "      sg /= double(" << C << ");\n      sgx /= double(" << C << ");\n";
        else row_os << "        sgx += gh * " << xe(xv) << " * rstd;\n      }\n      sgx /= double(" << C << ");\n";
        std::string body = "      const double xh = (" + xe(xv) + (ln ? " - mean" : "") + ") * rstd;\n"
                           "      const double gh = " + xe(gv) + " * " + wexpr + ";\n"
                           "      y = " + A + "(rstd * (gh - " + (ln ? "sg - " : "") + "xh * sgx));\n";
        if (pv >= 0)
          body += "      y = " + A + "(" + ctype(g.values[size_t(op.outputs[0])].dtype) + "(y)) + " + elem(pv) + ";\n";
        define_row(op.outputs[0], A, body);
        if (ln) {
          column_sum(op.outputs[1], xe(gv) + " * (" + xe(xv) + " - mean) * rstd", A);
          column_sum(op.outputs[2], xe(gv), A);
        } else {
          column_sum(op.outputs[1], xe(gv) + " * " + xe(xv) + " * rstd", A);
        }
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      // cross_entropy: (logits, target) -> loss, lse; cross_entropy_backward: (g, logits, target, lse) -> gx.
      const int64_t K = op.attrs.i("classes"), ignore = op.attrs.i("ignore_index");
      const auto red = op.attrs.i("reduction");  // Reduction: none 0, mean 1, sum 2
      const std::string Ks = std::to_string(K), ig = std::to_string(ignore);
      if (n == "cross_entropy") {
        const int xv = in(0), tv = in(1);
        row_os << "      const int64_t tv = int64_t(" << ptr.at(tv) << "[r]);\n"
           << "      " << A << " m = -std::numeric_limits<" << A << ">::infinity();\n"
           << "      for (int64_t k = 0; k < " << Ks << "; ++k) m = std::max(m, " << elem(xv) << ");\n"
           << "      double s0 = 0;\n      for (int64_t k = 0; k < " << Ks << "; ++k) s0 += std::exp(double(" << elem(xv)
           << ") - double(m));\n      const double l = double(m) + std::log(s0);\n";
        define_stat(op.outputs[1], "l");
        row_os << "      double lrow = 0;\n      if (tv != " << ig << ") { const int64_t k = tv; lrow = l - double(" << elem(xv)
           << "); }\n";
        const int lv = op.outputs[0];
        if (red == 0) {
          row_os << "      " << ptr.at(lv) << "[r] = " << S << "(lrow);\n";
        } else {
          pre << "  double ce_total" << oi << " = 0; int64_t ce_count" << oi << " = 0;\n";
          row_os << "      ce_total" << oi << " += lrow;\n      if (tv != " << ig << ") ++ce_count" << oi << ";\n";
          if (is_out(lv))
            post << "  " << ptr.at(lv) << "[0] = " << S << "(" << (red == 2 ? "ce_total" + std::to_string(oi)
                                                                      : "ce_total" + std::to_string(oi) + " / double(ce_count" + std::to_string(oi) + ")")
                 << ");\n";
        }
        os << "    {\n" << row_os.str() << "    }\n";
        continue;
      }
      // cross_entropy_backward
      const int gv = in(0), xv = in(1), tv = in(2), lsev = in(3);
      if (red == 1) {
        // mean: the count of counted rows, before the loop (eager counts them first).
        pre << "  int64_t ceb_count" << oi << " = 0;\n  for (int64_t r = 0; r < " << N / C << "; ++r) if (int64_t("
            << ptr.at(tv) << "[r]) != " << ig << ") ++ceb_count" << oi << ";\n";
      }
      row_os << "      const int64_t tv = int64_t(" << ptr.at(tv) << "[r]);\n";
      const std::string gval = local.count(gv) ? local[gv] : ptr.at(gv) + (red == 0 ? "[r]" : "[0]");
      row_os << "      " << A << " scale = " << A << "(" << gval << ");\n";
      if (red == 1) row_os << "      scale = " << A << "(double(scale) / double(ceb_count" << oi << "));\n";
      row_os << "      const " << A << " lse = " << A << "(" << (local.count(lsev) ? local[lsev] : ptr.at(lsev) + "[r]") << ");\n";
      std::string body = "      if (tv == " + ig + " || k >= " + Ks + ") y = " + A + "(0);\n      else y = (std::exp(" +
                         elem(xv) + " - lse) - " + A + "(k == tv ? 1 : 0)) * scale;\n";
      define_row(op.outputs[0], A, body);
      os << "    {\n" << row_os.str() << "    }\n";
      continue;
    }
    // Pointwise ops.
    const Value& out = g.values[size_t(op.outputs[0])];
    const std::string A = acc(out.dtype);
    if (n == "swiglu_backward") {
      // (g, gate, up) -> d_gate = g·up·silu'(gate), d_up = g·silu(gate), as backend/cpu/swiglu.cpp.
      const std::string gs = elem(in(0)), a = elem(in(1)), b = elem(in(2));
      if (rows) BLU_CHECK(false, "cpu codegen: swiglu_backward in a rows region");
      os << "    const " << A << " sg_s" << oi << " = sigmoid_of<" << A << ">(" << a << ");\n";
      define(op.outputs[0], gs + " * " + b + " * (sg_s" + std::to_string(oi) + " * (" + A + "(1) + " + a + " * (" + A +
                                "(1) - sg_s" + std::to_string(oi) + ")))");
      define(op.outputs[1], gs + " * (" + a + " * sg_s" + std::to_string(oi) + ")");
      continue;
    }
    if (n == "gelu_and_backward") {
      // (g, x) -> gelu(x), g·gelu'(x), as backend/cpu/elementwise.cpp.
      if (rows) BLU_CHECK(false, "cpu codegen: gelu_and_backward in a rows region");
      const bool approx = op.attrs.b("approximate");
      const std::string x = elem(in(1)), gs = elem(in(0));
      define(op.outputs[0], std::string(approx ? "gelu_tanh" : "gelu_erf") + "<" + A + ">(" + x + ")");
      define(op.outputs[1], gs + " * gelu_bwd<" + A + ">(" + x + ", " + (approx ? "true" : "false") + ")");
      continue;
    }
    std::string e;
    if (n == "silu_backward") e = elem(in(0)) + " * silu_grad_of<" + A + ">(" + elem(in(1)) + ")";
    else if (n == "clamp_backward")
      e = clamp_backward_expr(elem(in(0)), elem(in(1)), sc(oi, "lo", A), sc(oi, "hi", A), A);
    else if (n == "gelu_backward") e = elem(in(0)) + " * gelu_bwd<" + A + ">(" + elem(in(1)) + ", " + (op.attrs.b("approximate") ? "true" : "false") + ")";
    else if (n == "where") e = "(" + elem(in(0)) + " ? " + elem(in(1)) + " : " + elem(in(2)) + ")";
    else if (n == "swiglu") e = elem(in(0)) + " * sigmoid_of<" + A + ">(" + elem(in(0)) + ") * " + elem(in(1));
    else if (op_class(n) == OpClass::unary) e = n == "cast" ? A + "(" + elem(in(0)) + ")" : unary_expr(op, oi, sc, elem(in(0)), A);
    else e = binary_expr(n, elem(in(0)), elem(in(1)), A);
    define(op.outputs[0], e);
  }
  os << "  }\n" << post.str() << "}\n";
  std::string body = os.str();
  const std::string head = "extern \"C\" void blu_region(void* const* p, const double* s) {\n  (void)s;\n";
  const size_t at = body.find(head) + head.size();
  // Pointer declarations come right after the head; the loop-invariant set-up goes before the loop.
  const size_t loop = body.find(rows ? "  for (int64_t r = 0;" : "  for (int64_t i = 0;", at);
  body.insert(loop, adam_pre.str() + pre.str());
  return body;
}

std::string cpu_toolchain_version() {
  static const std::string v = [] {
    std::string out;
    if (FILE* f = ::popen("c++ --version 2>/dev/null | head -1", "r")) {
      char buf[256];
      while (std::fgets(buf, sizeof buf, f)) out += buf;
      ::pclose(f);
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    return out.empty() ? std::string("unknown") : out;
  }();
  return v;
}

std::unique_ptr<CpuKernel> CpuKernel::load(const Graph& g, const FusedRegion& r, bool* compiled) {
  namespace fs = std::filesystem;
  const std::string text = region_text(g, r);
  const std::string src = emit_cpu_source(g, r);
  // The source is in the key: a change of the emitter (or of fast_math.h's version) misses.
  const std::string key = kernel_cache_key(text + "\n" + src, kCpuTarget, cpu_toolchain_version());
  const std::optional<CacheEntry> hit = kernel_cache_find(key, "so", text);
  if (compiled) *compiled = !hit;
  std::string path = hit ? hit->path : std::string();
  if (!hit) {
    const fs::path dir = fs::temp_directory_path() / ("blu_region_" + key + "_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    { std::ofstream(dir / "region.cpp") << src; }
    // Same compiler family and no -ffast-math or FMA contraction, as the eager kernels.
    const std::string cmd = "c++ -std=c++20 -O2 -fPIC -shared -ffp-contract=off -I" + std::string(BLU_SOURCE_DIR) +
                            "/src " + (dir / "region.cpp").string() + " -o " + (dir / "region.so").string() + " 2>" +
                            (dir / "log.txt").string();
    const int rc = std::system(cmd.c_str());
    std::string log;
    { std::ifstream f(dir / "log.txt"); std::ostringstream s; s << f.rdbuf(); log = s.str(); }
    BLU_CHECK(rc == 0, "cpu codegen: compiling region ", r.index, " failed (", cmd, "):\n", log, "\nsource:\n", src);
    std::ifstream so(dir / "region.so", std::ios::binary);
    std::ostringstream bytes;
    bytes << so.rdbuf();
    path = kernel_cache_store(key, "so", bytes.str(), text);
    fs::remove_all(dir);
  }
  std::unique_ptr<CpuKernel> k(new CpuKernel());
  k->handle_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  BLU_CHECK(k->handle_, "cpu codegen: dlopen ", path, ": ", ::dlerror());
  k->fn_ = reinterpret_cast<void (*)(void* const*, const double*)>(::dlsym(k->handle_, "blu_region"));
  BLU_CHECK(k->fn_, "cpu codegen: ", path, " has no blu_region");
  return k;
}

CpuKernel::~CpuKernel() {
  if (handle_) ::dlclose(handle_);
}

void CpuKernel::run(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs,
                    const std::vector<double>& scalars) const {
  const std::vector<void*> p = region_operand_pointers(ins, outs);
  fn_(p.data(), scalars.data());
}

}  // namespace blu::compiler
