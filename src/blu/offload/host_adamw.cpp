// offload/host_adamw: the threaded host AdamW (header). Built with -ffp-contract=off (no FMA
// contraction: every operation rounds apart, as the kernels' do) and -fno-math-errno (std::sqrt
// without its errno branch, so the loops vectorise; CMakeLists.txt sets both for this file). On
// x86-64 the chunk loop is cloned for AVX-512 and AVX2 and picked by the CPU at load time
// (target_clones): vector sqrt and division round exactly as scalar ones, so every clone gives the
// same bits.
#include "blu/offload/host_adamw.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace blu::offload {

AdamWCoefficients AdamWCoefficients::make(double lr, double b1, double b2, double eps, double wd, int64_t step) {
  // As adamw_step_kernel (backend/cpu/optim.cpp): double first, then each rounded to float.
  const double t = double(step);
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  return {.decay = float(1 - lr * wd),
          .b1 = float(b1),
          .b2 = float(b2),
          .one_m_b1 = float(1 - b1),
          .one_m_b2 = float(1 - b2),
          .bc2_sqrt = float(std::sqrt(bc2)),
          .eps = float(eps),
          .neg_step_size = float(-(lr / bc1))};
}

GateDecision GateDecision::from_total(double total, double max_norm) {
  if (total < 0) return {};
  const double norm = std::sqrt(total);
  if (!std::isfinite(norm)) return {.skip = true};
  const double coef = max_norm / (norm + 1e-6);
  return {.skip = false, .clip = coef < 1.0, .coef = float(coef)};
}

namespace {

// One contiguous run, the kernel's order. Copy: a 16-bit float type of core/dtype.h, or void.
template <typename Copy, bool kClip>
[[gnu::always_inline]] inline void run(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
         uint16_t* __restrict c, int64_t n, const AdamWCoefficients k, float coef) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = kClip ? g[i] * coef : g[i];
    float pi = p[i] * k.decay;
    const float mi = m[i] * k.b1 + k.one_m_b1 * gi;
    const float vi = v[i] * k.b2 + k.one_m_b2 * gi * gi;
    const float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    pi = pi + k.neg_step_size * mi / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (!std::is_void_v<Copy>) c[i] = Copy(pi).bits;
  }
}

template <typename Copy>
[[gnu::always_inline]] inline void run_gated(float* p, const float* g, float* m, float* v, uint16_t* c, int64_t n,
                                             const AdamWCoefficients& k, const GateDecision& gate) {
  if (gate.clip)
    run<Copy, true>(p, g, m, v, c, n, k, gate.coef);
  else
    run<Copy, false>(p, g, m, v, c, n, k, 1.0f);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BLU_HOST_ADAMW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BLU_HOST_ADAMW_CLONES
#endif

// One chunk of the update: copy null (none), or its bf16 / f16 bits.
BLU_HOST_ADAMW_CLONES
void run_chunk(float* p, const float* g, float* m, float* v, uint16_t* c, DType copy_dtype, int64_t n,
               const AdamWCoefficients& k, const GateDecision& gate) {
  if (!c)
    run_gated<void>(p, g, m, v, c, n, k, gate);
  else if (copy_dtype == DType::f16)
    run_gated<f16>(p, g, m, v, c, n, k, gate);
  else
    run_gated<bf16>(p, g, m, v, c, n, k, gate);
}

}  // namespace

int threads_beside_one() { return std::max(1, omp_get_max_threads() - 1); }

void adamw_host_update(float* p, const float* g, float* m, float* v, uint16_t* copy, DType copy_dtype, int64_t n,
                       const AdamWCoefficients& k, const GateDecision& gate, int threads) {
  if (gate.skip || n <= 0) return;
  constexpr int64_t kChunk = int64_t(1) << 15;  // elements per task: 512 KiB of operands, cache-sized
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nt) if (chunks > 1)
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t b = ci * kChunk, len = std::min(kChunk, n - b);
    run_chunk(p + b, g + b, m + b, v + b, copy ? copy + b : nullptr, copy_dtype, len, k, gate);
  }
}

void add_host(float* acc, const float* in, int64_t n, int threads) {
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nt) if (chunks > 1)
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t b = ci * kChunk, e = std::min(n, b + kChunk);
    for (int64_t i = b; i < e; ++i) acc[i] = acc[i] + in[i];
  }
}

double sum_squares_host(const float* x, int64_t n, int threads) {
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> part(size_t(std::max<int64_t>(chunks, 1)), 0.0);
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nt) if (chunks > 1)
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t b = ci * kChunk, e = std::min(n, b + kChunk);
    double s = 0;
    for (int64_t i = b; i < e; ++i) s += double(x[i]) * double(x[i]);
    part[size_t(ci)] = s;
  }
  double total = 0;
  for (double p : part) total += p;
  return total;
}

}  // namespace blu::offload
