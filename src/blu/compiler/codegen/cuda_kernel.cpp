// compiler/codegen/cuda_kernel: see cuda_kernel.h.
#include "blu/compiler/codegen/cuda_kernel.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "blu/compiler/codegen/emit_common.h"
#include "blu/core/error.h"

namespace blu::compiler {
namespace {

constexpr int kBlock = 256;  // threads per block of a pointwise kernel
// The most blocks (partial rows) of a rows kernel with column sums.
constexpr int64_t kColumnBlocks = 1024;

const char* dev_ctype(DType t) {
  switch (t) {
    case DType::i32: return "int";
    case DType::i64: return "i64";
    case DType::b8: return "bool";
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::bf16: return "bf16s";
    case DType::f16: return "f16s";
    default: BLU_CHECK(false, "cuda codegen: dtype ", dtype_name(t), " not supported in a fused region");
  }
}
// Values in a kernel: floats in float (double for f64), a comparison's result as a bool.
const char* acc(DType t) { return t == DType::f64 ? "double" : t == DType::b8 ? "bool" : "float"; }
// The expression `e` (accumulation type) rounded to dtype t, as a value of t's storage type.
std::string round_to(DType t, const std::string& e) {
  switch (t) {
    case DType::bf16: return "to_bf16(" + e + ")";
    case DType::f16: return "to_f16(" + e + ")";
    default: return std::string(dev_ctype(t)) + "(" + e + ")";
  }
}

const char* kPrelude = R"(typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;
struct bf16s { u16 x; };
struct f16s { u16 x; };
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ bool to_acc(bool x) { return x; }
__device__ __forceinline__ float to_acc(bf16s b) { return __uint_as_float(u32(b.x) << 16); }
__device__ __forceinline__ float to_acc(f16s h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f; }
// One rounding, ties to even; NaN as the CPU writes it (bf16 0x7fc0, f16 sign|0x7e00).
__device__ __forceinline__ bf16s to_bf16(float f) {
  bf16s r;
  if (f != f) { r.x = 0x7fc0; return r; }
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
  return r;
}
__device__ __forceinline__ f16s to_f16(float f) {
  f16s r;
  if (f != f) { r.x = u16(((__float_as_uint(f) >> 16) & 0x8000u) | 0x7e00u); return r; }
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
  return r;
}
__device__ __forceinline__ float bexp(float x) { return expf(x); }
__device__ __forceinline__ double bexp(double x) { return exp(x); }
__device__ __forceinline__ float blog(float x) { return logf(x); }
__device__ __forceinline__ double blog(double x) { return log(x); }
__device__ __forceinline__ float bsqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double bsqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float btanh(float x) { return tanhf(x); }
__device__ __forceinline__ double btanh(double x) { return tanh(x); }
__device__ __forceinline__ float berf(float x) { return erff(x); }
__device__ __forceinline__ double berf(double x) { return erf(x); }
__device__ __forceinline__ float babs(float x) { return fabsf(x); }
__device__ __forceinline__ double babs(double x) { return fabs(x); }
__device__ __forceinline__ float bpow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double bpow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ bool bnan(float x) { return x != x; }
__device__ __forceinline__ bool bnan(double x) { return x != x; }
// backend/cuda/elementwise.cu's fast tanh for 16-bit GELU outputs.
__device__ __forceinline__ float fast_tanh(float u) {
  const float t = 1.f - __fdividef(2.f, __expf(2.f * fabsf(u)) + 1.f);
  return copysignf(t, u);
}
template <typename A> __device__ __forceinline__ A gelu_tanh_of(A u, bool fast) { return btanh(u); }
template <> __device__ __forceinline__ float gelu_tanh_of<float>(float u, bool fast) { return fast ? fast_tanh(u) : tanhf(u); }
#define K_SQRT2 1.41421356237309504880
#define K_INV_SQRTPI 0.56418958354775628695
template <typename A> __device__ __forceinline__ A gelu_fwd(A x, bool approx, bool fast) {
  if (approx) {
    const A k = A(K_SQRT2 * K_INV_SQRTPI);
    const A cube = A(0.044715) * x * x * x;
    return A(0.5) * x * (A(1) + gelu_tanh_of(k * (x + cube), fast));
  }
  return A(0.5) * x * (A(1) + berf(x * A(K_SQRT2 / 2)));
}
template <typename A> __device__ __forceinline__ A gelu_bwd(A x, bool approx, bool fast) {
  if (approx) {
    const A k = A(K_SQRT2 * K_INV_SQRTPI);
    const A u = k * (x + A(0.044715) * x * x * x);
    const A th = gelu_tanh_of(u, fast);
    const A du = k * (A(1) + A(3 * 0.044715) * x * x);
    const A left = A(0.5) * (A(1) + th);
    const A right = A(0.5) * x * (A(1) - th * th) * du;
    return left + right;
  }
  const A cdf = A(0.5) * (A(1) + berf(x * A(K_SQRT2 / 2)));
  const A pdf = bexp(A(-0.5) * x * x) * A(K_INV_SQRTPI / K_SQRT2);
  return cdf + x * pdf;
}
template <typename A> __device__ __forceinline__ A sigmoid_of(A x) { return A(1) / (A(1) + bexp(-x)); }
template <typename A> __device__ __forceinline__ A silu_grad_of(A x, A s) { return s * (A(1) + x * (A(1) - s)); }
template <typename T, int V> struct __align__(16) Vec { T v[V]; };
template <typename T, int V> __device__ __forceinline__ Vec<T, V> vload(const T* p) {
  Vec<T, V> r;
  const uint4* q = reinterpret_cast<const uint4*>(p);
  uint4* d = reinterpret_cast<uint4*>(&r);
#pragma unroll
  for (int w = 0; w < int(sizeof(Vec<T, V>) / 16); ++w) d[w] = q[w];
  return r;
}
template <typename T, int V> __device__ __forceinline__ void vstore(T* p, const Vec<T, V>& x) {
  uint4* q = reinterpret_cast<uint4*>(p);
  const uint4* s = reinterpret_cast<const uint4*>(&x);
#pragma unroll
  for (int w = 0; w < int(sizeof(Vec<T, V>) / 16); ++w) q[w] = s[w];
}
// V elements at p: one vector access when `vec` (p 16-byte aligned), else element by element.
template <typename T, int V> __device__ __forceinline__ Vec<T, V> vget(const T* p, bool vec) {
  if (vec) return vload<T, V>(p);
  Vec<T, V> r;
#pragma unroll
  for (int e = 0; e < V; ++e) r.v[e] = p[e];
  return r;
}
template <typename T, int V> __device__ __forceinline__ void vput(T* p, const Vec<T, V>& x, bool vec) {
  if (vec) {
    vstore<T, V>(p, x);
    return;
  }
#pragma unroll
  for (int e = 0; e < V; ++e) p[e] = x.v[e];
}
// Block-wide sum and max over 256 threads: a fixed tree (warp shuffles, then warp 0 over the
// warps' partials), every thread gets the result.
template <typename A> __device__ __forceinline__ A block_sum(A v, A* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    A t = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : A(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (threadIdx.x == 0) sh[32] = t;
  }
  __syncthreads();
  return sh[32];
}
// Two block-wide sums at once (one pair of barriers fewer than two block_sum calls); sh holds 66.
__device__ __forceinline__ void block_sum2(double& a, double& b, double* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    sh[threadIdx.x >> 5] = a;
    sh[33 + (threadIdx.x >> 5)] = b;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const bool live = threadIdx.x < blockDim.x / 32;
    double t = live ? sh[threadIdx.x] : 0.0, u = live ? sh[33 + threadIdx.x] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      t += __shfl_xor_sync(0xffffffffu, t, o);
      u += __shfl_xor_sync(0xffffffffu, u, o);
    }
    if (threadIdx.x == 0) {
      sh[32] = t;
      sh[65] = u;
    }
  }
  __syncthreads();
  a = sh[32];
  b = sh[65];
}
// Reductions over a row's group of TPR threads: one warp (shuffles only), or the whole block.
template <int TPR, typename A> __device__ __forceinline__ A row_sum(A v, A* sh) {
  if constexpr (TPR == 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    return block_sum(v, sh);
  }
}
template <int TPR> __device__ __forceinline__ void row_sum2(double& a, double& b, double* sh) {
  if constexpr (TPR == 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
  } else {
    block_sum2(a, b, sh);
  }
}
template <typename A> __device__ __forceinline__ A neg_inf() { return A(-__longlong_as_double(0x7ff0000000000000LL)); }
// std::max(m, x) as the CPU applies it: a NaN x leaves m.
template <typename A> __device__ __forceinline__ A max_keep(A m, A x) { return m < x ? x : m; }
template <typename A> __device__ __forceinline__ A block_max(A v, A* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_keep(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    A t = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : sh[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = max_keep(t, __shfl_xor_sync(0xffffffffu, t, o));
    if (threadIdx.x == 0) sh[32] = t;
  }
  __syncthreads();
  return sh[32];
}
template <int TPR, typename A> __device__ __forceinline__ A row_max(A v, A* sh) {
  if constexpr (TPR == 32) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max_keep(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  } else {
    return block_max(v, sh);
  }
}
)";

struct Scalars {
  const Graph& g;
  const FusedRegion& r;
  std::string operator()(int oi, const char* name, const std::string& A) const {
    return A + "(a.s[" + std::to_string(region_scalar_slot(g, r, oi, name)) + "])";
  }
};

// A unary op on x (type A), as backend/cuda/elementwise.cu's functors; `fast`: a 16-bit output.
std::string unary_expr(const Op& op, int oi, const Scalars& sc, const std::string& x, const std::string& A, bool fast) {
  auto num = [&](const char* a) { return sc(oi, a, A); };
  const std::string& n = op.name;
  if (n == "neg") return "(-" + x + ")";
  if (n == "exp") return "bexp(" + x + ")";
  if (n == "log") return "blog(" + x + ")";
  if (n == "sqrt") return "bsqrt(" + x + ")";
  if (n == "tanh") return "btanh(" + x + ")";
  if (n == "abs") return "babs(" + x + ")";
  if (n == "rsqrt") return "(" + A + "(1) / bsqrt(" + x + "))";
  if (n == "sigmoid") return "sigmoid_of<" + A + ">(" + x + ")";
  if (n == "silu") return "(" + x + " * sigmoid_of<" + A + ">(" + x + "))";
  if (n == "relu") return "(" + x + " > " + A + "(0) ? " + x + " : (bnan(" + x + ") ? " + x + " : " + A + "(0)))";
  if (n == "sign") return A + "((" + x + " > " + A + "(0)) - (" + x + " < " + A + "(0)))";
  if (n == "gelu")
    return "gelu_fwd<" + A + ">(" + x + ", " + (op.attrs.b("approximate") ? "true" : "false") + ", " +
           (fast ? "true" : "false") + ")";
  if (n == "clamp") {
    const std::string lo = num("lo"), hi = num("hi");
    const std::string m = "(" + x + " < " + lo + " ? " + lo + " : " + x + ")";
    return "(bnan(" + x + ") ? " + x + " : (" + hi + " < " + m + " ? " + hi + " : " + m + "))";
  }
  if (n == "pow_scalar") return "bpow(" + x + ", " + num("value") + ")";
  if (n == "add_scalar") return "(" + x + " + " + num("value") + ")";
  if (n == "mul_scalar") return "(" + x + " * " + num("value") + ")";
  if (n == "cast") return A + "(" + x + ")";
  BLU_CHECK(false, "cuda codegen: no emitter for unary op ", n);
}

std::string binary_expr(const std::string& n, const std::string& a, const std::string& b) {
  if (n == "add") return "(" + a + " + " + b + ")";
  if (n == "sub") return "(" + a + " - " + b + ")";
  if (n == "mul") return "(" + a + " * " + b + ")";
  if (n == "div") return "(" + a + " / " + b + ")";
  if (n == "pow") return "bpow(" + a + ", " + b + ")";
  if (is_comparison(n)) return comparison_expr(n, a, b);
  BLU_CHECK(false, "cuda codegen: no emitter for binary op ", n);
}

bool cuda_row_supported(const Op& op) {
  if (op.name == "cross_entropy") return op.attrs.i("reduction") == 0;
  if (op.name == "cross_entropy_backward") return op.attrs.i("reduction") != 1;
  return emit_row_supported(op);
}

struct Layout {
  std::vector<int> slots;  // value per operand slot: inputs, then outputs
  std::vector<bool> full;  // per slot: covers the iteration space (no broadcast)
  Shape space;
  int64_t N = 0, C = 1;
  int vector = 1;
  int nscalars = 0;
};

Layout layout_of(const Graph& g, const FusedRegion& r) {
  Layout L;
  for (int v : r.inputs) L.slots.push_back(v);
  for (int v : r.outputs) L.slots.push_back(v);
  L.space = region_space(g, r);
  L.N = numel(L.space);
  L.C = L.space.empty() ? 1 : L.space.back();
  size_t narrow = 8;
  for (int v : L.slots) {
    const bool f = numel(g.values[size_t(v)].shape) == L.N;
    L.full.push_back(f);
    if (f) narrow = std::min(narrow, dtype_size(g.values[size_t(v)].dtype));
  }
  L.vector = int(16 / narrow);
  L.nscalars = int(region_scalars(g, r).size());
  return L;
}

bool is_norm_backward(const Op& op) { return op.name == "layer_norm_backward" || op.name == "rms_norm_backward"; }

// Whether slot s of a rows region is read or written as whole vectors: a float value covering the
// space (a row each) or one row long (a norm weight, the same for every row).
bool row_vector_slot(const Graph& g, const Layout& L, size_t s) {
  const Value& v = g.values[size_t(L.slots[s])];
  if (!is_float_dtype(v.dtype)) return false;
  const int64_t n = numel(v.shape);
  return n == L.N || (n == L.C && !v.shape.empty() && v.shape.back() == L.C);
}

// How a rows kernel maps a row onto threads: a group of TPR threads owns a row; thread t of the
// group holds the row's vectors t, t + TPR, … (J of them, V elements each) in every op. TPR is 32
// (one warp; 4 rows to a block, reductions by shuffles) while that leaves J ≤ 8, else a whole block
// of up to 1024 (one row to a block, the warps' partials through shared memory).
struct RowGeometry {
  int64_t C = 1, R = 0, vectors = 0;  // row length, rows, vectors of a row
  int V = 1, tpr = 32, rows_per_block = 4, J = 1;
  int64_t blocks = 1;         // grid: one row per group, or (column sums) cuda_column_blocks
  int sums = 0;               // column sums
  size_t partial_size = 4;    // bytes of one column partial (float, or double for f64)
  size_t column_smem = 0;     // the per-group column sums' shared memory
};

// Blocks of a column-summing rows kernel: each adds its groups' rows into one partial row, so the
// count depends on the rows alone (every GPU and run sums in the same order).
int64_t cuda_column_blocks(int64_t rows, int rows_per_block) {
  return std::clamp<int64_t>((rows + rows_per_block - 1) / rows_per_block, 1, kColumnBlocks);
}

std::vector<int> column_sum_outputs(const Graph& g, const FusedRegion& r);
bool column_partials_double(const Graph& g, const FusedRegion& r);

RowGeometry row_geometry(const Graph& g, const FusedRegion& r, const Layout& L) {
  RowGeometry G;
  G.C = std::max<int64_t>(L.C, 1);
  G.R = L.N / G.C;
  size_t narrow = 0;
  for (size_t s = 0; s < L.slots.size(); ++s)
    if (row_vector_slot(g, L, s)) {
      const size_t b = dtype_size(g.values[size_t(L.slots[s])].dtype);
      narrow = narrow ? std::min(narrow, b) : b;
    }
  G.V = narrow ? int(16 / narrow) : 1;
  if (G.C % G.V != 0) G.V = 1;
  G.vectors = G.C / G.V;
  G.tpr = 32;
  if ((G.vectors + 31) / 32 > 8) {
    G.tpr = 128;
    while ((G.vectors + G.tpr - 1) / G.tpr > 8 && G.tpr < 1024) G.tpr *= 2;
  }
  G.rows_per_block = G.tpr == 32 ? 4 : 1;
  G.J = int((G.vectors + G.tpr - 1) / G.tpr);
  G.sums = int(column_sum_outputs(g, r).size());
  G.partial_size = column_partials_double(g, r) ? 8 : 4;
  G.blocks = G.sums ? cuda_column_blocks(G.R, G.rows_per_block) : (G.R + G.rows_per_block - 1) / G.rows_per_block;
  G.column_smem = size_t(G.rows_per_block) * size_t(G.sums) * size_t(G.J * G.V) * size_t(G.tpr) * G.partial_size;
  return G;
}

// Static shared memory a kernel may hold beside the reductions' slots.
constexpr size_t kColumnSmemLimit = size_t(40) << 10;

// The column sums a rows region writes (the norm backwards' weight and bias gradients that leave
// it), in emission order.
std::vector<int> column_sum_outputs(const Graph& g, const FusedRegion& r) {
  std::vector<int> out;
  if (r.shape != RegionShape::rows) return out;
  for (int oi : r.ops) {
    const Op& op = g.ops[size_t(oi)];
    if (!is_norm_backward(op)) continue;
    for (size_t j = 1; j < op.outputs.size(); ++j)
      if (std::find(r.outputs.begin(), r.outputs.end(), op.outputs[j]) != r.outputs.end()) out.push_back(op.outputs[j]);
  }
  return out;
}

// Whether the column partials are doubles (an f64 norm backward) rather than floats.
bool column_partials_double(const Graph& g, const FusedRegion& r) {
  for (int oi : r.ops)
    if (is_norm_backward(g.ops[size_t(oi)]) && g.values[size_t(g.ops[size_t(oi)].inputs[1])].dtype == DType::f64) return true;
  return false;
}

// Workspace bytes one launch takes: a rows kernel's column partials (0 without column sums).
size_t scratch_bytes_of(const RowGeometry& G) { return size_t(G.sums) * size_t(G.blocks * G.C) * G.partial_size; }

}  // namespace

bool cuda_emitter_supports(const Graph& g, const FusedRegion& r) {
  if (!rows_region_values_fit(g, r)) return false;
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    if (op.name == "adamw_step") {
      if (!emit_adamw_supported(g, r, op)) return false;
      continue;
    }
    const bool row = cuda_row_supported(op);
    if (!(emit_pointwise_supported(op) || (row && r.shape == RegionShape::rows))) return false;
    if (emit_row_supported(op) && !row) return false;
    if (!emit_dtypes_supported(g, r, op) || !emit_layout_supported(g, r, op)) return false;
    // cross_entropy reads its target's logit by index: the logits come from outside the region.
    if (op.name == "cross_entropy" && std::find(r.inputs.begin(), r.inputs.end(), op.inputs[0]) == r.inputs.end())
      return false;
  }
  // The groups' column sums live in static shared memory.
  if (r.shape == RegionShape::rows && row_geometry(g, r, layout_of(g, r)).column_smem > kColumnSmemLimit) return false;
  return true;
}

std::string emit_cuda_source(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(cuda_emitter_supports(g, r), "cuda codegen: region ", r.index, " holds an op without a CUDA emitter");
  const Layout L = layout_of(g, r);
  const Scalars sc{g, r};
  const bool rows = r.shape == RegionShape::rows;
  const RowGeometry RG = rows ? row_geometry(g, r, L) : RowGeometry{};
  const int64_t C = L.C, R = L.N / std::max<int64_t>(L.C, 1);
  const int JV = RG.J * RG.V;
  const std::string Cs = std::to_string(C), Vs = std::to_string(RG.V), TPR = std::to_string(RG.tpr);
  std::map<int, int> slot_of;
  for (size_t k = 0; k < L.slots.size(); ++k) slot_of.emplace(L.slots[k], int(k));
  std::set<int> written;  // input values the region updates in place (AdamW)
  for (int oi : r.ops)
    for (int w : g.ops[size_t(oi)].writes) written.insert(g.ops[size_t(oi)].inputs[size_t(w)]);
  auto is_out = [&](int v) { return std::find(r.outputs.begin(), r.outputs.end(), v) != r.outputs.end(); };
  auto T = [&](int v) { return std::string(dev_ctype(g.values[size_t(v)].dtype)); };
  auto P = [&](int v) { return "p" + std::to_string(slot_of.at(v)); };

  std::ostringstream os, body;
  os << kPrelude << "struct Args { void* p[" << L.slots.size() << "]; double s[" << std::max(L.nscalars, 1)
     << "]; i64 vec; void* part; };\n";
  std::map<int, std::string> local;  // value -> variable (pointwise: scalar; rows: array [J·V] or per-row scalar)
  std::set<int> per_row;
  // Rows: the inputs read as vectors into registers — a row's at the row's start (v<slot>[J]), a
  // row-long one once before the rows (w<slot>[J]).
  std::map<int, std::string> vec_of;
  std::ostringstream rowload, colload;
  if (rows)
    for (size_t k = 0; k < r.inputs.size(); ++k) {
      if (!row_vector_slot(g, L, k)) continue;
      const int v = L.slots[k];
      const bool whole = numel(g.values[size_t(v)].shape) == L.N;
      const std::string name = (whole ? "v" : "w") + std::to_string(k);
      (whole ? rowload : colload) << "    Vec<" << T(v) << ", " << Vs << "> " << name << "[" << RG.J << "];\n#pragma unroll\n    for (int j = 0; j < "
                                  << RG.J << "; ++j) {\n      const int vi = tid + " << TPR << " * j;\n      if (vi < " << RG.vectors << ") " << name
                                  << "[j] = vget<" << T(v) << ", " << Vs << ">(" << P(v) << (whole ? " + r * " + Cs : std::string())
                                  << " + i64(vi) * " << Vs << ", a.vec);\n    }\n";
      vec_of[v] = name;
    }
  int tmp = 0;
  auto fresh = [&] { return "t" + std::to_string(tmp++); };
  // Element expressions. Pointwise: full operands are the compute function's e<slot> references,
  // broadcast ones read at their index map of i. Rows: element k of the row (index r*C + k).
  const std::string ie = rows ? "(r * " + Cs + " + k)" : "i";
  auto elem = [&](int v) -> std::string {
    if (local.count(v)) return per_row.count(v) ? local[v] : (rows ? local[v] + "[q]" : local[v]);
    if (vec_of.count(v)) return "to_acc(" + vec_of[v] + "[j].v[e])";
    const Value& val = g.values[size_t(v)];
    const int s = slot_of.at(v);
    if (!rows && L.full[size_t(s)]) return "to_acc(e" + std::to_string(s) + ")";
    return "to_acc(" + P(v) + "[" + index_expr(val, L.space, ie) + "])";
  };
  auto raw = [&](int v) -> std::string {  // a bool or integer operand, not converted
    if (local.count(v)) return per_row.count(v) || !rows ? local[v] : local[v] + "[q]";  // made in the region
    const int s = slot_of.at(v);
    if (!rows && L.full[size_t(s)]) return "e" + std::to_string(s);
    return P(v) + "[" + index_expr(g.values[size_t(v)], L.space, ie) + "]";
  };
  // Rows: the thread's elements — vector vi = tid + TPR·j of the row, element e of it: column k,
  // register q.
  const std::string loop_head = "#pragma unroll\n    for (int j = 0; j < " + std::to_string(RG.J) + "; ++j) {\n      const int vi = tid + " + TPR +
                                " * j;\n      if (vi < " + std::to_string(RG.vectors) + ") {\n";
  const std::string elem_head = "#pragma unroll\n        for (int e = 0; e < " + Vs + "; ++e) {\n          const i64 k = i64(vi) * " + Vs +
                                " + e;\n          const int q = j * " + Vs + " + e;\n          (void)k;\n          (void)q;\n";
  const std::string loop = loop_head + elem_head;
  const std::string end_loop = "        }\n      }\n    }\n";
  // A value computed element by element: expression `e` in its accumulation type.
  auto define = [&](int v, const std::string& e) {
    const DType t = g.values[size_t(v)].dtype;
    const std::string A = acc(t), var = fresh();
    if (rows && numel(g.values[size_t(v)].shape) == 1 && L.N != 1) {
      // A scalar (the loss's gradient times 1/grad-accum before cross_entropy_backward): one value
      // per row, read as is, stored once.
      body << "    const " << A << " " << var << " = to_acc(" << round_to(t, e) << ");\n";
      if (is_out(v)) body << "    if (r == 0 && tid == 0) " << P(v) << "[0] = " << round_to(t, var) << ";\n";
      local[v] = var;
      per_row.insert(v);
      return;
    }
    if (rows) {
      const bool out = is_out(v);
      body << "    " << A << " " << var << "[" << JV << "];\n" << loop_head;
      if (out) body << "        Vec<" << T(v) << ", " << Vs << "> o;\n";
      body << elem_head << "          " << var << "[q] = to_acc(" << round_to(t, e) << ");\n";
      if (out) body << "          o.v[e] = " << round_to(t, var + "[q]") << ";\n";
      body << "        }\n";
      if (out) body << "        vput<" << T(v) << ", " << Vs << ">(" << P(v) << " + r * " << Cs << " + i64(vi) * " << Vs << ", o, a.vec);\n";
      body << "      }\n    }\n";
    } else {
      body << "  const " << A << " " << var << " = to_acc(" << round_to(t, e) << ");\n";
      if (is_out(v)) body << "  e" << slot_of.at(v) << " = " << round_to(t, var) << ";\n";
    }
    local[v] = var;
  };
  // A per-row statistic (double expression `e`), rounded to its dtype; thread 0 stores it.
  auto define_stat = [&](int v, const std::string& e) {
    const DType t = g.values[size_t(v)].dtype;
    const std::string var = fresh();
    body << "    const double " << var << " = double(to_acc(" << round_to(t, e) << "));\n";
    if (is_out(v)) body << "    if (tid == 0) " << P(v) << "[r] = " << round_to(t, e) << ";\n";
    local[v] = var;
    per_row.insert(v);
  };
  // The per-row statistic of v in double: a statistic made in the region, or element r of an input.
  auto stat = [&](int v) { return local.count(v) ? local[v] : "double(to_acc(" + P(v) + "[r]))"; };
  // Column sums (rows regions): each thread adds its elements' terms over the rows its group
  // visits into the group's shared sums (csm[group][sum][q][tid]: a thread alone touches its
  // addresses, a warp 32 banks); the block's end adds its groups' sums in group order into its
  // partial row, and a second kernel adds the blocks' partial rows in block order.
  const std::vector<int> sums = column_sum_outputs(g, r);
  const std::string PT = column_partials_double(g, r) ? "double" : "float";
  auto column_sum = [&](int v, const std::string& term) {
    const auto it = std::find(sums.begin(), sums.end(), v);
    if (it == sums.end()) return;  // not read outside the region
    const std::string s = std::to_string(it - sums.begin());
    body << loop << "          csm[((group * " << sums.size() << " + " << s << ") * " << JV << " + q) * " << TPR << " + tid] += " << PT
         << "(" << term << ");\n" << end_loop;
  };
  int scope = 0;
  for (int oi : r.ops) {
    const Op& op = g.ops[size_t(oi)];
    auto in = [&](size_t j) { return j < op.inputs.size() ? op.inputs[j] : -1; };
    const std::string n = op.name;
    const std::string o = std::to_string(oi);
    if (n == "adamw_step") {
      // backend/cuda/optim.cu's adamw_update; coefficients in double from this step's scalars.
      auto ref = [&](size_t j) { return "e" + std::to_string(slot_of.at(in(j))); };
      body << "  {\n    const double lr = a.s[" << region_scalar_slot(g, r, oi, "lr") << "], b1 = a.s["
           << region_scalar_slot(g, r, oi, "beta1") << "], b2 = a.s[" << region_scalar_slot(g, r, oi, "beta2")
           << "], wd = a.s[" << region_scalar_slot(g, r, oi, "weight_decay") << "], st = a.s["
           << region_scalar_slot(g, r, oi, "step") << "];\n"
           << "    const double bc1 = 1 - pow(b1, st), bc2 = 1 - pow(b2, st);\n"
           << "    const float decay = float(1 - lr * wd), fb1 = float(b1), fb2 = float(b2), omb1 = float(1 - b1),"
              " omb2 = float(1 - b2), bc2s = float(sqrt(bc2)), eps = float(a.s["
           << region_scalar_slot(g, r, oi, "eps") << "]), nss = float(-(lr / bc1));\n"
           << "    const float gi = " << (local.count(in(1)) ? "float(" + local[in(1)] + ")" : "to_acc(" + ref(1) + ")") << ";\n"
           << "    float pi = __fmul_rn(" << ref(0) << ", decay);\n"
           << "    const float mi = __fadd_rn(__fmul_rn(" << ref(2) << ", fb1), __fmul_rn(omb1, gi));\n"
           << "    const float vi = __fadd_rn(__fmul_rn(" << ref(3) << ", fb2), __fmul_rn(__fmul_rn(omb2, gi), gi));\n"
           << "    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2s), eps);\n"
           << "    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(nss, mi), denom));\n"
           << "    " << ref(0) << " = pi;\n    " << ref(2) << " = mi;\n    " << ref(3) << " = vi;\n";
      if (op.attrs.b("copies")) body << "    " << ref(4) << " = " << round_to(g.values[size_t(in(4))].dtype, "pi") << ";\n";
      body << "  }\n";
      continue;
    }
    if (emit_row_supported(op)) {
      const int xi = n == "cross_entropy_backward" || is_norm_backward(op) ? 1 : 0;
      const std::string A = acc(g.values[size_t(in(xi))].dtype);
      body << "  {  // " << n << "\n";
      ++scope;
      if (is_norm_backward(op)) {
        // (g, x, weight or none, [mean,] rstd[, pending]) -> grad_x, grad_weight[, grad_bias]; as
        // backend/cuda/layer_norm.cu and rms_norm.cu: x̂ = (x - mean)·rstd, ĝ = g·w, grad_x =
        // rstd·(ĝ - mean(ĝ) - x̂·mean(ĝ·x̂)) [rounded, + pending], grad_weight = Σ_rows g·x̂,
        // grad_bias = Σ_rows g.
        const bool ln = n == "layer_norm_backward";
        const int gv = in(0), xv = in(1), wv = in(2), mv = ln ? in(3) : -1, rv = ln ? in(4) : in(3);
        const int pv = in(ln ? 5 : 4);
        body << "    const " << A << " mean" << o << " = " << A << "(" << (ln ? stat(mv) : "0.0") << "), rstd" << o << " = " << A
             << "(" << stat(rv) << ");\n";
        const std::string gh = wv >= 0 ? "(" + elem(gv) + " * " + elem(wv) + ")" : elem(gv);
        const std::string xh = ln ? "((" + elem(xv) + " - mean" + o + ") * rstd" + o + ")" : "(" + elem(xv) + " * rstd" + o + ")";
        body << "    double sg" << o << " = 0, sgx" << o << " = 0;\n" << loop << "        { const " << A << " gh = " << gh
             << "; sg" << o << " += double(gh); sgx" << o << " += double(gh * " << xh << "); }\n" << end_loop
             << "    row_sum2<" << TPR << ">(sg" << o << ", sgx" << o << ", shdouble);\n"
             << "    const " << A << " sga" << o << " = " << A << "(sg" << o << " / double(" << Cs << ")), sgxa" << o << " = " << A
             << "(sgx" << o << " / double(" << Cs << "));\n";
        std::string gx = "rstd" + o + " * (" + gh + (ln ? " - sga" + o : "") + " - " + xh + " * sgxa" + o + ")";
        if (pv >= 0) gx = "to_acc(" + round_to(g.values[size_t(op.outputs[0])].dtype, gx) + ") + " + elem(pv);
        define(op.outputs[0], gx);
        column_sum(op.outputs[1], elem(gv) + " * " + xh);
        if (ln) column_sum(op.outputs[2], elem(gv));
      } else if (n == "softmax" || n == "log_softmax") {
        // The row's max and Σ e^(x - max) in double; softmax scales e^(x - max) by 1/Σ, log-softmax
        // takes x - (max + log Σ).
        const int xv = in(0);
        const std::string m = "m" + o, s0 = "s" + o;
        body << "    " << A << " " << m << " = neg_inf<" << A << ">();\n" << loop << "        " << m << " = max_keep(" << m << ", " << elem(xv)
             << ");\n" << end_loop << "    " << m << " = row_max<" << TPR << ">(" << m << ", sh" << A << ");\n"
             << "    double " << s0 << " = 0;\n" << loop << "        " << s0 << " += bexp(double(" << elem(xv) << " - " << m << "));\n"
             << end_loop << "    " << s0 << " = row_sum<" << TPR << ">(" << s0 << ", shdouble);\n";
        if (n == "softmax") {
          body << "    const " << A << " inv" << o << " = " << A << "(1.0 / " << s0 << ");\n";
          define(op.outputs[0], "bexp(" + elem(xv) + " - " + m + ") * inv" + o);
        } else {
          body << "    const " << A << " lse" << o << " = " << m << " + " << A << "(blog(" << s0 << "));\n";
          define(op.outputs[0], elem(xv) + " - lse" + o);
        }
      } else if (n == "log_softmax_backward") {
        const int gv = in(0), yv = in(1);
        body << "    double s" << o << " = 0;\n" << loop << "        s" << o << " += double(" << elem(gv) << ");\n" << end_loop
             << "    s" << o << " = row_sum<" << TPR << ">(s" << o << ", shdouble);\n";
        define(op.outputs[0], elem(gv) + " - bexp(" + elem(yv) + ") * " + A + "(s" + o + ")");
      } else if (n == "softmax_backward") {
        const int gv = in(0), yv = in(1);
        body << "    double s" << o << " = 0;\n" << loop << "        s" << o << " += double(" << elem(gv) << ") * double("
             << elem(yv) << ");\n" << end_loop << "    s" << o << " = row_sum<" << TPR << ">(s" << o << ", shdouble);\n";
        define(op.outputs[0], elem(yv) + " * (" + elem(gv) + " - " + A + "(s" + o + "))");
      } else if (n == "layer_norm" || n == "rms_norm") {
        const bool ln = n == "layer_norm";
        const int xv = in(0), wv = in(1), bv = ln ? in(2) : -1;
        body << "    double s" << o << " = 0;\n" << loop << "        { const double v = double(" << elem(xv) << "); s" << o
             << " += " << (ln ? "v" : "v * v") << "; }\n" << end_loop << "    s" << o << " = row_sum<" << TPR << ">(s" << o << ", shdouble);\n";
        if (ln) {
          body << "    const double mean" << o << " = s" << o << " / double(" << Cs << ");\n    double v" << o << " = 0;\n"
               << loop << "        { const double d = double(" << elem(xv) << ") - mean" << o << "; v" << o << " += d * d; }\n"
               << end_loop << "    v" << o << " = row_sum<" << TPR << ">(v" << o << ", shdouble);\n"
               << "    const double rstd" << o << " = 1.0 / sqrt(v" << o << " / double(" << Cs << ") + " << sc(oi, "eps", "double") << ");\n";
          define_stat(op.outputs[1], "mean" + o);
          define_stat(op.outputs[2], "rstd" + o);
        } else {
          body << "    const double rstd" << o << " = 1.0 / sqrt(s" << o << " / double(" << Cs << ") + " << sc(oi, "eps", "double") << ");\n";
          define_stat(op.outputs[1], "rstd" + o);
        }
        body << "    const " << A << " ma" << o << " = " << A << "(" << (ln ? "mean" + o : "0.0") << "), ra" << o << " = " << A
             << "(rstd" << o << ");\n";
        std::string e = ln ? "((" + elem(xv) + " - ma" + o + ") * ra" + o + ")" : "(" + elem(xv) + " * ra" + o + ")";
        if (wv >= 0) e = "(" + e + " * " + elem(wv) + ")";
        if (bv >= 0) e = "(" + e + " + " + elem(bv) + ")";
        define(op.outputs[0], e);
      } else if (n == "cross_entropy") {
        // reduction none: loss and lse per row.
        const int xv = in(0), tv = in(1);
        const std::string ig = std::to_string(op.attrs.i("ignore_index"));
        body << "    const i64 tv" << o << " = i64(" << P(tv) << "[r]);\n    " << A << " m" << o << " = neg_inf<" << A << ">();\n" << loop
             << "        m" << o << " = max_keep(m" << o << ", " << elem(xv) << ");\n" << end_loop << "    m" << o
             << " = row_max<" << TPR << ">(m" << o << ", sh" << A << ");\n    double s" << o << " = 0;\n" << loop << "        s" << o
             << " += bexp(double(" << elem(xv) << ") - double(m" << o << "));\n" << end_loop << "    s" << o
             << " = row_sum<" << TPR << ">(s" << o << ", shdouble);\n    const double l" << o << " = double(m" << o << ") + log(s" << o
             << ");\n";
        define_stat(op.outputs[1], "l" + o);
        const Value& lv = g.values[size_t(op.outputs[0])];
        body << "    if (tid == 0) {\n      double lrow = 0;\n      if (tv" << o << " != " << ig << ") lrow = l" << o
             << " - double(to_acc(" << P(xv) << "[r * " << Cs << " + tv" << o << "]));\n";
        if (is_out(op.outputs[0])) body << "      " << P(op.outputs[0]) << "[r] = " << round_to(lv.dtype, "lrow") << ";\n";
        body << "    }\n";
        BLU_CHECK(!local.count(xv) && slot_of.count(xv), "cuda codegen: cross_entropy's logits must be a region input");
      } else {  // cross_entropy_backward, reduction none or sum
        const int gv = in(0), xv = in(1), tv = in(2), lsev = in(3);
        const bool none = op.attrs.i("reduction") == 0;
        const int64_t K = op.attrs.i("classes");
        const std::string ig = std::to_string(op.attrs.i("ignore_index"));
        const std::string gval = local.count(gv) ? local[gv] : "to_acc(" + P(gv) + (none ? "[r])" : "[0])");
        const std::string lse = local.count(lsev) ? local[lsev] : "to_acc(" + P(lsev) + "[r])";
        body << "    const i64 tv" << o << " = i64(" << P(tv) << "[r]);\n    const " << A << " scale" << o << " = " << A << "("
             << gval << "), lse" << o << " = " << A << "(" << lse << ");\n";
        define(op.outputs[0], "((tv" + o + " == " + ig + " || k >= " + std::to_string(K) + ") ? " + A + "(0) : (bexp(" +
                                  elem(xv) + " - lse" + o + ") - " + A + "(k == tv" + o + " ? 1 : 0)) * scale" + o + ")");
      }
      continue;
    }
    // Pointwise ops.
    const DType ot = g.values[size_t(op.outputs[0])].dtype;
    const std::string A = acc(ot);
    const bool fast = dtype_size(ot) == 2;
    if (rows && op.outputs.size() > 1) BLU_CHECK(false, "cuda codegen: ", n, " in a rows region");
    if (n == "swiglu_backward") {
      const std::string gs = elem(in(0)), x = elem(in(1)), u = elem(in(2)), s = "sg" + o;
      body << "  const " << A << " " << s << " = sigmoid_of<" << A << ">(" << x << ");\n";
      define(op.outputs[0], "(" + gs + " * " + u + ") * silu_grad_of<" + A + ">(" + x + ", " + s + ")");
      define(op.outputs[1], gs + " * (" + x + " * " + s + ")");
      continue;
    }
    if (n == "gelu_and_backward") {
      // (g, x) -> gelu(x), g·gelu'(x), as backend/cuda/elementwise.cu.
      const std::string approx = op.attrs.b("approximate") ? "true" : "false", f = fast ? "true" : "false";
      const std::string x = elem(in(1)), gs = elem(in(0));
      define(op.outputs[0], "gelu_fwd<" + A + ">(" + x + ", " + approx + ", " + f + ")");
      define(op.outputs[1], gs + " * gelu_bwd<" + A + ">(" + x + ", " + approx + ", " + f + ")");
      continue;
    }
    std::string e;
    if (n == "silu_backward") e = elem(in(0)) + " * silu_grad_of<" + A + ">(" + elem(in(1)) + ", sigmoid_of<" + A + ">(" + elem(in(1)) + "))";
    else if (n == "clamp_backward")
      e = clamp_backward_expr(elem(in(0)), elem(in(1)), sc(oi, "lo", A), sc(oi, "hi", A), A);
    else if (n == "gelu_backward")
      e = elem(in(0)) + " * gelu_bwd<" + A + ">(" + elem(in(1)) + ", " + (op.attrs.b("approximate") ? "true" : "false") + ", " +
          (fast ? "true" : "false") + ")";
    else if (n == "where") e = "(" + raw(in(0)) + " ? " + elem(in(1)) + " : " + elem(in(2)) + ")";
    else if (n == "swiglu") e = "(" + elem(in(0)) + " * sigmoid_of<" + A + ">(" + elem(in(0)) + ")) * " + elem(in(1));
    else if (op_class(n) == OpClass::unary) e = unary_expr(op, oi, sc, elem(in(0)), A, fast);
    else e = binary_expr(n, elem(in(0)), elem(in(1)));
    define(op.outputs[0], e);
  }
  for (; scope > 0; --scope) body << "  }\n";

  // Kernel entry: the slots' pointers, then the loop.
  std::ostringstream ptrs;
  for (size_t k = 0; k < L.slots.size(); ++k) {
    const int v = L.slots[k];
    const bool w = k >= r.inputs.size() || written.count(v);
    ptrs << "  " << (w ? "" : "const ") << T(v) << "* __restrict__ p" << k << " = static_cast<" << (w ? "" : "const ") << T(v)
         << "*>(a.p[" << k << "]);\n";
  }
  const std::string shared = "  __shared__ float shfloat[33];\n  __shared__ double shdouble[66];\n  (void)shfloat;\n  (void)shdouble;\n";
  const int threads = RG.rows_per_block * RG.tpr;
  const std::string head = "extern \"C\" __global__ void __launch_bounds__(" + std::to_string(threads) +
                           ") blu_region(const Args a) {\n" + shared + "  const int tid = threadIdx.x % " + TPR +
                           ", group = threadIdx.x / " + TPR + ";\n  (void)group;\n";
  if (rows && sums.empty()) {
    // Group g of block b runs row b·RPB + g.
    os << head << ptrs.str() << colload.str() << "  const i64 r = i64(blockIdx.x) * " << RG.rows_per_block << " + group;\n  if (r >= " << R
       << ") return;\n" << rowload.str() << body.str() << "}\n";
    return os.str();
  }
  if (rows) {
    // Group g of block b runs rows b·RPB + g, then every G·RPB rows; the block then writes its
    // partial row of each sum s at part[(s·G + b)·C].
    const int64_t G = RG.blocks, SM = int64_t(RG.column_smem / RG.partial_size);
    os << head << "  __shared__ " << PT << " csm[" << SM << "];\n  for (int i = threadIdx.x; i < " << SM << "; i += " << threads
       << ") csm[i] = 0;\n  __syncthreads();\n" << ptrs.str() << "  " << PT << "* __restrict__ part = static_cast<" << PT
       << "*>(a.part);\n" << colload.str() << "  for (i64 r = i64(blockIdx.x) * " << RG.rows_per_block << " + group; r < " << R
       << "; r += " << G * RG.rows_per_block << ") {\n" << rowload.str() << body.str() << "  }\n  __syncthreads();\n"
       << "  for (int col = threadIdx.x; col < " << Cs << "; col += " << threads << ") {\n    const int vi = col / " << Vs
       << ", q = (vi / " << TPR << ") * " << Vs << " + col % " << Vs << ", t = vi % " << TPR << ";\n";
    for (size_t k = 0; k < sums.size(); ++k)
      os << "    {\n      " << PT << " s = 0;\n      for (int gi = 0; gi < " << RG.rows_per_block << "; ++gi) s += csm[((gi * "
         << sums.size() << " + " << k << ") * " << JV << " + q) * " << TPR << " + t];\n      part[(" << k << " * " << G
         << " + i64(blockIdx.x)) * " << Cs << " + col] = s;\n    }\n";
    os << "  }\n}\n";
    // The sums: block (32, 32) over 32 columns of sum blockIdx.y; thread (x, y) adds partial rows
    // y, y + 32, … in order, then thread (x, 0) adds the 32 results in y order.
    std::ostringstream stores;
    for (size_t k = 0; k < sums.size(); ++k)
      stores << "      case " << k << ": static_cast<" << T(sums[k]) << "*>(a.p[" << slot_of.at(sums[k]) << "])[k] = "
             << round_to(g.values[size_t(sums[k])].dtype, std::string(acc(g.values[size_t(sums[k])].dtype)) + "(t)") << "; break;\n";
    os << "extern \"C\" __global__ void __launch_bounds__(1024) blu_region_columns(const Args a) {\n"
       << "  __shared__ double sh[32][33];\n  const " << PT << "* __restrict__ part = static_cast<const " << PT << "*>(a.part);\n"
       << "  const i64 k = i64(blockIdx.x) * 32 + threadIdx.x;\n  double t = 0;\n"
       << "  if (k < " << Cs << ")\n    for (i64 b = threadIdx.y; b < " << G << "; b += 32) t += double(part[(i64(blockIdx.y) * " << G
       << " + b) * " << Cs << " + k]);\n  sh[threadIdx.y][threadIdx.x] = t;\n  __syncthreads();\n"
       << "  if (threadIdx.y == 0 && k < " << Cs << ") {\n    t = 0;\n    for (int y = 0; y < 32; ++y) t += sh[y][threadIdx.x];\n"
       << "    switch (blockIdx.y) {\n" << stores.str() << "    }\n  }\n}\n";
    return os.str();
  }
  // Pointwise: compute(a, i, e<slot>...) over references to each full operand's element.
  std::ostringstream params, args_scalar, args_vec, pre_scalar, pre_vec, post_scalar, post_vec;
  const int V = L.vector;
  for (size_t k = 0; k < L.slots.size(); ++k) {
    if (!L.full[k]) continue;
    const int v = L.slots[k];
    const bool w = k >= r.inputs.size() || written.count(v);
    const bool read = k < r.inputs.size();
    const std::string ks = std::to_string(k);
    params << ", " << T(v) << "& e" << k;
    args_scalar << ", x" << k;
    args_vec << ", x" << k << ".v[l]";
    pre_scalar << "    " << T(v) << " x" << k << (read ? " = p" + ks + "[i]" : "") << ";\n";
    pre_vec << "    Vec<" << T(v) << ", " << V << "> x" << k << (read ? " = vload<" + T(v) + ", " + std::to_string(V) + ">(p" + ks + " + i)" : "")
            << ";\n";
    if (w) {
      post_scalar << "    p" << k << "[i] = x" << k << ";\n";
      post_vec << "    vstore<" << T(v) << ", " << V << ">(p" << k << " + i, x" << k << ");\n";
    }
  }
  os << "__device__ __forceinline__ void compute(const Args& a, const i64 i" << params.str() << ") {\n";
  for (size_t k = 0; k < L.slots.size(); ++k)
    if (!L.full[k]) os << "  const " << T(L.slots[k]) << "* __restrict__ p" << k << " = static_cast<const " << T(L.slots[k]) << "*>(a.p[" << k << "]);\n";
  os << body.str() << "}\n";
  os << "extern \"C\" __global__ void __launch_bounds__(" << kBlock << ") blu_region(const Args a) {\n" << ptrs.str()
     << "  const i64 stride = i64(gridDim.x) * blockDim.x;\n"
     << "  if (a.vec) {\n  for (i64 i = (i64(blockIdx.x) * blockDim.x + threadIdx.x) * " << V << "; i < " << L.N << "; i += stride * " << V
     << ") {\n" << pre_vec.str() << "#pragma unroll\n    for (int l = 0; l < " << V << "; ++l) compute(a, i + l" << args_vec.str()
     << ");\n" << post_vec.str() << "  }\n  return;\n  }\n"
     << "  for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < " << L.N << "; i += stride) {\n" << pre_scalar.str()
     << "    compute(a, i" << args_scalar.str() << ");\n" << post_scalar.str() << "  }\n}\n";
  return os.str();
}

CudaLaunchShape cuda_launch_shape(const Graph& g, const FusedRegion& r) {
  const Layout L = layout_of(g, r);
  CudaLaunchShape s;
  s.rows = r.shape == RegionShape::rows;
  s.scalars = L.nscalars;
  s.row_len = std::max<int64_t>(L.C, 1);
  if (s.rows) {
    const RowGeometry G = row_geometry(g, r, L);
    s.work = G.R;
    s.vector = G.V;
    s.grid = G.blocks;
    s.threads = G.rows_per_block * G.tpr;
    s.sums = G.sums;
    s.scratch = scratch_bytes_of(G);
    for (size_t k = 0; k < L.slots.size(); ++k)
      if (row_vector_slot(g, L, k)) s.full.push_back(int(k));
  } else {
    s.work = L.N;
    s.vector = L.vector;
    s.threads = kBlock;
    for (size_t k = 0; k < L.full.size(); ++k)
      if (L.full[k]) s.full.push_back(int(k));
  }
  return s;
}

}  // namespace blu::compiler
