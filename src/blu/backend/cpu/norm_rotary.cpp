// CPU kernels for ops/norm_rotary: rms_norm (+ backward) and rotary_embedding (+ backward), the
// reference the CUDA kernels are tested against. Rows run in parallel (OpenMP); 16-bit types
// compute in f32, row sums accumulate in double, and each output is rounded once. The weight
// gradient's column sums run serially over rows in double (deterministic for any thread count).
#include <cmath>
#include <type_traits>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

namespace {

template <typename T>
const T* cdata(const Tensor& t) {
  return static_cast<const T*>(t.raw_data());
}
int row_threads(int64_t rows, int64_t work) { return rows > 1 && work >= 2 * kGrain ? omp_get_max_threads() : 1; }

// --- rms_norm ----------------------------------------------------------------------------------

// Inputs (x [R, C] contiguous, weight [C] contiguous or undefined); outputs y, rstd [R].
void rms_norm_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous() && (!c.in[1].defined() || c.in[1].is_contiguous()), "rms_norm: operands must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  const double eps = c.attrs.f("eps");
  BLU_DISPATCH_FLOATING(x.dtype(), "rms_norm", {
    using A = acc_t<scalar_t>;
    using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* xp = cdata<scalar_t>(x);
    const scalar_t* wp = c.in[1].defined() ? cdata<scalar_t>(c.in[1]) : nullptr;
    scalar_t* yp = c.out[0].data<scalar_t>();
    S* rp = c.out[1].data<S>();
    const int nt = row_threads(R, x.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t r = 0; r < R; ++r) {
      const scalar_t* row = xp + r * C;
      double ss = 0;
      for (int64_t k = 0; k < C; ++k) {
        const double v = double(A(row[k]));
        ss += v * v;
      }
      const double rstd = 1.0 / std::sqrt(ss / double(C) + eps);
      rp[r] = S(rstd);
      const A ra = A(rstd);
      for (int64_t k = 0; k < C; ++k) {
        A y = A(row[k]) * ra;
        if (wp) y = y * A(wp[k]);
        yp[r * C + k] = scalar_t(y);
      }
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "rms_norm", rms_norm_kernel);

// Inputs (g, x, weight or undefined, rstd[, pending]), g and x contiguous. With xh = x·rstd and
// gh = g·w:
//   gx = rstd·(gh − xh·mean(gh·xh)) [+ pending, after rounding],   gw = Σ_rows g·xh   (in x's
//   dtype, or f32: param_dtype).
void rms_norm_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& x = c.in[1];
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous(), "rms_norm_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  BLU_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", {
    using A = acc_t<scalar_t>;
    using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* gp = cdata<scalar_t>(g);
    const scalar_t* xp = cdata<scalar_t>(x);
    const scalar_t* wp = c.in[2].defined() ? cdata<scalar_t>(c.in[2]) : nullptr;
    const S* rp = cdata<S>(c.in[3]);
    const Tensor pending = c.optional_in(4);
    const scalar_t* pp = pending.defined() ? cdata<scalar_t>(pending) : nullptr;
    scalar_t* gxp = c.out[0].data<scalar_t>();
    const int nt = row_threads(R, x.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t r = 0; r < R; ++r) {
      const scalar_t* grow = gp + r * C;
      const scalar_t* xrow = xp + r * C;
      const double rstd = double(rp[r]);
      double sgx = 0;
      for (int64_t k = 0; k < C; ++k) {
        const double gh = double(A(grow[k])) * (wp ? double(A(wp[k])) : 1.0);
        sgx += gh * double(A(xrow[k])) * rstd;
      }
      sgx /= double(C);
      for (int64_t k = 0; k < C; ++k) {
        const double xh = double(A(xrow[k])) * rstd;
        const double gh = double(A(grow[k])) * (wp ? double(A(wp[k])) : 1.0);
        const scalar_t gx = scalar_t(A(rstd * (gh - xh * sgx)));
        gxp[r * C + k] = pp ? scalar_t(A(gx) + A(pp[r * C + k])) : gx;  // as add(pending, gx) rounds
      }
    }
    std::vector<double> gw(size_t(C), 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const double rstd = double(rp[r]);
      for (int64_t k = 0; k < C; ++k) gw[size_t(k)] += double(A(gp[r * C + k])) * double(A(xp[r * C + k])) * rstd;
    }
    Tensor& out = c.out[1];
    for (int64_t k = 0; k < C; ++k) {
      if (out.dtype() == DType::f32) out.data<float>()[k] = float(gw[size_t(k)]);
      else out.data<scalar_t>()[k] = scalar_t(A(gw[size_t(k)]));
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "rms_norm_backward", rms_norm_backward_kernel);

// --- rotary_embedding --------------------------------------------------------------------------

// Inputs (x [B, T, H, D] with unit stride along D, cos, sin [T, D] contiguous in CS = f32 or x's
// dtype); output [B, T, H, D] contiguous. For each pair (j, j + D/2), h = D/2:
//   forward:   y[j] = x[j]·c[j] − x[j+h]·s[j],    y[j+h] = x[j+h]·c[j+h] + x[j]·s[j+h]
//   backward:  y[j] = x[j]·c[j] + x[j+h]·s[j+h],  y[j+h] = x[j+h]·c[j+h] − x[j]·s[j]
// (x is then the gradient), in the accumulation type (f64 for f64 x). Heads ≥ attr "rotate" are
// copied unchanged.
template <bool kBackward>
void rotary_kernel(const KernelCall& c) {
  const Tensor &x = c.in[0], &cos = c.in[1], &sin = c.in[2];
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), h = D / 2;
  const int64_t rotate = c.attrs.has("rotate") ? c.attrs.i("rotate") : H;
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  BLU_DISPATCH_FLOATING(x.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = cdata<scalar_t>(x);
    scalar_t* yp = c.out[0].data<scalar_t>();
    auto run = [&]<typename CS>(const CS* cp, const CS* sp) {
      const int nt = row_threads(B * T * H, x.numel());
      _Pragma("omp parallel for num_threads(nt) schedule(static)")
      for (int64_t row = 0; row < B * T * H; ++row) {
        const int64_t b = row / (T * H), t = row / H % T, hh = row % H;
        const scalar_t* xr = xp + b * sb + t * st + hh * sh;
        scalar_t* yr = yp + row * D;
        const CS* cr = cp + t * D;
        const CS* sr = sp + t * D;
        if (hh >= rotate) {
          for (int64_t j = 0; j < D; ++j) yr[j] = xr[j];
          continue;
        }
        for (int64_t j = 0; j < h; ++j) {
          const A x1 = A(xr[j]), x2 = A(xr[j + h]);
          const A c1 = A(cr[j]), c2 = A(cr[j + h]), s1 = A(sr[j]), s2 = A(sr[j + h]);
          if constexpr (kBackward) {
            yr[j] = scalar_t(x1 * c1 + x2 * s2);
            yr[j + h] = scalar_t(x2 * c2 - x1 * s1);
          } else {
            yr[j] = scalar_t(x1 * c1 - x2 * s1);
            yr[j + h] = scalar_t(x2 * c2 + x1 * s2);
          }
        }
      }
    };
    if (cos.dtype() == DType::f32) run(cdata<float>(cos), cdata<float>(sin));
    else run(cdata<scalar_t>(cos), cdata<scalar_t>(sin));
  });
}
BLU_REGISTER_KERNEL(cpu, "rotary_embedding", rotary_kernel<false>);
BLU_REGISTER_KERNEL(cpu, "rotary_embedding_backward", rotary_kernel<true>);

}  // namespace

}  // namespace blu::cpu
