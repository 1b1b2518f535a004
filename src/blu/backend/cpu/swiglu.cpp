// CPU kernels for ops/swiglu: silu (+ backward) and swiglu (+ backward), the reference the CUDA
// kernels are tested against. 16-bit types compute in f32 and round once; any input layout
// (the elementwise loops of loops.h, OpenMP over chunks).
#include <array>
#include <cmath>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

namespace {

template <typename A>
A sigmoid_of(A x) {
  return A(1) / (A(1) + std::exp(-x));
}
// silu'(x) = s + x·s·(1 − s) = s·(1 + x·(1 − s)).
template <typename A>
A silu_grad_of(A x) {
  const A s = sigmoid_of(x);
  return s * (A(1) + x * (A(1) - s));
}

void silu_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    map<scalar_t, scalar_t>(c.out[0], [](A x) -> A { return x * sigmoid_of(x); }, c.in[0]);
  });
}
BLU_REGISTER_KERNEL(cpu, "silu", silu_kernel);

// Inputs (g, x).
void silu_backward_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    map<scalar_t, scalar_t>(c.out[0], [](A g, A x) -> A { return g * silu_grad_of(x); }, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cpu, "silu_backward", silu_backward_kernel);

// Inputs (gate, up).
void swiglu_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), c.op, {
    using A = acc_t<scalar_t>;
    map<scalar_t, scalar_t>(c.out[0], [](A a, A b) -> A { return a * sigmoid_of(a) * b; }, c.in[0], c.in[1]);
  });
}
BLU_REGISTER_KERNEL(cpu, "swiglu", swiglu_kernel);

// Inputs (g, gate, up); outputs d_gate = g·up·silu'(gate) and d_up = g·silu(gate): two tensors,
// or (attr joined) one [..., 2I] buffer with d_gate in columns [0, I) and d_up in [I, 2I).
void swiglu_backward_kernel(const KernelCall& c) {
  const Tensor &g = c.in[0], &gate = c.in[1], &up = c.in[2];
  Tensor dgate = c.out[0], dup;
  if (c.attrs.b("joined")) {
    const int64_t I = gate.size(-1);
    dgate = c.out[0].alias_with(gate.shape(), c.out[0].strides(), c.out[0].offset());
    dup = c.out[0].alias_with(gate.shape(), c.out[0].strides(), c.out[0].offset() + I);
  } else {
    dup = c.out[1];
  }
  const Shape& shape = gate.shape();
  std::array<Shape, 5> strides{dgate.strides(), dup.strides(), g.strides(), gate.strides(), up.strides()};
  BLU_DISPATCH_FLOATING(gate.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    scalar_t* dgp = dgate.data<scalar_t>();
    scalar_t* dup_p = dup.data<scalar_t>();
    const scalar_t* gp = static_cast<const scalar_t*>(g.raw_data());
    const scalar_t* ap = static_cast<const scalar_t*>(gate.raw_data());
    const scalar_t* bp = static_cast<const scalar_t*>(up.raw_data());
    strided_loop(shape, strides, [&](int64_t, const std::array<int64_t, 5>& off) {
      const A gv = A(gp[off[2]]), a = A(ap[off[3]]), b = A(bp[off[4]]);
      const A s = sigmoid_of(a);
      dgp[off[0]] = scalar_t(gv * b * (s * (A(1) + a * (A(1) - s))));
      dup_p[off[1]] = scalar_t(gv * (a * s));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "swiglu_backward", swiglu_backward_kernel);

}  // namespace

}  // namespace blu::cpu
