// What the GPU kernel tests that compare against a reference share (tests/cuda/gemm_cuda_test.cpp,
// gemm_nn_cuda_test.cpp, optim_multi_cuda_test.cpp, norm_gate_cuda_test.cpp): host copies as
// vectors and in f64, random operands exact in their dtype, an elementwise tolerance check that
// reports the worst element, a bitwise check, the GEMM tolerances per numeric mode, and views
// placed at offsets and transposed inside one buffer, on the host and the device alike.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "blu/backend/cuda/gemm.h"
#include "blu/blu.h"
#include "cuda/cuda_test_util.h"

namespace blu::test {

inline std::vector<double> hvec(const Tensor& t) { return to_vector(t.device().is_cpu() ? t : host(t)); }
inline Tensor f64(const Tensor& t) { return to_dtype(t.device().is_cpu() ? t : host(t), DType::f64); }
// Random values exactly representable in dtype (drawn in f32, rounded once).
inline Tensor rnd(const Shape& s, DType dt, double scale = 1.0) { return to_dtype(mul(randn(s), scale), dt); }

// Element i passes when |got - ref| <= abs + rel_out·|ref| + rel_scale·scale_i (scale_i = |ref|
// when no scale is given). Reports the worst element (by err/allowed) and the first failures.
struct Tol {
  double abs = 0, rel_out = 0, rel_scale = 0;
};
inline ::testing::AssertionResult close(const std::string& what, const std::vector<double>& got,
                                 const std::vector<double>& ref, Tol tol, const std::vector<double>* scale = nullptr) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  size_t bad = 0, worst = 0;
  double worst_ratio = 0, max_err = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - ref[i]);
    const double s = scale ? (*scale)[i] : std::fabs(ref[i]);
    const double allowed = tol.abs + tol.rel_out * std::fabs(ref[i]) + tol.rel_scale * s;
    const bool ok = err <= allowed || (std::isnan(got[i]) && std::isnan(ref[i]));
    const double ratio = ok ? 0.0 : allowed > 0 && !std::isnan(err) ? err / allowed : INFINITY;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
    max_err = std::max(max_err, std::isnan(err) ? INFINITY : err);
    if (!ok && bad++ < 5)
      first << "\n  [" << i << "] got " << got[i] << " want " << ref[i] << " (err " << err << ", allowed " << allowed
            << ")";
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " elements out of tolerance (abs " << tol.abs << ", rel_out " << tol.rel_out
                                       << ", rel_scale " << tol.rel_scale << "); max |err| " << max_err
                                       << "; worst at " << worst << " (err/allowed " << worst_ratio << ")"
                                       << first.str();
}
inline ::testing::AssertionResult bit_equal(const std::string& what, const Tensor& a, const Tensor& b) {
  const Tensor ha = a.device().is_cpu() ? a : host(a), hb = b.device().is_cpu() ? b : host(b);
  if (ha.nbytes() != hb.nbytes() || ha.dtype() != hb.dtype())
    return ::testing::AssertionFailure() << what << ": " << ha.str() << " vs " << hb.str();
  const Tensor ca = contiguous(ha), cb = contiguous(hb);
  const auto* pa = static_cast<const unsigned char*>(ca.raw_data());
  const auto* pb = static_cast<const unsigned char*>(cb.raw_data());
  const size_t es = ca.itemsize();
  size_t diff = 0, first = SIZE_MAX;
  for (size_t i = 0; i < size_t(ca.numel()); ++i)
    if (std::memcmp(pa + i * es, pb + i * es, es) != 0 && diff++ == 0) first = i;
  if (diff == 0) return ::testing::AssertionSuccess();
  const auto va = to_vector(ca), vb = to_vector(cb);
  return ::testing::AssertionFailure() << what << ": " << diff << " of " << ca.numel()
                                       << " elements differ bitwise; first at " << first << ": " << va[first]
                                       << " vs " << vb[first];
}

// Where a tensor lives inside a 1-D buffer: at `offset` elements (one that breaks 16-byte
// alignment, say), transposed (2-D) or not.
struct Layout {
  Shape shape;
  int64_t offset = 0;
  bool transposed = false;
};
inline Tensor place(const Tensor& buffer, const Layout& l) {
  const Tensor v = narrow(buffer, 0, l.offset, numel(l.shape));
  if (!l.transposed) return view(v, l.shape);
  return transpose(view(v, {l.shape[1], l.shape[0]}), 0, 1);
}
// The same values in a host buffer and a device buffer, each seen through layout l.
struct Pair {
  Tensor h, d;
};
inline Pair pair(const Tensor& host_buffer, const Layout& l) {
  return {place(host_buffer, l), place(dev(host_buffer), l)};
}
// A host buffer that holds layout l: normal values times `scale` (their magnitudes when
// `positive`), rounded to dt.
inline Tensor buffer(const Layout& l, DType dt, double scale, bool positive, Generator& gen) {
  Tensor b = mul(randn({l.offset + numel(l.shape)}, DType::f32, kCPU, &gen), scale);
  if (positive) b = abs(b);
  return to_dtype(b, dt);
}

// Tolerances, relative to scale = Σ_k |a_ik|·|b_kj| (the size of the terms summed):
//  - f32 IEEE: fp32 products and sums; the rounding error of a K-term sum grows like √K·2^-24 in
//    practice (≈ 3e-6 at K = 3072): 1e-5 as the brief demands.
//  - TF32: each input is rounded to 11 significant bits (relative error ≤ 2^-11), so each product
//    is off by ≤ 2·2^-11 ≈ 1e-3 of its size; 2e-3 leaves room for the fp32 sums.
//  - bf16 / f16: inputs are exact in the reference (it multiplies the same rounded values), sums
//    are fp32 (1e-5 as f32), and the output is rounded once to 8 (bf16) / 11 (f16) significant
//    bits. Measured on an H200: cuBLASLt rounds the product to the output type before a bias or
//    GELU epilogue is applied (a second rounding), and its fp32 sums run in another order than
//    ours, so results land up to ~2 (bf16) / ~3 (f16) ulps from the reference: we allow 2^-7 and
//    2^-8 of |ref| (2 bf16 ulps, 4 f16 ulps). Because the product is rounded before the bias is
//    added, a result that cancels (C + bias ≈ 0) carries half an ulp of |C|, not of the result:
//    hence also 2^-8 (bf16) / 2^-11 (f16) of scale_i ≥ |C|.
//  - f64: 1e-12.
inline Tol gemm_tol(DType dt, cuda::GemmCompute c) {
  switch (c) {
    case cuda::GemmCompute::f32_ieee: return {0, 0, 1e-5};
    case cuda::GemmCompute::f32_tf32: return {0, 0, 2e-3};
    case cuda::GemmCompute::f64: return {0, 0, 1e-12};
    case cuda::GemmCompute::f16_f32: return dt == DType::bf16 ? Tol{0, 1.0 / 128, 1.0 / 256} : Tol{0, 1.0 / 256, 1.0 / 2048};
  }
  return {};
}

}  // namespace blu::test
