// CPU kernels for ops/linalg: every product is one OpenBLAS gemm per matrix.
// Strided operands go to BLAS as they are when one of their two strides is 1 (row-major with a
// leading dimension, or its transpose — so transposed views, as in linear's backward, cost no
// copy); other layouts (stride 0 from expand, every-other-element views) are packed first.
// f32/f64 call sgemm/dgemm directly; bf16/f16 are widened to fp32, multiplied with sgemm
// (fp32 accumulation) and rounded once into the output, as PyTorch's CPU does.
// OpenBLAS threads each gemm itself, so nothing here runs inside an OpenMP region.
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

namespace {

// An operand of `rows` x `cols` whose element (i, j) sits at p[i*rs + j*cs].
template <typename T>
struct Mat {
  const T* p;
  int64_t rows, cols, rs, cs;
};

// How BLAS can read a Mat in row-major order: as it is (ld = row stride) or as the transpose of
// a row-major matrix (ld = column stride). `ok` is false when neither stride is usable.
struct BlasLayout {
  bool ok = false;
  CBLAS_TRANSPOSE trans = CblasNoTrans;
  int64_t ld = 1;
};
template <typename T>
BlasLayout blas_layout(const Mat<T>& m) {
  // A stride along a size-1 dim is never used, so any value will do there.
  if ((m.cols == 1 || m.cs == 1) && (m.rows == 1 || m.rs >= std::max<int64_t>(m.cols, 1)))
    return {true, CblasNoTrans, m.rows == 1 ? std::max<int64_t>(m.cols, 1) : m.rs};
  if ((m.rows == 1 || m.rs == 1) && (m.cols == 1 || m.cs >= std::max<int64_t>(m.rows, 1)))
    return {true, CblasTrans, m.cols == 1 ? std::max<int64_t>(m.rows, 1) : m.cs};
  return {};
}

// m copied into `buf` as a contiguous row-major matrix of U.
template <typename U, typename T>
Mat<U> pack(const Mat<T>& m, std::vector<U>& buf) {
  buf.resize(size_t(m.rows * m.cols));
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) buf[size_t(i * m.cols + j)] = U(acc_t<T>(m.p[i * m.rs + j * m.cs]));
  return {buf.data(), m.rows, m.cols, m.cols, 1};
}

void cblas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, blasint(m), blasint(n), blasint(k), 1.0f, a, blasint(lda), b, blasint(ldb), beta,
              c, blasint(ldc));
}
void cblas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, const double* a,
                int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, blasint(m), blasint(n), blasint(k), 1.0, a, blasint(lda), b, blasint(ldb), beta,
              c, blasint(ldc));
}

// c[M, N] (contiguous) = a[M, K] · b[K, N] + (accumulate ? c : 0), for T in {float, double}.
template <typename T>
void gemm(const Mat<T>& a, const Mat<T>& b, T* c, bool accumulate) {
  const int64_t M = a.rows, K = a.cols, N = b.cols;
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: BLAS implementations disagree on this corner, so do it here
    if (!accumulate) std::fill(c, c + M * N, T(0));
    return;
  }
  std::vector<T> abuf, bbuf;  // only used (allocated) when a layout needs packing
  BlasLayout la = blas_layout(a), lb = blas_layout(b);
  const Mat<T> ap = la.ok ? a : pack(a, abuf);
  const Mat<T> bp = lb.ok ? b : pack(b, bbuf);
  if (!la.ok) la = blas_layout(ap);
  if (!lb.ok) lb = blas_layout(bp);
  for (int64_t v : {M, N, K, la.ld, lb.ld})
    BLU_CHECK(v <= INT_MAX, "matmul: size ", v, " exceeds what this BLAS takes (", INT_MAX, ")");
  cblas_gemm(la.trans, lb.trans, M, N, K, ap.p, la.ld, bp.p, lb.ld, T(accumulate ? 1 : 0), c, N);
}

// The same for every floating scalar_t; the 16-bit types go through an fp32 product.
// `init` (optional, length N, stride init_stride) is added to every row of c (linear's bias).
// O is S, or float for a 16-bit S (the fp32 product stored unrounded). `resid` (optional,
// contiguous [M, N]) is added too, before the one rounding (linear's residual).
template <typename S, typename O = S>
void gemm_any(const Mat<S>& a, const Mat<S>& b, O* c, const S* init, int64_t init_stride, const S* resid = nullptr,
              bool into_c = false) {
  const int64_t M = a.rows, N = b.cols;
  using A = acc_t<S>;
  auto fill_rows = [&](A* dst) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        dst[i * N + j] = (init ? A(init[j * init_stride]) : A(0)) + (resid ? A(resid[i * N + j]) : A(0));
  };
  const bool accumulate = init || resid || into_c;  // into_c: c += a·b (c's own values the start)
  if constexpr (std::is_same_v<S, A>) {
    static_assert(std::is_same_v<O, S>, "fp32/f64 products are stored in their own dtype");
    if (accumulate && !into_c) fill_rows(c);
    gemm<S>(a, b, c, accumulate);
  } else {
    std::vector<float> abuf, bbuf, cbuf;
    const Mat<float> af = pack<float>(a, abuf), bf = pack<float>(b, bbuf);
    cbuf.resize(size_t(M * N));
    if (into_c) {
      for (int64_t i = 0; i < M * N; ++i) cbuf[size_t(i)] = float(c[i]);
    } else if (accumulate) {
      fill_rows(cbuf.data());
    }
    gemm<float>(af, bf, cbuf.data(), accumulate);
    for (int64_t i = 0; i < M * N; ++i) c[i] = O(cbuf[size_t(i)]);
  }
}

template <typename S>
Mat<S> last_two(const Tensor& t, int64_t offset) {
  const int64_t n = t.dim();
  return {static_cast<const S*>(t.raw_data()) + offset, t.shape()[n - 2], t.shape()[n - 1], t.strides()[n - 2],
          t.strides()[n - 1]};
}

// out[..., M, N] = a[..., M, K] · b[..., K, N], equal batch dims (any strides). One gemm per
// batch element, serially: OpenBLAS parallelises inside each.
void matmul_kernel(const KernelCall& c) {
  const Tensor &a = c.in[0], &b = c.in[1];
  Tensor& out = c.out[0];
  const int64_t nb = a.dim() - 2, M = out.shape()[nb], N = out.shape()[nb + 1];
  const Shape batch(out.shape().begin(), out.shape().begin() + nb);
  const int64_t nbatch = numel(batch);
  BLU_DISPATCH_FLOATING(a.dtype(), "matmul", {
    scalar_t* o = out.data<scalar_t>();
    for (int64_t bi = 0; bi < nbatch; ++bi) {
      int64_t oa = 0, ob = 0, rem = bi;
      for (int64_t d = nb - 1; d >= 0; --d) {
        const int64_t i = rem % batch[d];
        rem /= batch[d];
        oa += i * a.strides()[d];
        ob += i * b.strides()[d];
      }
      gemm_any<scalar_t>(last_two<scalar_t>(a, oa), last_two<scalar_t>(b, ob), o + bi * M * N, nullptr, 0);
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "matmul", matmul_kernel);

// out[R, out] = x[R, in] · w[out, in]ᵀ + bias (+ residual): w read transposed in place, bias and
// residual the initial value of the accumulation (beta = 1).
void linear_kernel(const KernelCall& c) {
  const Tensor &x = c.in[0], &w = c.in[1], &bias = c.in[2], &residual = c.in[3];
  BLU_DISPATCH_FLOATING(x.dtype(), "linear", {
    const scalar_t* wp = static_cast<const scalar_t*>(w.raw_data());
    const Mat<scalar_t> wt{wp, w.shape()[1], w.shape()[0], w.strides()[1], w.strides()[0]};
    const scalar_t* bp = bias.defined() ? static_cast<const scalar_t*>(bias.raw_data()) : nullptr;
    gemm_any<scalar_t>(last_two<scalar_t>(x, 0), wt, c.out[0].data<scalar_t>(), bp,
                       bias.defined() ? bias.strides()[0] : 0,
                       residual.defined() ? static_cast<const scalar_t*>(residual.raw_data()) : nullptr);
  });
}
BLU_REGISTER_KERNEL(cpu, "linear", linear_kernel);

// grad_w[out, in] = g[R, out]ᵀ · x[R, in] (g read transposed in place), grad_b[o] = Σ_r g[r, o]
// accumulated in double in row order and rounded once (as the CPU "sum" kernel does); each output
// in its own dtype: g's, or f32 for a 16-bit g (linear_weight_grad_into). gb may be undefined.
void weight_grads(const Tensor& g, const Tensor& x, Tensor& gw, Tensor* gb, bool accumulate = false) {
  BLU_DISPATCH_FLOATING(g.dtype(), "linear_weight_grad", {
    const scalar_t* gp = static_cast<const scalar_t*>(g.raw_data());
    const int64_t R = g.shape()[0], O = g.shape()[1], rs = g.strides()[0], cs = g.strides()[1];
    const Mat<scalar_t> gt{gp, O, R, cs, rs};
    if constexpr (sizeof(scalar_t) == 2) {
      if (gw.dtype() == DType::f32)
        gemm_any<scalar_t, float>(gt, last_two<scalar_t>(x, 0), gw.data<float>(), nullptr, 0, nullptr, accumulate);
      else gemm_any<scalar_t>(gt, last_two<scalar_t>(x, 0), gw.data<scalar_t>(), nullptr, 0, nullptr, accumulate);
    } else {
      gemm_any<scalar_t>(gt, last_two<scalar_t>(x, 0), gw.data<scalar_t>(), nullptr, 0, nullptr, accumulate);
    }
    if (gb) {
      std::vector<double> acc(size_t(O), 0.0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t o = 0; o < O; ++o) acc[size_t(o)] += double(gp[r * rs + o * cs]);
      for (int64_t o = 0; o < O; ++o) {
        if (gb->dtype() == g.dtype()) gb->data<scalar_t>()[o] = scalar_t(acc[size_t(o)]);
        else gb->data<float>()[o] = float(acc[size_t(o)]);
      }
    }
  });
}
void linear_weight_grad_kernel(const KernelCall& c) { weight_grads(c.in[0], c.in[1], c.out[0], &c.out[1]); }
// In place: (gw, g, x[, gb]).
void linear_weight_grad_into_kernel(const KernelCall& c) {
  Tensor gw = c.in[0], gb = c.in[3];
  weight_grads(c.in[1], c.in[2], gw, gb.defined() ? &gb : nullptr, c.attrs.has("accumulate"));
}
BLU_REGISTER_KERNEL(cpu, "linear_weight_grad_into", linear_weight_grad_into_kernel);
BLU_REGISTER_KERNEL(cpu, "linear_weight_grad", linear_weight_grad_kernel);

}  // namespace

}  // namespace blu::cpu
