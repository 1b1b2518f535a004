// Yardsticks of the flash-attention GPU tests (flash_attention_test.cpp, flash_attention_gqa_test.cpp):
// the per-dtype tolerances against the f64 CPU reference, an elementwise comparison that names the
// worst element, and the f32 paths' norm-and-elementwise bounds.
#pragma once
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blu/blu.h"
#include "cuda/flash_attention_scopes.h"

namespace blu::test {

// Tolerances: inputs are rounded to the tested dtype first and the f64 reference is computed
// from those rounded values, so only the kernel's own arithmetic is measured. Errors are checked
// elementwise as |got − want| <= atol + rtol·|want|.
//  f32:  fp32 accumulation over <= 1024 terms of O(1) values and __expf (a few ulp): ~1e-6
//        relative in practice; 1e-4 leaves room for long rows. (The TF32 kernels at 3xTF32 reach
//        the same level; run_sweep runs f32 under matmul precision "ieee". 1xTF32 is checked by
//        the FlashAttentionF32 tests with their own bounds.)
//  bf16: 8 significant bits (unit roundoff 2^-9 ≈ 2e-3). The kernels round P (forward) and P, dS
//        (backward) to bf16 before the tensor-core products, and the outputs once; the forward
//        output (O(1): a convex mix of N(0,1) rows) gets ~2 roundings → 1e-2 + 1e-2·|want|.
//        Gradients sum up to T rounded products and Dsum uses the rounded O: 4e-2 + 4e-2·|want|.
//  f16:  11 significant bits (2^-12 ≈ 2.4e-4): 8x tighter than bf16 (values stay far from the
//        f16 range limits at these magnitudes).
struct Tol {
  double fwd_atol, fwd_rtol, bwd_atol, bwd_rtol;
};
inline Tol tolerance(DType dt) {
  switch (dt) {
    case DType::f32: return {1e-4, 1e-4, 2e-4, 2e-4};
    case DType::bf16: return {1e-2, 1e-2, 4e-2, 4e-2};
    case DType::f16: return {2e-3, 2e-3, 5e-3, 5e-3};
    default: return {0, 0, 0, 0};
  }
}

// Compares [B, H, T, D] tensors; "" when within tolerance, else the worst element with its
// (b, h, t, d) and the error statistics.
inline std::string check_close(const std::string& what, const Tensor& got, const Tensor& want, double atol, double rtol) {
  if (got.shape() != want.shape()) {
    std::ostringstream os;
    os << what << ": shape " << got.str() << " vs " << want.str();
    return os.str();
  }
  const std::vector<double> a = to_vector(got), b = to_vector(want);
  double worst = 0, max_err = 0, sum_sq = 0, max_want = 0;
  int64_t at = -1, bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::abs(a[i] - b[i]);
    const double tol = atol + rtol * std::abs(b[i]);
    max_want = std::max(max_want, std::abs(b[i]));
    if (!std::isnan(err)) {
      max_err = std::max(max_err, err);
      sum_sq += err * err;
    }
    if (!(err <= tol)) {
      ++bad;
      const double ratio = std::isnan(err) ? INFINITY : err / tol;
      if (at < 0 || ratio > worst) {
        worst = ratio;
        at = int64_t(i);
      }
    }
  }
  if (at < 0) return "";
  const Shape& s = want.shape();
  int64_t r = at;
  std::vector<int64_t> idx(s.size());
  for (int64_t d = int64_t(s.size()) - 1; d >= 0; --d) {
    idx[size_t(d)] = r % s[size_t(d)];
    r /= s[size_t(d)];
  }
  std::ostringstream os;
  os.precision(6);
  os << what << ": " << bad << " of " << a.size() << " elements off; worst at [";
  for (size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
  os << "]: got " << a[size_t(at)]
     << " want " << b[size_t(at)] << " (" << worst << "x tolerance); max |err| " << max_err << ", rms err "
     << std::sqrt(sum_sq / double(std::max<size_t>(a.size(), 1))) << ", max |want| " << max_want;
  return os.str();
}

// --- f32 paths: out, lse and the three gradients, bounded in norm and elementwise -------------
//
// Bounds (inputs are f32 values; the reference is the f64 composite path on the CPU):
//   norm:  ‖got − want‖₂ ≤ rel·‖want‖₂ per tensor: the brief's accuracy target of each mode.
//          3xTF32 carries ~2^-22 relative per operand plus fp32 accumulation (~1e-6 seen in the
//          CPU emulation of the kernels, which sums in f64; on an H200 the tensor cores' fp32
//          accumulation, which truncates, gave dk/dv up to 1.15e-5 over 1024-key sums): rel 3e-5,
//          still 3x under the 1e-4 the GPT-2 fp32 test asks against PyTorch. 1xTF32 rounds every operand to 11
//          significant bits (2^-12 relative each; ~3e-4 to 5e-4 on the outputs in the emulation):
//          rel 5e-3.
//   elem:  |got − want| ≤ elem·(|want| + rms(want)) for every element, so that one wrong row or
//          tail element cannot hide in the norm of a large tensor: elem = 10x (ieee) / 4x (tf32)
//          the norm bound. A reference that is exactly 0 (dq, dk at T = 1: attention over one key
//          is the identity on v) gets rms 0.1 in that formula and no norm check.
struct F32Tol {
  double rel, elem;
};
inline F32Tol f32_tolerance(F32Path path) {
  switch (path) {
    case F32Path::tf32_1x: return {5e-3, 2e-2};
    case F32Path::ieee_3xtf32: return {3e-5, 3e-4};
  }
  return {0, 0};
}

// Largest norm-relative error seen per tensor over a sweep (printed, to show the margins).
struct ErrStats {
  std::vector<std::pair<std::string, double>> worst;
  void add(const std::string& what, double e) {
    for (auto& [name, v] : worst)
      if (name == what) {
        v = std::max(v, e);
        return;
      }
    worst.emplace_back(what, e);
  }
  double get(const std::string& what) const {
    for (const auto& [name, v] : worst)
      if (name == what) return v;
    return 0;
  }
  std::string str() const {
    std::ostringstream os;
    os.precision(3);
    for (const auto& [name, v] : worst) os << " " << name << " " << v;
    return os.str();
  }
};

// "" when `got` is within `tol` of the f64 reference `want` (same number of elements), else what
// is off. Adds the norm-relative error to `stats`.
inline std::string check_norm(const std::string& what, const Tensor& got, const Tensor& want, const F32Tol& tol,
                       ErrStats& stats) {
  const std::vector<double> a = to_vector(got), b = to_vector(want);
  if (a.size() != b.size()) return what + ": " + got.str() + " vs " + want.str();
  double err2 = 0, want2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err2 += (a[i] - b[i]) * (a[i] - b[i]);
    want2 += b[i] * b[i];
  }
  const double n = double(std::max<size_t>(a.size(), 1));
  const double rms = want2 > 0 ? std::sqrt(want2 / n) : 0.1;
  const double rel = want2 > 0 ? std::sqrt(err2 / want2) : 0;
  std::ostringstream os;
  os.precision(4);
  if (!(err2 == err2)) os << what << ": NaN in the result. ";
  if (want2 > 0) {
    stats.add(what, rel);
    if (!(rel <= tol.rel)) os << what << ": norm-relative error " << rel << " > " << tol.rel << ". ";
  }
  int64_t bad = 0, at = -1;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double r = std::abs(a[i] - b[i]) / (tol.elem * (std::abs(b[i]) + rms));
    if (!(r <= 1)) {
      ++bad;
      if (at < 0 || !(r <= worst)) {
        worst = r;
        at = int64_t(i);
      }
    }
  }
  if (bad) {
    const Shape& s = want.shape();
    std::vector<int64_t> idx(s.size());
    int64_t r = at;
    for (int64_t d = int64_t(s.size()) - 1; d >= 0; --d) {
      idx[size_t(d)] = r % s[size_t(d)];
      r /= s[size_t(d)];
    }
    os << what << ": " << bad << " of " << a.size() << " elements off by more than " << tol.elem
       << "·(|want| + rms " << rms << "); worst at [";
    for (size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
    os << "]: got " << a[size_t(at)] << " want " << b[size_t(at)] << " (" << worst << "x)";
  }
  return os.str();
}

}  // namespace blu::test
