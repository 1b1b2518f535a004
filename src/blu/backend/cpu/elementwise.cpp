// CPU kernels for ops/elementwise, ops/factory and the copies of ops/view.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <numbers>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/fast_math.h"
#include "blu/backend/cpu/loops.h"
#include "blu/core/rng.h"

namespace blu::cpu {

namespace {

template <typename T>
[[gnu::always_inline]] inline T tanh_of(T x) {
  if constexpr (std::is_same_v<T, float>) return tanh_arith(x);
  else return std::tanh(x);
}

// GELU's tanh form (Approx) or its erf form; a template parameter, so that each loop holds one
// form and the tanh one vectorises.
// Inlined into the loops (a call per element would keep them scalar).
template <typename T, bool Approx>
[[gnu::always_inline]] inline T gelu_fwd(T x) {
  if constexpr (Approx) {
    const T k = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);  // sqrt(2/pi)
    return T(0.5) * x * (T(1) + tanh_of(k * (x + T(0.044715) * x * x * x)));
  } else {
    return T(0.5) * x * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
  }
}
template <typename T, bool Approx>
[[gnu::always_inline]] inline T gelu_bwd(T x) {
  if constexpr (Approx) {
    const T k = T(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);
    const T u = k * (x + T(0.044715) * x * x * x);
    const T th = tanh_of(u);
    const T du = k * (T(1) + T(3 * 0.044715) * x * x);
    return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du;
  } else {
    const T cdf = T(0.5) * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
    const T pdf = std::exp(T(-0.5) * x * x) * T(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
    return cdf + x * pdf;
  }
}

// Unary floating kernel: out = F(x, attrs).
template <typename F>
void unary(const KernelCall& c) {
  Tensor& out = c.out[0];
  BLU_DISPATCH_FLOATING(out.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    auto f = F::template make<A>(c.attrs);
    map<scalar_t, scalar_t>(out, f, c.in[0]);
  });
}

#define BLU_UNARY(NAME, EXPR)                                             \
  struct NAME##_f {                                                       \
    template <typename A>                                                 \
    static auto make(const Attrs& attrs) {                                \
      return [&attrs](A x) -> A { (void)attrs; return EXPR; };            \
    }                                                                     \
  };                                                                      \
  BLU_REGISTER_KERNEL(cpu, #NAME, unary<NAME##_f>)

// A unary kernel whose attributes are read once (INIT), not per element.
#define BLU_UNARY_WITH(NAME, INIT, EXPR)                                  \
  struct NAME##_f {                                                       \
    template <typename A>                                                 \
    static auto make(const Attrs& attrs) {                                \
      INIT;                                                               \
      return [=](A x) -> A { return EXPR; };                              \
    }                                                                     \
  };                                                                      \
  BLU_REGISTER_KERNEL(cpu, #NAME, unary<NAME##_f>)

BLU_UNARY(neg, -x);
BLU_UNARY(exp, std::exp(x));
BLU_UNARY(log, std::log(x));
BLU_UNARY(sqrt, std::sqrt(x));
BLU_UNARY(rsqrt, A(1) / std::sqrt(x));
BLU_UNARY(tanh, std::tanh(x));
BLU_UNARY(sigmoid, A(1) / (A(1) + std::exp(-x)));
BLU_UNARY(relu, x > A(0) ? x : (std::isnan(x) ? x : A(0)));
BLU_UNARY(abs, std::abs(x));
BLU_UNARY(sign, A((x > A(0)) - (x < A(0))));
BLU_UNARY_WITH(clamp, const A lo = A(attrs.f("lo")); const A hi = A(attrs.f("hi")),
               std::isnan(x) ? x : std::min(std::max(x, lo), hi));
BLU_UNARY_WITH(pow_scalar, const A v = A(attrs.f("value")), std::pow(x, v));
BLU_UNARY_WITH(add_scalar, const A v = A(attrs.f("value")), x + v);
BLU_UNARY_WITH(mul_scalar, const A v = A(attrs.f("value")), x * v);

// Binary kernel over any non-bool dtype: out = F(a, b).
template <typename F>
void binary(const KernelCall& c) {
  Tensor& out = c.out[0];
  BLU_DISPATCH_ALL(c.in[0].dtype(), c.op, {
    if constexpr (!std::is_same_v<scalar_t, bool>) {
      using A = acc_t<scalar_t>;
      map<scalar_t, scalar_t>(out, [](A a, A b) { return F::apply(a, b); }, c.in[0], c.in[1]);
    }
  });
}
#define BLU_BINARY(NAME, EXPR)                                                  \
  struct NAME##_f {                                                             \
    template <typename A> static A apply(A a, A b) { return EXPR; }             \
  };                                                                            \
  BLU_REGISTER_KERNEL(cpu, #NAME, binary<NAME##_f>)

template <typename A> A safe_div(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    BLU_CHECK(b != 0, "div: integer division by zero");
    return a / b;
  } else {
    return a / b;
  }
}
BLU_BINARY(add, a + b);
BLU_BINARY(sub, a - b);
BLU_BINARY(mul, a * b);
BLU_BINARY(div, safe_div(a, b));
BLU_BINARY(pow, A(std::pow(a, b)));
// In place, a op= b: the same kernels with the output being input 0 (read through its own strides).
BLU_REGISTER_KERNEL(cpu, "add_", binary<add_f>);
BLU_REGISTER_KERNEL(cpu, "mul_", binary<mul_f>);

// Gradient helpers that read (grad, x).
template <typename F>
void grad_unary(const KernelCall& c) {
  Tensor& out = c.out[0];
  BLU_DISPATCH_FLOATING(out.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    auto f = F::template make<A>(c.attrs);
    map<scalar_t, scalar_t>(out, f, c.in[0], c.in[1]);
  });
}
// gelu (input x), gelu_backward (grad, x) and gelu_and_backward (grad, x → gelu(x) and
// grad·gelu'(x); the CUDA backend fuses the two passes), each with its form chosen outside the loop.
void gelu(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    if (c.attrs.b("approximate")) map<scalar_t, scalar_t>(c.out[0], [](A x) { return gelu_fwd<A, true>(x); }, c.in[0]);
    else map<scalar_t, scalar_t>(c.out[0], [](A x) { return gelu_fwd<A, false>(x); }, c.in[0]);
  });
}
BLU_REGISTER_KERNEL(cpu, "gelu", gelu);
void gelu_backward(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    if (c.attrs.b("approximate"))
      map<scalar_t, scalar_t>(c.out[0], [](A g, A x) { return g * gelu_bwd<A, true>(x); }, c.in[0], c.in[1]);
    else
      map<scalar_t, scalar_t>(c.out[0], [](A g, A x) { return g * gelu_bwd<A, false>(x); }, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cpu, "gelu_backward", gelu_backward);
template <bool Approx>
void gelu_and_backward_as(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.in[1].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    map<scalar_t, scalar_t>(c.out[0], [](A x) { return gelu_fwd<A, Approx>(x); }, c.in[1]);
    map<scalar_t, scalar_t>(c.out[1], [](A g, A x) { return g * gelu_bwd<A, Approx>(x); }, c.in[0], c.in[1]);
  });
}
void gelu_and_backward(const KernelCall& c) {
  if (c.attrs.b("approximate")) gelu_and_backward_as<true>(c);
  else gelu_and_backward_as<false>(c);
}
BLU_REGISTER_KERNEL(cpu, "gelu_and_backward", gelu_and_backward);
struct clamp_backward_f {
  template <typename A> static auto make(const Attrs& a) {
    const A lo = A(a.f("lo")), hi = A(a.f("hi"));
    return [lo, hi](A g, A x) -> A { return x >= lo && x <= hi ? g : A(0); };
  }
};
BLU_REGISTER_KERNEL(cpu, "clamp_backward", grad_unary<clamp_backward_f>);

// Comparisons: bool out.
template <typename F>
void compare(const KernelCall& c) {
  Tensor& out = c.out[0];
  BLU_DISPATCH_ALL(c.in[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    map<bool, scalar_t>(out, [](A a, A b) { return F::apply(a, b); }, c.in[0], c.in[1]);
  });
}
#define BLU_COMPARE(NAME, OP)                                                   \
  struct NAME##_f {                                                             \
    template <typename A> static bool apply(A a, A b) { return a OP b; }        \
  };                                                                            \
  BLU_REGISTER_KERNEL(cpu, #NAME, compare<NAME##_f>)
BLU_COMPARE(eq, ==);
BLU_COMPARE(ne, !=);
BLU_COMPARE(lt, <);
BLU_COMPARE(le, <=);
BLU_COMPARE(gt, >);
BLU_COMPARE(ge, >=);

void where_kernel(const KernelCall& c) {
  Tensor& out = c.out[0];
  const Shape& shape = out.shape();
  std::array<Shape, 4> strides{out.strides(), broadcast_strides(c.in[0], shape), broadcast_strides(c.in[1], shape),
                               broadcast_strides(c.in[2], shape)};
  const bool* cond = c.in[0].data<bool>();
  BLU_DISPATCH_ALL(out.dtype(), "where", {
    scalar_t* o = out.data<scalar_t>();
    const scalar_t* a = c.in[1].data<scalar_t>();
    const scalar_t* b = c.in[2].data<scalar_t>();
    strided_loop(shape, strides, [&](int64_t, const std::array<int64_t, 4>& off) {
      o[off[0]] = cond[off[1]] ? a[off[2]] : b[off[3]];
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "where", where_kernel);

void mul_scalar_inplace(const KernelCall& c) {
  Tensor& a = c.out[0];
  BLU_DISPATCH_FLOATING(a.dtype(), "mul_scalar_", {
    using A = acc_t<scalar_t>;
    const A s = A(c.attrs.f("value"));
    map<scalar_t, scalar_t>(a, [s](A x) { return x * s; }, a);
  });
}
BLU_REGISTER_KERNEL(cpu, "mul_scalar_", mul_scalar_inplace);

// --- copies and casts ---
template <typename Out>
void convert_into(Tensor& out, const Tensor& src) {
  BLU_DISPATCH_ALL(src.dtype(), "copy", {
    if constexpr (std::is_same_v<Out, bool>) {
      map<Out, scalar_t>(out, [](acc_t<scalar_t> x) { return x != acc_t<scalar_t>(0); }, src);
    } else if constexpr (std::is_same_v<scalar_t, bool>) {
      map<Out, scalar_t>(out, [](bool x) { return acc_t<Out>(x ? 1 : 0); }, src);
    } else {
      // float → 16-bit converts straight from float (one rounding); wide types go through acc.
      map<Out, scalar_t>(out, [](acc_t<scalar_t> x) { return x; }, src);
    }
  });
}
// Same-dtype copies move bits (NaN payloads included), as cudaMemcpy and the CUDA kernels do.
template <typename T>
void copy_bits(Tensor& out, const Tensor& src) {
  const Shape& shape = out.shape();
  std::array<Shape, 2> strides{out.strides(), broadcast_strides(src, shape)};
  T* o = static_cast<T*>(out.raw_data());
  const T* s = static_cast<const T*>(src.raw_data());
  strided_loop(shape, strides, [&](int64_t, const std::array<int64_t, 2>& off) { o[off[0]] = s[off[1]]; });
}

void copy_kernel(const KernelCall& c) {
  Tensor& out = c.out[0];
  const Tensor& src = c.in.size() > 1 ? c.in[1] : c.in[0];
  if (src.dtype() == out.dtype()) {
    switch (dtype_size(out.dtype())) {
      case 1: return copy_bits<uint8_t>(out, src);
      case 2: return copy_bits<uint16_t>(out, src);
      case 4: return copy_bits<uint32_t>(out, src);
      default: return copy_bits<uint64_t>(out, src);
    }
  }
  BLU_DISPATCH_ALL(out.dtype(), "copy", convert_into<scalar_t>(out, src));
}
BLU_REGISTER_KERNEL(cpu, "copy_", copy_kernel);

// Contiguous pairs of one dtype (ops/view.cpp copy_many_): destinations in[0, n), sources in[n, 2n).
void copy_many_kernel(const KernelCall& c) {
  const size_t n = c.in.size() / 2;
  for (size_t i = 0; i < n; ++i) std::memcpy(c.in[i].raw_data(), c.in[n + i].raw_data(), c.in[i].nbytes());
}
BLU_REGISTER_KERNEL(cpu, "copy_many", copy_many_kernel);
BLU_REGISTER_KERNEL(cpu, "clone", copy_kernel);
BLU_REGISTER_KERNEL(cpu, "cast", copy_kernel);
// Between the host and a device pool (cpu:N, memory/device_pool.h): both are host memory.
BLU_REGISTER_KERNEL(cpu, "to_device", copy_kernel);

// --- factories ---
void empty_kernel(const KernelCall&) {}
BLU_REGISTER_KERNEL(cpu, "empty", empty_kernel);

void fill_kernel(const KernelCall& c) {
  Tensor& t = c.out[0];
  const double v = c.attrs.f("value");
  BLU_DISPATCH_ALL(t.dtype(), "fill_", {
    const scalar_t x = scalar_t(v);
    map<scalar_t, scalar_t>(t, [x](auto) { return x; }, t);
  });
}
BLU_REGISTER_KERNEL(cpu, "fill_", fill_kernel);

void arange_kernel(const KernelCall& c) {
  Tensor& t = c.out[0];
  const double start = c.attrs.f("start"), step = c.attrs.f("step");
  BLU_DISPATCH_ALL(t.dtype(), "arange", {
    scalar_t* p = t.data<scalar_t>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = scalar_t(start + double(i) * step);
  });
}
BLU_REGISTER_KERNEL(cpu, "arange", arange_kernel);

// Element i uses Philox block (offset + i/4), lane i%4 (core/rng.h).
template <typename F>
void philox_fill(Tensor& t, const Attrs& a, F f) {
  const uint64_t seed = uint64_t(a.i("seed")), offset = uint64_t(a.i("offset"));
  const int64_t n = t.numel();
  const int64_t blocks = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t b = 0; b < blocks; ++b) {
    const auto r = Philox::block(seed, offset + uint64_t(b));
    for (int lane = 0; lane < 4 && b * 4 + lane < n; ++lane) f(b * 4 + lane, r, lane);
  }
}
void rand_kernel(const KernelCall& c) {
  Tensor& t = c.out[0];
  BLU_DISPATCH_FLOATING(t.dtype(), "rand", {
    scalar_t* p = t.data<scalar_t>();
    // As many bits as the type holds: rounding 24 bits to bf16/f16 could give 1.0.
    constexpr int bits = std::is_same_v<scalar_t, bf16> ? 8 : std::is_same_v<scalar_t, f16> ? 11 : 24;
    philox_fill(t, c.attrs, [&](int64_t i, const std::array<uint32_t, 4>& r, int lane) {
      p[i] = scalar_t(Philox::uniform(r[lane], bits));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "rand", rand_kernel);
void randn_kernel(const KernelCall& c) {
  Tensor& t = c.out[0];
  BLU_DISPATCH_FLOATING(t.dtype(), "randn", {
    scalar_t* p = t.data<scalar_t>();
    philox_fill(t, c.attrs, [&](int64_t i, const std::array<uint32_t, 4>& r, int lane) {
      // Box–Muller on the lane pair (0,1) or (2,3): cos for the even lane, sin for the odd.
      const int pair = lane & ~1;
      const float u1 = 1.0f - Philox::uniform(r[pair]);  // (0, 1]
      const float u2 = Philox::uniform(r[pair + 1]);
      // log, sin and cos in double, rounded once to float: glibc's float versions are not
      // correctly rounded and CUDA's differ from them; these roundings agree on every input, so
      // the CUDA kernel (backend/cuda/philox.cuh) draws the same bits (tests/cuda checks it).
      const float rad = std::sqrt(-2.0f * float(std::log(double(u1))));
      const float ang = 2.0f * std::numbers::pi_v<float> * u2;
      p[i] = scalar_t(rad * float((lane & 1) ? std::sin(double(ang)) : std::cos(double(ang))));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "randn", randn_kernel);
void randint_kernel(const KernelCall& c) {
  Tensor& t = c.out[0];
  const int64_t low = c.attrs.i("low"), range = c.attrs.i("high") - low;
  BLU_DISPATCH_ALL(t.dtype(), "randint", {
    scalar_t* p = t.data<scalar_t>();
    philox_fill(t, c.attrs, [&](int64_t i, const std::array<uint32_t, 4>& r, int lane) {
      p[i] = scalar_t(low + int64_t(uint64_t(r[lane]) % uint64_t(range)));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "randint", randint_kernel);

}  // namespace

}  // namespace blu::cpu
