// compiler/codegen/cpu_kernel: see cpu_kernel.h.
#include "blu/compiler/codegen/cpu_kernel.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unistd.h>

#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/core/error.h"

namespace blu::compiler {
namespace {

const char* ctype(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::bf16: return "blu::bf16";
    case DType::f16: return "blu::f16";
    default: BLU_CHECK(false, "cpu codegen: dtype ", dtype_name(t), " not supported in a fused region");
  }
}
const char* acc(DType t) { return t == DType::f64 ? "double" : "float"; }

// The expression of a unary op on x (type A), as the eager kernel (backend/cpu/elementwise.cpp).
std::string unary_expr(const Op& op, const std::string& x, const std::string& A) {
  auto num = [&](const char* a) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%s(%.17g)", A.c_str(), op.attrs.f(a));
    return std::string(buf);
  };
  const std::string& n = op.name;
  if (n == "neg") return "-" + x;
  if (n == "exp" || n == "log" || n == "sqrt" || n == "tanh" || n == "abs") return "std::" + n + "(" + x + ")";
  if (n == "rsqrt") return A + "(1) / std::sqrt(" + x + ")";
  if (n == "sigmoid") return A + "(1) / (" + A + "(1) + std::exp(-" + x + "))";
  if (n == "relu") return "(" + x + " > " + A + "(0) ? " + x + " : (std::isnan(" + x + ") ? " + x + " : " + A + "(0)))";
  if (n == "sign") return A + "((" + x + " > " + A + "(0)) - (" + x + " < " + A + "(0)))";
  if (n == "gelu") return std::string(op.attrs.b("approximate") ? "gelu_tanh" : "gelu_erf") + "<" + A + ">(" + x + ")";
  if (n == "clamp")
    return "(std::isnan(" + x + ") ? " + x + " : std::min(std::max(" + x + ", " + num("lo") + "), " + num("hi") + "))";
  if (n == "pow_scalar") return "std::pow(" + x + ", " + num("value") + ")";
  if (n == "add_scalar") return x + " + " + num("value");
  if (n == "mul_scalar") return x + " * " + num("value");
  if (n == "cast") return x;
  BLU_CHECK(false, "cpu codegen: no emitter for unary op ", n);
}

std::string binary_expr(const std::string& n, const std::string& a, const std::string& b, const std::string& A) {
  if (n == "add") return a + " + " + b;
  if (n == "sub") return a + " - " + b;
  if (n == "mul") return a + " * " + b;
  if (n == "div") return a + " / " + b;
  if (n == "pow") return A + "(std::pow(" + a + ", " + b + "))";
  BLU_CHECK(false, "cpu codegen: no emitter for binary op ", n);
}

const char* kPrelude = R"(#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include "blu/core/dtype.h"
template <typename T> static inline T gelu_erf(T x) {
  return T(0.5) * x * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
}
template <typename T> static inline T gelu_tanh(T x) {
  const T k = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
  return T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
}
)";

// The element index of value v at iteration index `i` of a space of shape `space` (broadcast by
// NumPy rules): a sum of (i / inner) % size * stride terms over the dimensions v does not
// broadcast; `i` itself when v covers the space.
std::string index_expr(const Value& v, const Shape& space, const std::string& i) {
  if (v.shape == space) return i;
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

}  // namespace

bool cpu_emitter_supports(const Graph& g, const FusedRegion& r) {
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    const OpClass c = op_class(op.name);
    const bool ok = (c == OpClass::unary) || (c == OpClass::binary && op.name.size() <= 3 && op.name != "eq" &&
                                              op.name != "ne" && op.name != "lt" && op.name != "le" &&
                                              op.name != "gt" && op.name != "ge") ||
                    op.name == "layer_norm";
    if (!ok) return false;
    for (int v : op.outputs) {
      const DType t = g.values.at(size_t(v)).dtype;
      if (!(t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16)) return false;
    }
  }
  return true;
}

std::string emit_cpu_source(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(cpu_emitter_supports(g, r), "cpu codegen: region ", r.index, " holds an op without a CPU emitter");
  std::ostringstream os;
  os << kPrelude << "extern \"C\" void blu_region(void* const* p) {\n";
  std::map<int, std::string> ptr;  // value id -> pointer name
  size_t k = 0;
  for (int v : r.inputs) {
    ptr[v] = "in" + std::to_string(k);
    os << "  const auto* " << ptr[v] << " = static_cast<const " << ctype(g.values[size_t(v)].dtype) << "*>(p[" << k++
       << "]);\n";
  }
  for (size_t j = 0; j < r.outputs.size(); ++j) {
    const int v = r.outputs[j];
    ptr[v] = "out" + std::to_string(j);
    os << "  auto* " << ptr[v] << " = static_cast<" << ctype(g.values[size_t(v)].dtype) << "*>(p[" << k++ << "]);\n";
  }
  // The iteration space: the largest output of the region's ops (rows: the row op's input).
  Shape space;
  for (int oi : r.ops)
    for (int v : g.ops[size_t(oi)].outputs)
      if (numel(g.values[size_t(v)].shape) > numel(space)) space = g.values[size_t(v)].shape;
  const int64_t N = numel(space);
  const int64_t C = space.empty() ? 1 : space.back();
  const bool rows = r.shape == RegionShape::rows;
  std::map<int, std::string> local;  // value id -> name of its in-loop variable
  auto load = [&](int v, const std::string& i) -> std::string {
    if (local.count(v)) return local[v];
    const Value& val = g.values[size_t(v)];
    return std::string(acc(val.dtype)) + "(" + ptr.at(v) + "[" + index_expr(val, space, i) + "])";
  };
  // Rows: every op runs over the row's C elements in turn; intermediates of the row live in
  // row-length arrays. Pointwise: one loop, intermediates are scalars.
  if (rows) os << "  for (int64_t r = 0; r < " << N / C << "; ++r) {\n";
  else os << "  for (int64_t i = 0; i < " << N << "; ++i) {\n";
  int tmp = 0;
  for (int oi : r.ops) {
    const Op& op = g.ops[size_t(oi)];
    const Value& out = g.values[size_t(op.outputs[0])];
    const std::string A = acc(out.dtype), T = ctype(out.dtype);
    const std::string var = "t" + std::to_string(tmp++);
    const bool is_out = ptr.count(op.outputs[0]) > 0;
    if (op.name == "layer_norm") {
      // As backend/cpu/nn.cpp's layer_norm: mean and variance in double, then (x - mean) * rstd
      // [* w] [+ b] in A.
      const Value& x = g.values[size_t(op.inputs[0])];
      const std::string xi = local.count(op.inputs[0]) ? local[op.inputs[0]] + "[k]" : load(op.inputs[0], "(r * " + std::to_string(C) + " + k)");
      os << "    " << A << " " << var << "[" << C << "];\n    {\n      double s = 0;\n"
         << "      for (int64_t k = 0; k < " << C << "; ++k) s += double(" << xi << ");\n"
         << "      const double mean = s / double(" << C << ");\n      double v = 0;\n"
         << "      for (int64_t k = 0; k < " << C << "; ++k) { const double d = double(" << xi
         << ") - mean; v += d * d; }\n"
         << "      const double rstd = 1.0 / std::sqrt(v / double(" << C << ") + " << op.attrs.f("eps") << ");\n";
      (void)x;
      for (int j = 1; j <= 2; ++j)
        if (ptr.count(op.outputs[size_t(j)]))
          os << "      " << ptr[op.outputs[size_t(j)]] << "[r] = " << ctype(g.values[size_t(op.outputs[size_t(j)])].dtype)
             << "(" << (j == 1 ? "mean" : "rstd") << ");\n";
      os << "      const " << A << " ma = " << A << "(mean), ra = " << A << "(rstd);\n"
         << "      for (int64_t k = 0; k < " << C << "; ++k) {\n        " << A << " y = (" << A << "(" << xi
         << ") - ma) * ra;\n";
      if (op.inputs.size() > 1 && op.inputs[1] >= 0) os << "        y = y * " << load(op.inputs[1], "k") << ";\n";
      if (op.inputs.size() > 2 && op.inputs[2] >= 0) os << "        y = y + " << load(op.inputs[2], "k") << ";\n";
      os << "        " << var << "[k] = " << A << "(" << T << "(y));\n";
      if (is_out) os << "        " << ptr[op.outputs[0]] << "[r * " << C << " + k] = " << T << "(y);\n";
      os << "      }\n    }\n";
      local[op.outputs[0]] = var;
      continue;
    }
    // A pointwise op: in a rows region a loop over the row, else one element.
    const std::string i = rows ? "(r * " + std::to_string(C) + " + k)" : "i";
    auto operand = [&](int v) {
      if (local.count(v)) return rows ? local[v] + "[k]" : local[v];
      return load(v, i);
    };
    std::string e;
    if (op_class(op.name) == OpClass::unary) {
      const DType in_t = g.values[size_t(op.inputs[0])].dtype;
      e = op.name == "cast" ? A + "(" + operand(op.inputs[0]) + ")" : unary_expr(op, operand(op.inputs[0]), A);
      (void)in_t;
    } else {
      e = binary_expr(op.name, operand(op.inputs[0]), operand(op.inputs[1]), A);
    }
    if (rows) {
      os << "    " << A << " " << var << "[" << C << "];\n    for (int64_t k = 0; k < " << C << "; ++k) {\n"
         << "      " << var << "[k] = " << A << "(" << T << "(" << e << "));\n";
      if (is_out) os << "      " << ptr[op.outputs[0]] << "[" << i << "] = " << T << "(" << var << "[k]);\n";
      os << "    }\n";
    } else {
      os << "    const " << A << " " << var << " = " << A << "(" << T << "(" << e << "));\n";
      if (is_out) os << "    " << ptr[op.outputs[0]] << "[i] = " << T << "(" << var << ");\n";
    }
    local[op.outputs[0]] = var;
  }
  os << "  }\n}\n";
  return os.str();
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
  const std::string key = kernel_cache_key(text, "cpu-x86_64", cpu_toolchain_version());
  std::optional<std::string> path = kernel_cache_find(key, "so", text);
  if (compiled) *compiled = !path;
  if (!path) {
    const std::string src = emit_cpu_source(g, r);
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
  k->handle_ = ::dlopen(path->c_str(), RTLD_NOW | RTLD_LOCAL);
  BLU_CHECK(k->handle_, "cpu codegen: dlopen ", *path, ": ", ::dlerror());
  k->fn_ = reinterpret_cast<void (*)(void* const*)>(::dlsym(k->handle_, "blu_region"));
  BLU_CHECK(k->fn_, "cpu codegen: ", *path, " has no blu_region");
  return k;
}

CpuKernel::~CpuKernel() {
  if (handle_) ::dlclose(handle_);
}

void CpuKernel::run(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs) const {
  std::vector<void*> p;
  for (const Tensor& t : ins) {
    BLU_CHECK(t.is_contiguous(), "fused region: input ", t.str(), " must be contiguous");
    p.push_back(t.raw_data());
  }
  for (const Tensor& t : outs) {
    BLU_CHECK(t.is_contiguous(), "fused region: output ", t.str(), " must be contiguous");
    p.push_back(t.raw_data());
  }
  fn_(p.data());
}

}  // namespace blu::compiler
