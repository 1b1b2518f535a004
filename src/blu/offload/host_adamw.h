// offload/host_adamw: AdamW's update run by the host over state held in host memory — the CPU way
// of updating offloaded optimizer state (offload/offload_adamw.h). The elements are split into
// chunks over a pool of threads (OpenMP) and each chunk is one simple loop over contiguous floats
// that the compiler vectorises (sqrt and division are correctly rounded in SIMD as in scalar code).
// Depends on core/ (dtype). Keep: the arithmetic of backend/cpu/optim.cpp's adamw_step kernel
// (and so of backend/cuda/optim.cu's) operation for operation — every product, sum, quotient and
// square root rounded to fp32 once, in the same order, the coefficients computed in double first —
// so the result is bit for bit the kernels'; no fused multiply-add (this file is built without
// contraction: see the pragma in host_adamw.cpp).
#pragma once
#include <cstdint>

#include "blu/core/dtype.h"

namespace blu::offload {

// The per-step coefficients of the adamw_step kernels, rounded to float as they round them.
struct AdamWCoefficients {
  float decay, b1, b2, one_m_b1, one_m_b2, bc2_sqrt, eps, neg_step_size;
  static AdamWCoefficients make(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step);
};

// The norm gate's decision (Note [Norm gate], ops/optim.h) from its total on the host: skip the
// update when the norm is not finite, else scale every gradient element by float(coef) when
// coef = max_norm / (norm + 1e-6) < 1. total < 0: no gate.
struct GateDecision {
  bool skip = false, clip = false;
  float coef = 1;
  static GateDecision from_total(double total, double max_norm);
};

// One parameter's (or one chunk's) update in place: p, m, v fp32 and g fp32, n elements each,
// contiguous. `copy` (may be null) receives round(p_new) as `copy_dtype` (bf16 or f16) bits.
// threads <= 0: OpenMP's default.
void adamw_host_update(float* p, const float* g, float* m, float* v, uint16_t* copy, DType copy_dtype, int64_t n,
                       const AdamWCoefficients& k, const GateDecision& gate, int threads = 0);

// Threads for a host update that runs beside a thread queueing device work (Note [Update behind
// the forward], offload/offload_adamw.h): OpenMP's default less one, at least one. With every core
// in the update's static schedule, the queueing thread takes a core from one of its threads and the
// whole update waits for that one (measured on an H200 host of 16 cores: the overlap gained 3% with
// 16 threads and 17% with 15).
int threads_beside_one();

// acc[i] = acc[i] + in[i] (fp32, one rounding each: a gradient's accumulation as the device adds).
void add_host(float* acc, const float* in, int64_t n, int threads = 0);
// Σ double(x[i])², summed in fixed chunks whose partial sums are added in order, so the result
// does not depend on the number of threads.
double sum_squares_host(const float* x, int64_t n, int threads = 0);

}  // namespace blu::offload
