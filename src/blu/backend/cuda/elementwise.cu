// CUDA kernels for the pointwise ops of ops/elementwise: unary math, binary arithmetic,
// comparisons, where, and the in-place add_ / mul_scalar_. Each op computes exactly what its CPU
// kernel (backend/cpu/elementwise.cpp) computes, in the same type (float for bf16/f16, else the
// dtype itself), with the same attributes. Where CUDA's math library and glibc differ (exp, log,
// tanh, erf, pow: CUDA's are within 1-2 ulp, glibc's within ~1), results may differ in the last
// float bit; add/sub/mul/div, sqrt and the comparisons are IEEE and match exactly.
#include <cmath>

#include "blu/backend/cuda/colsum.cuh"
#include "blu/backend/cuda/loops.cuh"
#include "blu/backend/cuda/strided.cuh"

namespace blu::cuda {

// --- host helpers of loops.cuh ---
Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  const int64_t lead = int64_t(shape.size()) - t.dim();
  BLU_ASSERT(lead >= 0, "broadcast_strides: ", t.shape(), " to ", to_string(shape));
  Shape s(shape.size(), 0);
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t sz = t.shape()[d];
    BLU_ASSERT(sz == shape[lead + d] || sz == 1, "broadcast_strides: ", t.shape(), " to ", to_string(shape));
    s[lead + d] = sz == 1 ? 0 : t.strides()[d];
  }
  return s;
}

Coalesced coalesce(const Shape& shape, const std::vector<Shape>& strides) {
  Coalesced c;
  const size_t nops = strides.size();
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;
    if (!c.size.empty()) {
      const int64_t inner = c.size.back();
      bool merge = true;
      for (size_t k = 0; k < nops && merge; ++k) merge = strides[k][d] == c.stride.back()[k] * inner;
      if (merge) {
        c.size.back() *= shape[d];
        continue;
      }
    }
    c.size.push_back(shape[d]);
    std::vector<int64_t> s(nops);
    for (size_t k = 0; k < nops; ++k) s[k] = strides[k][d];
    c.stride.push_back(std::move(s));
  }
  return c;
}

std::optional<Coalesced> rows_as_vectors(const Coalesced& co, int v) {
  if (co.size.empty() || co.size[0] % v != 0) return std::nullopt;
  Coalesced out = co;
  out.size[0] /= v;
  for (size_t d = 0; d < co.size.size(); ++d)
    for (int64_t& s : out.stride[d]) {
      if (d == 0 ? s != 1 : s % v != 0) return std::nullopt;
      s = d == 0 ? 1 : s / v;
    }
  return out;
}

namespace {
struct identity_map {
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const { return x; }
};
bool map_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }
}  // namespace

bool copy_through_map(cudaStream_t stream, const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype()) {
    BLU_DISPATCH_BITS(dst.itemsize(), "copy", launch_map<bits_t, bits_t>(stream, dst, identity_map{}, src));
    return true;
  }
  // Not f16 -> f32: the hardware conversion makes every NaN canonical where the CPU keeps the
  // payload (the copy kernels follow the CPU).
  if (!map_float(dst.dtype()) || !map_float(src.dtype()) || (src.dtype() == DType::f16 && dst.dtype() == DType::f32))
    return false;
  auto with_float = [](DType t, auto&& f) {
    if (t == DType::f32) f(float{});
    else if (t == DType::bf16) f(__nv_bfloat16{});
    else f(__half{});
  };
  with_float(dst.dtype(), [&](auto o) {
    with_float(src.dtype(), [&](auto i) { launch_map<decltype(o), decltype(i)>(stream, dst, identity_map{}, src); });
  });
  return true;
}

int sm_count() {
  static thread_local int device = -1, count = 0;
  const int d = current_device();
  if (d != device) {
    BLU_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, d));
    device = d;
  }
  return count;
}

namespace {

// --- device math, one overload per accumulation type ---
__device__ __forceinline__ float exp_(float x) { return ::expf(x); }
__device__ __forceinline__ double exp_(double x) { return ::exp(x); }
__device__ __forceinline__ float log_(float x) { return ::logf(x); }
__device__ __forceinline__ double log_(double x) { return ::log(x); }
__device__ __forceinline__ float sqrt_(float x) { return ::sqrtf(x); }
__device__ __forceinline__ double sqrt_(double x) { return ::sqrt(x); }
__device__ __forceinline__ float tanh_(float x) { return ::tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return ::tanh(x); }
__device__ __forceinline__ float erf_(float x) { return ::erff(x); }
__device__ __forceinline__ double erf_(double x) { return ::erf(x); }
__device__ __forceinline__ float abs_(float x) { return ::fabsf(x); }
__device__ __forceinline__ double abs_(double x) { return ::fabs(x); }
__device__ __forceinline__ float pow_(float x, float y) { return ::powf(x, y); }
__device__ __forceinline__ double pow_(double x, double y) { return ::pow(x, y); }

constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kInvSqrtPi = 0.56418958354775628695;

// tanh(u) = sign(u)·(1 − 2/(1 + e^{2|u|})) with the SFU's exp and a fast divide: an absolute error
// of a few 1e-7, which GELU sees only through 1 + tanh (so a few float ulps of the result) — far
// below the 2^-9 rounding of a bf16/f16 output, for which it replaces the libm tanh (with the
// libm call GELU is compute-bound: 2.1 of the H200's 4.8 TB/s).
__device__ __forceinline__ float fast_tanh(float u) {
  const float t = 1.f - __fdividef(2.f, __expf(2.f * fabsf(u)) + 1.f);
  return copysignf(t, u);
}
template <typename A>
__device__ __forceinline__ A gelu_tanh_of(A u, bool fast) {
  if constexpr (std::is_same_v<A, float>) return fast ? fast_tanh(u) : tanh_(u);
  else return tanh_(u);
}

// The CPU's formulas (backend/cpu/elementwise.cpp), same association, no contraction; `fast`
// (16-bit outputs) takes tanh from fast_tanh.
template <typename A>
__device__ __forceinline__ A gelu_fwd(A x, bool approx, bool fast = false) {
  if (approx) {
    const A k = A(kSqrt2 * kInvSqrtPi);
    const A cube = mul_rn(mul_rn(mul_rn(A(0.044715), x), x), x);
    return mul_rn(mul_rn(A(0.5), x), add_rn(A(1), gelu_tanh_of(mul_rn(k, add_rn(x, cube)), fast)));
  }
  return mul_rn(mul_rn(A(0.5), x), add_rn(A(1), erf_(mul_rn(x, A(kSqrt2 / 2)))));
}
template <typename A>
__device__ __forceinline__ A gelu_bwd(A x, bool approx, bool fast = false) {
  if (approx) {
    const A k = A(kSqrt2 * kInvSqrtPi);
    const A u = mul_rn(k, add_rn(x, mul_rn(mul_rn(mul_rn(A(0.044715), x), x), x)));
    const A th = gelu_tanh_of(u, fast);
    const A du = mul_rn(k, add_rn(A(1), mul_rn(mul_rn(A(3 * 0.044715), x), x)));
    const A left = mul_rn(A(0.5), add_rn(A(1), th));
    const A right = mul_rn(mul_rn(mul_rn(A(0.5), x), sub_rn(A(1), mul_rn(th, th))), du);
    return add_rn(left, right);
  }
  const A cdf = mul_rn(A(0.5), add_rn(A(1), erf_(mul_rn(x, A(kSqrt2 / 2)))));
  const A pdf = mul_rn(exp_(mul_rn(mul_rn(A(-0.5), x), x)), A(kInvSqrtPi / kSqrt2));
  return add_rn(cdf, mul_rn(x, pdf));
}

// --- unary ops: Op<A>(attrs) is built on the host, called on the device ---
#define BLU_CUDA_UNARY(NAME, FIELDS, INIT, EXPR)                                  \
  template <typename A>                                                           \
  struct NAME##_op {                                                              \
    FIELDS;                                                                       \
    explicit NAME##_op(const Attrs& attrs) { (void)attrs; INIT; }                 \
    __device__ __forceinline__ A operator()(A x) const { return EXPR; }           \
  };

BLU_CUDA_UNARY(neg, , , -x)
BLU_CUDA_UNARY(exp, , , exp_(x))
BLU_CUDA_UNARY(log, , , log_(x))
BLU_CUDA_UNARY(sqrt, , , sqrt_(x))
BLU_CUDA_UNARY(rsqrt, , , A(1) / sqrt_(x))
BLU_CUDA_UNARY(tanh, , , tanh_(x))
BLU_CUDA_UNARY(sigmoid, , , A(1) / (A(1) + exp_(-x)))
BLU_CUDA_UNARY(relu, , , x > A(0) ? x : (isnan(x) ? x : A(0)))
// gelu: `fast` is set by the launch for 16-bit outputs (gelu_kernel below).
BLU_CUDA_UNARY(gelu, bool approx; bool fast = false, approx = attrs.b("approximate"), gelu_fwd<A>(x, approx, fast))
BLU_CUDA_UNARY(abs, , , abs_(x))
BLU_CUDA_UNARY(sign, , , A((x > A(0)) - (x < A(0))))
// std::min(std::max(x, lo), hi): max keeps x unless x < lo, min keeps it unless hi < it.
BLU_CUDA_UNARY(clamp, A lo; A hi, (lo = A(attrs.f("lo")), hi = A(attrs.f("hi"))),
               isnan(x) ? x : (hi < (x < lo ? lo : x) ? hi : (x < lo ? lo : x)))
BLU_CUDA_UNARY(pow_scalar, A e, e = A(attrs.f("value")), pow_(x, e))
BLU_CUDA_UNARY(add_scalar, A s, s = A(attrs.f("value")), x + s)
BLU_CUDA_UNARY(mul_scalar, A s, s = A(attrs.f("value")), x * s)

template <template <typename> class Op>
void unary(const KernelCall& c) {
  const Tensor& out = c.out[0];
  BLU_DISPATCH_FLOATING(out.dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<T, T>(stream_of(c.ctx), out, Op<acc_t<T>>(c.attrs), c.in[0]);
  });
}
BLU_REGISTER_KERNEL(cuda, "neg", unary<neg_op>);
BLU_REGISTER_KERNEL(cuda, "exp", unary<exp_op>);
BLU_REGISTER_KERNEL(cuda, "log", unary<log_op>);
BLU_REGISTER_KERNEL(cuda, "sqrt", unary<sqrt_op>);
BLU_REGISTER_KERNEL(cuda, "rsqrt", unary<rsqrt_op>);
BLU_REGISTER_KERNEL(cuda, "tanh", unary<tanh_op>);
BLU_REGISTER_KERNEL(cuda, "sigmoid", unary<sigmoid_op>);
BLU_REGISTER_KERNEL(cuda, "relu", unary<relu_op>);
void gelu_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    gelu_op<acc_t<T>> f(c.attrs);
    f.fast = sizeof(T) == 2;
    launch_map<T, T>(stream_of(c.ctx), c.out[0], f, c.in[0]);
  });
}
BLU_REGISTER_KERNEL(cuda, "gelu", gelu_kernel);
BLU_REGISTER_KERNEL(cuda, "abs", unary<abs_op>);
BLU_REGISTER_KERNEL(cuda, "sign", unary<sign_op>);
BLU_REGISTER_KERNEL(cuda, "clamp", unary<clamp_op>);
BLU_REGISTER_KERNEL(cuda, "pow_scalar", unary<pow_scalar_op>);
BLU_REGISTER_KERNEL(cuda, "add_scalar", unary<add_scalar_op>);
BLU_REGISTER_KERNEL(cuda, "mul_scalar", unary<mul_scalar_op>);

// In place: out is input 0, read and written through its own strides.
void mul_scalar_inplace(const KernelCall& c) {
  const Tensor& a = c.out[0];
  BLU_DISPATCH_FLOATING(a.dtype(), "mul_scalar_", {
    using T = dev_t<scalar_t>;
    launch_map<T, T>(stream_of(c.ctx), a, mul_scalar_op<acc_t<T>>(c.attrs), a);
  });
}
BLU_REGISTER_KERNEL(cuda, "mul_scalar_", mul_scalar_inplace);

// --- gradient helpers reading (grad, x) ---
template <typename A>
struct gelu_backward_op {
  bool approx, fast = false;  // fast: 16-bit outputs (fast_tanh)
  explicit gelu_backward_op(const Attrs& a) : approx(a.b("approximate")) {}
  __device__ __forceinline__ A operator()(A g, A x) const { return mul_rn(g, gelu_bwd<A>(x, approx, fast)); }
};
template <typename A>
struct clamp_backward_op {
  A lo, hi;
  explicit clamp_backward_op(const Attrs& a) : lo(A(a.f("lo"))), hi(A(a.f("hi"))) {}
  __device__ __forceinline__ A operator()(A g, A x) const { return x >= lo && x <= hi ? g : A(0); }
};
template <template <typename> class Op>
void grad_unary(const KernelCall& c) {
  const Tensor& out = c.out[0];
  BLU_DISPATCH_FLOATING(out.dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<T, T, T>(stream_of(c.ctx), out, Op<acc_t<T>>(c.attrs), c.in[0], c.in[1]);
  });
}
void gelu_backward_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    gelu_backward_op<acc_t<T>> f(c.attrs);
    f.fast = sizeof(T) == 2;
    launch_map<T, T, T>(stream_of(c.ctx), c.out[0], f, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cuda, "gelu_backward", gelu_backward_kernel);

// (gelu(x), g·gelu'(x)) in one pass over contiguous, 16-byte aligned operands: V elements (16
// bytes) a thread; the formulas are gelu_op's and gelu_backward_op's (the compiler shares their
// tanh), so the results are those of the two separate kernels bit for bit.
template <typename T, int V>
__device__ __forceinline__ void gelu_and_backward_vec(const Vec<T, V>& gv, const Vec<T, V>& xv, bool approx,
                                                      Vec<T, V>& yv, Vec<T, V>& dv) {
  using A = acc_t<T>;
  constexpr bool fast = sizeof(T) == 2;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const A xa = to_acc(xv.v[j]);
    yv.v[j] = from_acc<T>(gelu_fwd<A>(xa, approx, fast));
    dv.v[j] = from_acc<T>(mul_rn(to_acc(gv.v[j]), gelu_bwd<A>(xa, approx, fast)));
  }
}
template <typename T, int V>
__global__ void gelu_and_backward_kernel(int64_t n, bool approx, const T* __restrict__ g, const T* __restrict__ x,
                                         T* __restrict__ y, T* __restrict__ gx) {
  using A = acc_t<T>;
  constexpr bool fast = sizeof(T) == 2;
  const int64_t step = int64_t(gridDim.x) * blockDim.x, nvec = n / V;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += step) {
    Vec<T, V> yv, dv;
    gelu_and_backward_vec<T, V>(reinterpret_cast<const Vec<T, V>*>(g)[i], reinterpret_cast<const Vec<T, V>*>(x)[i],
                                approx, yv, dv);
    reinterpret_cast<Vec<T, V>*>(y)[i] = yv;
    reinterpret_cast<Vec<T, V>*>(gx)[i] = dv;
  }
  const int64_t i = nvec * V + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const A xa = to_acc(x[i]);
    y[i] = from_acc<T>(gelu_fwd<A>(xa, approx, fast));
    gx[i] = from_acc<T>(mul_rn(to_acc(g[i]), gelu_bwd<A>(xa, approx, fast)));
  }
}
// The rows of [R, N] operands for colsum_launch (colsum.cuh): each 16-byte vector of both
// results made and stored as above, the gradient's returned for the column sum.
template <typename T>
struct GeluAndBackwardRows {
  static constexpr int V = kColVec<T>;
  struct In {
    Vec<T, V> g, x;
  };
  const T *g, *x;
  T *y, *gx;
  bool approx;
  __device__ __forceinline__ In load(int64_t r, int64_t N, int64_t col0) const {
    const int64_t i = r * N + col0;
    return {*reinterpret_cast<const Vec<T, V>*>(g + i), *reinterpret_cast<const Vec<T, V>*>(x + i)};
  }
  __device__ __forceinline__ ColVec<T> finish(int64_t r, int64_t N, int64_t col0, const In& in) const {
    const int64_t i = r * N + col0;
    Vec<T, V> yv, dv;
    gelu_and_backward_vec<T, V>(in.g, in.x, approx, yv, dv);
    *reinterpret_cast<Vec<T, V>*>(y + i) = yv;
    *reinterpret_cast<Vec<T, V>*>(gx + i) = dv;
    ColVec<T> out;
#pragma unroll
    for (int e = 0; e < V; ++e) out.v[e] = dv.v[e];
    return out;
  }
};
// Inputs (grad, x); outputs gelu(x), grad·gelu'(x), and, when given a third, Σ_rows grad·gelu'(x)
// (x [R, N]; T or f32): the bias gradient of the linear that made x, in the same pass and with the
// bits of that linear's own column sum (linalg.cu), for the compiler's bias-gradient fold
// (compiler/epilogue.h). Other layouts: the two map kernels.
void gelu_and_backward(const KernelCall& c) {
  const Tensor &g = c.in[0], &x = c.in[1];
  const Tensor &y = c.out[0], &gx = c.out[1];
  const Tensor gb = c.out.size() > 2 ? c.out[2] : Tensor();
  BLU_DISPATCH_FLOATING(x.dtype(), c.op, {
    using T = dev_t<scalar_t>;
    constexpr int V = int(16 / sizeof(T));
    const bool fast = g.is_contiguous() && x.is_contiguous() && g.shape() == x.shape() &&
                      aligned_to(g.raw_data(), 16) && aligned_to(x.raw_data(), 16) && aligned_to(y.raw_data(), 16) &&
                      aligned_to(gx.raw_data(), 16);
    if (gb.defined()) {
      if constexpr (sizeof(T) <= 4) {
        const int64_t R = x.dim() == 2 ? x.size(0) : 0, N = x.dim() == 2 ? x.size(1) : 0;
        BLU_CHECK(fast && y.is_contiguous() && gx.is_contiguous() && colsum_fits<T>(R, N) && gb.is_contiguous() &&
                      gb.shape() == Shape{N} && (gb.dtype() == x.dtype() || gb.dtype() == DType::f32),
                  "gelu_and_backward: a bias gradient ", gb.str(), " needs contiguous, 16-byte aligned [R, N] operands "
                  "with N a multiple of ", V, " and a [N] output in ", x.dtype(), " or f32; got x ", x.str(), ", grad ",
                  g.str());
        colsum_launch<T>(R, N,
                         GeluAndBackwardRows<T>{static_cast<const T*>(g.raw_data()), static_cast<const T*>(x.raw_data()),
                                                static_cast<T*>(y.raw_data()), static_cast<T*>(gx.raw_data()),
                                                c.attrs.b("approximate")},
                         gb.raw_data(), gb.dtype() == DType::f32, stream_of(c.ctx), *c.ctx.scratch);
      } else {
        BLU_CHECK(false, "gelu_and_backward: no bias gradient in ", x.dtype());
      }
    } else if (fast && x.numel() > 0) {
      gelu_and_backward_kernel<T, V><<<blocks_for(std::max<int64_t>(x.numel() / V, 1)), 256, 0, stream_of(c.ctx)>>>(
          x.numel(), c.attrs.b("approximate"), static_cast<const T*>(g.raw_data()),
          static_cast<const T*>(x.raw_data()), static_cast<T*>(y.raw_data()), static_cast<T*>(gx.raw_data()));
      BLU_CUDA_CHECK_LAUNCH();
    } else {
      gelu_op<acc_t<T>> f(c.attrs);
      gelu_backward_op<acc_t<T>> fb(c.attrs);
      f.fast = fb.fast = sizeof(T) == 2;
      launch_map<T, T>(stream_of(c.ctx), y, f, x);
      launch_map<T, T, T>(stream_of(c.ctx), gx, fb, g, x);
    }
  });
}
BLU_REGISTER_KERNEL(cuda, "gelu_and_backward", gelu_and_backward);
BLU_REGISTER_KERNEL(cuda, "clamp_backward", grad_unary<clamp_backward_op>);

// --- binary arithmetic over every non-bool dtype ---
template <typename A>
__device__ __forceinline__ A pow_any(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) return pow_(a, b);
  else return A(::pow(double(a), double(b)));  // std::pow(int, int) computes in double
}
// Integer division by zero cannot throw on the device: its result is unspecified (the CPU throws).
#define BLU_CUDA_BINARY(NAME, EXPR)                                                          \
  struct NAME##_op {                                                                         \
    template <typename A>                                                                    \
    __device__ __forceinline__ A operator()(A a, A b) const { return A(EXPR); }              \
  };
BLU_CUDA_BINARY(add, a + b)
BLU_CUDA_BINARY(sub, a - b)
BLU_CUDA_BINARY(mul, a * b)
BLU_CUDA_BINARY(div, a / b)
BLU_CUDA_BINARY(pow, pow_any(a, b))

template <typename Op>
void binary(const KernelCall& c) {
  const Tensor& out = c.out[0];
  BLU_DISPATCH_ALL(c.in[0].dtype(), c.op, {
    if constexpr (!std::is_same_v<scalar_t, bool>) {
      using T = dev_t<scalar_t>;
      launch_map<T, T, T>(stream_of(c.ctx), out, Op{}, c.in[0], c.in[1]);
    } else {
      BLU_CHECK(false, c.op, ": arithmetic on bool tensors is not supported");
    }
  });
}
BLU_REGISTER_KERNEL(cuda, "add", binary<add_op>);
BLU_REGISTER_KERNEL(cuda, "sub", binary<sub_op>);
BLU_REGISTER_KERNEL(cuda, "mul", binary<mul_op>);
BLU_REGISTER_KERNEL(cuda, "div", binary<div_op>);
BLU_REGISTER_KERNEL(cuda, "pow", binary<pow_op>);
// In place, a op= b: the same kernels with the output being input 0.
BLU_REGISTER_KERNEL(cuda, "add_", binary<add_op>);
BLU_REGISTER_KERNEL(cuda, "mul_", binary<mul_op>);


// --- comparisons: bool out, any dtype ---
#define BLU_CUDA_COMPARE(NAME, OP)                                                           \
  struct NAME##_op {                                                                         \
    template <typename A>                                                                    \
    __device__ __forceinline__ bool operator()(A a, A b) const { return a OP b; }            \
  };
BLU_CUDA_COMPARE(eq, ==)
BLU_CUDA_COMPARE(ne, !=)
BLU_CUDA_COMPARE(lt, <)
BLU_CUDA_COMPARE(le, <=)
BLU_CUDA_COMPARE(gt, >)
BLU_CUDA_COMPARE(ge, >=)

template <typename Op>
void compare(const KernelCall& c) {
  BLU_DISPATCH_ALL(c.in[0].dtype(), c.op, {
    using T = dev_t<scalar_t>;
    launch_map<bool, T, T>(stream_of(c.ctx), c.out[0], Op{}, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cuda, "eq", compare<eq_op>);
BLU_REGISTER_KERNEL(cuda, "ne", compare<ne_op>);
BLU_REGISTER_KERNEL(cuda, "lt", compare<lt_op>);
BLU_REGISTER_KERNEL(cuda, "le", compare<le_op>);
BLU_REGISTER_KERNEL(cuda, "gt", compare<gt_op>);
BLU_REGISTER_KERNEL(cuda, "ge", compare<ge_op>);

// --- where: moves bits, so it dispatches on the element size (NaN payloads survive as on the CPU) ---
struct select_op {
  template <typename B>
  __device__ __forceinline__ B operator()(bool cond, B a, B b) const { return cond ? a : b; }
};
void where_kernel(const KernelCall& c) {
  const Tensor& out = c.out[0];
  BLU_DISPATCH_BITS(out.itemsize(), "where", launch_map<bits_t, bool, bits_t, bits_t>(stream_of(c.ctx), out, select_op{}, c.in[0], c.in[1], c.in[2]));
}
BLU_REGISTER_KERNEL(cuda, "where", where_kernel);

}  // namespace

}  // namespace blu::cuda
