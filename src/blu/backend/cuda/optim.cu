// CUDA kernels for ops/optim ("adamw_step", "sgd_step"): one pass over each parameter doing its
// whole update in place, with the CPU kernel's arithmetic (backend/cpu/optim.cpp) operation for
// operation: fp32 values, each product, sum, quotient and square root rounded once
// (__fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn, so nvcc cannot contract them into FMAs), the
// scalar coefficients computed on the host in double exactly as the CPU does. So the GPU and
// the CPU agree bit for bit, step after step.
// Depends on backend/cuda/nn_common. Keep: the operation order of the CPU kernel.
#include <cmath>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

namespace {

struct AdamWCoef {
  float decay, b1, b2, one_m_b1, one_m_b2, bc2_sqrt, eps, neg_step_size;
};

// Operands: 0 param, 1 grad, 2 exp_avg, 3 exp_avg_sq (offsets from their StridedIndex unless
// all are contiguous).
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, bool contiguous,
                             StridedIndex ip, StridedIndex ig, StridedIndex im, StridedIndex iv, AdamWCoef k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t op = contiguous ? i : ip.offset(i), og = contiguous ? i : ig.offset(i),
                  om = contiguous ? i : im.offset(i), ov = contiguous ? i : iv.offset(i);
    const float gi = g[og];
    float pi = __fmul_rn(p[op], k.decay);
    const float mi = __fadd_rn(__fmul_rn(m[om], k.b1), __fmul_rn(k.one_m_b1, gi));
    const float vi = __fadd_rn(__fmul_rn(v[ov], k.b2), __fmul_rn(__fmul_rn(k.one_m_b2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    pi = __fadd_rn(pi, __fdiv_rn(__fmul_rn(k.neg_step_size, mi), denom));
    p[op] = pi;
    m[om] = mi;
    v[ov] = vi;
  }
}

bool all_contiguous(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && !t->is_contiguous()) return false;
  return true;
}

void adamw_step_kernel(const KernelCall& c) {
  const Tensor& p = c.out[0];
  const Tensor &g = c.in[1], &m = c.in[2], &v = c.in[3];
  const int64_t n = p.numel();
  if (n == 0) return;
  const Attrs& a = c.attrs;
  const double lr = a.f("lr"), b1 = a.f("beta1"), b2 = a.f("beta2"), wd = a.f("weight_decay");
  const double t = double(a.i("step"));
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  const AdamWCoef k{float(1 - lr * wd), float(b1), float(b2), float(1 - b1), float(1 - b2), float(std::sqrt(bc2)),
                    float(a.f("eps")), float(-(lr / bc1))};
  adamw_kernel<<<grid_for(n), 256, 0, current_stream()>>>(
      static_cast<float*>(p.raw_data()), static_cast<const float*>(g.raw_data()), static_cast<float*>(m.raw_data()),
      static_cast<float*>(v.raw_data()), n, all_contiguous({&p, &g, &m, &v}), strided_index(p), strided_index(g),
      strided_index(m), strided_index(v), k);
  BLU_CUDA_CHECK_LAUNCH();
}
BLU_REGISTER_KERNEL(cuda, "adamw_step", adamw_step_kernel);

struct SGDCoef {
  float neg_lr, mom, wd;
  bool use_wd, use_buf, nesterov, init;
};

__global__ void sgd_kernel(float* p, const float* g, float* buf, int64_t n, bool contiguous, StridedIndex ip,
                           StridedIndex ig, StridedIndex ib, SGDCoef k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t op = contiguous ? i : ip.offset(i), og = contiguous ? i : ig.offset(i);
    float d = g[og];
    if (k.use_wd) d = __fadd_rn(d, __fmul_rn(k.wd, p[op]));
    if (k.use_buf) {
      const int64_t ob = contiguous ? i : ib.offset(i);
      const float b = k.init ? d : __fadd_rn(__fmul_rn(buf[ob], k.mom), d);
      buf[ob] = b;
      d = k.nesterov ? __fadd_rn(d, __fmul_rn(k.mom, b)) : b;
    }
    p[op] = __fadd_rn(p[op], __fmul_rn(k.neg_lr, d));
  }
}

void sgd_step_kernel(const KernelCall& c) {
  const Tensor& p = c.out[0];
  const Tensor& g = c.in[1];
  const Tensor& buf = c.in[2];
  const int64_t n = p.numel();
  if (n == 0) return;
  const Attrs& a = c.attrs;
  const SGDCoef k{float(-a.f("lr")), float(a.f("momentum")), float(a.f("weight_decay")), a.f("weight_decay") != 0,
                  buf.defined(), a.b("nesterov"), a.b("init_buffer")};
  sgd_kernel<<<grid_for(n), 256, 0, current_stream()>>>(
      static_cast<float*>(p.raw_data()), static_cast<const float*>(g.raw_data()),
      buf.defined() ? static_cast<float*>(buf.raw_data()) : nullptr, n, all_contiguous({&p, &g, &buf}),
      strided_index(p), strided_index(g), buf.defined() ? strided_index(buf) : StridedIndex{}, k);
  BLU_CUDA_CHECK_LAUNCH();
}
BLU_REGISTER_KERNEL(cuda, "sgd_step", sgd_step_kernel);

}  // namespace

}  // namespace blu::cuda
