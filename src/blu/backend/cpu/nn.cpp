// CPU kernels for ops/nn: softmax/log_softmax (+ backward), fused cross-entropy (+ backward),
// layer norm (+ backward), embedding gather and its deterministic scatter-add, Philox dropout.
// Row kernels read contiguous inputs (the op wrappers make them so); 16-bit types compute in
// f32 and row sums accumulate in double (a reference backend: accuracy over speed).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/fast_math.h"
#include "blu/backend/cpu/loops.h"
#include "blu/core/reduction.h"
#include "blu/core/rng.h"

namespace blu::cpu {

namespace {

template <typename T>
const T* cdata(const Tensor& t) {
  return static_cast<const T*>(t.raw_data());
}

// Threads for `rows` independent rows of `work` elements in all. (The loops below use _Pragma:
// a #pragma cannot sit inside the BLU_DISPATCH_* macro arguments.)
int row_threads(int64_t rows, int64_t work) { return rows > 1 && work >= 2 * kGrain ? omp_get_max_threads() : 1; }

// A contiguous tensor seen as [outer, n, inner] around `dim` (a 0-d tensor is [1, 1, 1]).
struct Rows {
  int64_t outer = 1, n = 1, inner = 1;
  Rows(const Shape& s, int64_t dim) {
    for (int64_t d = 0; d < int64_t(s.size()); ++d) (d < dim ? outer : d == dim ? n : inner) *= s[d];
  }
};

// --- softmax / log_softmax ---------------------------------------------------------------------

template <bool kLog>
void softmax_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous(), c.op, ": input must be contiguous");
  const Rows r(x.shape(), x.dim() == 0 ? 0 : c.attrs.i("dim"));
  BLU_DISPATCH_FLOATING(x.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    const scalar_t* xp = cdata<scalar_t>(x);
    scalar_t* yp = c.out[0].data<scalar_t>();
    const int nt = row_threads(r.outer * r.inner, x.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t row = 0; row < r.outer * r.inner; ++row) {
      const int64_t base = (row / r.inner) * r.n * r.inner + row % r.inner;
      A m = -std::numeric_limits<A>::infinity();
      for (int64_t k = 0; k < r.n; ++k) m = std::max(m, A(xp[base + k * r.inner]));
      double s = 0;
      if constexpr (std::is_same_v<A, float> && !kLog) {
        // float: e^(x - m) vectorised (backend/cpu/fast_math.h), summed in double in order (the
        // compiler's kernels sum the same way: a compiled step stays bitwise eager), then scaled.
        if (r.inner == 1) {
          scalar_t* yr = yp + base;
          const scalar_t* xr = xp + base;
          if constexpr (std::is_same_v<scalar_t, float>) {
            _Pragma("omp simd")
            for (int64_t k = 0; k < r.n; ++k) yr[k] = scalar_t(exp_arith(float(xr[k]) - m));
            for (int64_t k = 0; k < r.n; ++k) s += double(float(yr[k]));
            const float inv = float(1.0 / s);
            _Pragma("omp simd")
            for (int64_t k = 0; k < r.n; ++k) yr[k] = scalar_t(float(yr[k]) * inv);
          } else {
            for (int64_t k = 0; k < r.n; ++k) s += double(exp_arith(float(xr[k]) - m));
            const float inv = float(1.0 / s);
            for (int64_t k = 0; k < r.n; ++k) yr[k] = scalar_t(exp_arith(float(xr[k]) - m) * inv);
          }
          continue;
        }
      }
      for (int64_t k = 0; k < r.n; ++k) s += std::exp(double(A(xp[base + k * r.inner]) - m));
      if constexpr (kLog) {
        const A lse = m + A(std::log(s));
        for (int64_t k = 0; k < r.n; ++k) yp[base + k * r.inner] = scalar_t(A(xp[base + k * r.inner]) - lse);
      } else {
        const A inv = A(1.0 / s);
        for (int64_t k = 0; k < r.n; ++k)
          yp[base + k * r.inner] = scalar_t(std::exp(A(xp[base + k * r.inner]) - m) * inv);
      }
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "softmax", softmax_kernel<false>);
BLU_REGISTER_KERNEL(cpu, "log_softmax", softmax_kernel<true>);

// Inputs (g, y) contiguous. softmax: gx = y * (g - sum(g * y)); log_softmax: gx = g - exp(y) * sum(g).
template <bool kLog>
void softmax_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& y = c.in[1];
  BLU_ASSERT(g.is_contiguous() && y.is_contiguous(), c.op, ": inputs must be contiguous");
  const Rows r(y.shape(), y.dim() == 0 ? 0 : c.attrs.i("dim"));
  BLU_DISPATCH_FLOATING(y.dtype(), c.op, {
    using A = acc_t<scalar_t>;
    const scalar_t* gp = cdata<scalar_t>(g);
    const scalar_t* yp = cdata<scalar_t>(y);
    scalar_t* op = c.out[0].data<scalar_t>();
    const int nt = row_threads(r.outer * r.inner, y.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t row = 0; row < r.outer * r.inner; ++row) {
      const int64_t base = (row / r.inner) * r.n * r.inner + row % r.inner;
      double s = 0;
      for (int64_t k = 0; k < r.n; ++k) {
        const int64_t i = base + k * r.inner;
        s += kLog ? double(A(gp[i])) : double(A(gp[i])) * double(A(yp[i]));
      }
      const A sa = A(s);
      for (int64_t k = 0; k < r.n; ++k) {
        const int64_t i = base + k * r.inner;
        const A gv = A(gp[i]), yv = A(yp[i]);
        op[i] = scalar_t(kLog ? gv - std::exp(yv) * sa : yv * (gv - sa));
      }
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "softmax_backward", softmax_backward_kernel<false>);
BLU_REGISTER_KERNEL(cpu, "log_softmax_backward", softmax_backward_kernel<true>);

// --- cross_entropy -----------------------------------------------------------------------------

// Target ids as i64, checked against [0, classes) (ignore_index excepted); returns the count of
// rows that are not ignored.
template <typename I>
int64_t check_targets(const I* t, int64_t n, int64_t classes, int64_t ignore) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = int64_t(t[i]);
    if (v == ignore) continue;
    BLU_CHECK(v >= 0 && v < classes, "cross_entropy: target ", v, " at position ", i, " is out of range [0, ",
              classes, ") (ignore_index is ", ignore, ")");
    ++count;
  }
  return count;
}

// A shard of the classes (ops/nn.h, cross_entropy_shard): the K columns are the classes
// [offset, offset + K) of `vocab`; the targets index the whole vocabulary.
struct ClassShard {
  int64_t offset = 0, vocab = 0;
};
ClassShard class_shard(const Attrs& a, int64_t K) {
  return a.has("class_offset") ? ClassShard{a.i("class_offset"), a.i("vocab")} : ClassShard{0, K};
}

// Inputs (logits [N, C] or [C], target [N] or 0-d), contiguous; the classes are columns [0, K)
// (attr classes), or with attrs class_offset and vocab the classes [offset, offset + K) of a
// vocabulary: a row whose target lies outside them adds no loss. Outputs loss and lse [N] (the
// logsumexp over the K columns).
void cross_entropy_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  const Tensor& t = c.in[1];
  BLU_ASSERT(x.is_contiguous() && t.is_contiguous(), "cross_entropy: inputs must be contiguous");
  const int64_t C = x.shape().back(), N = x.numel() / C, K = c.attrs.i("classes");
  const int64_t ignore = c.attrs.i("ignore_index");
  const auto red = Reduction(c.attrs.i("reduction"));
  const ClassShard sh = class_shard(c.attrs, K);
  BLU_DISPATCH_INDEX(t.dtype(), "cross_entropy", {
    using I = scalar_t;
    const I* tp = cdata<I>(t);
    const int64_t count = check_targets(tp, N, sh.vocab, ignore);
    BLU_DISPATCH_FLOATING(x.dtype(), "cross_entropy", {
      using A = acc_t<scalar_t>;
      using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;  // stat dtype
      const scalar_t* xp = cdata<scalar_t>(x);
      S* lse = c.out[1].data<S>();
      std::vector<double> loss(static_cast<size_t>(N));
      const int nt = row_threads(N, x.numel());
      _Pragma("omp parallel for num_threads(nt) schedule(static)")
      for (int64_t n = 0; n < N; ++n) {
        const scalar_t* row = xp + n * C;
        A m = -std::numeric_limits<A>::infinity();
        for (int64_t k = 0; k < K; ++k) m = std::max(m, A(row[k]));
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += std::exp(double(A(row[k])) - double(m));
        const double l = double(m) + std::log(s);
        lse[n] = S(l);
        const int64_t tv = int64_t(tp[n]), k = tv - sh.offset;  // k outside [0, K): another shard's class
        loss[size_t(n)] = tv == ignore || k < 0 || k >= K ? 0.0 : l - double(A(row[k]));
      }
      S* out = c.out[0].data<S>();  // the loss in the statistics dtype (fp32 for 16-bit logits)
      if (red == Reduction::none) {
        for (int64_t n = 0; n < N; ++n) out[n] = S(loss[size_t(n)]);
      } else {
        const double total = std::accumulate(loss.begin(), loss.end(), 0.0);
        // mean over zero counted rows is 0/0 = NaN, as in PyTorch.
        out[0] = S(red == Reduction::sum ? total : total / double(count));
      }
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "cross_entropy", cross_entropy_kernel);

// gx[n, k] = (exp(x[n, k] - lse[n]) - [k + offset == t[n]]) * scale[n], scale = g[n] (none), g
// (sum) or g / count (mean), for k < K (attr classes; offset 0 unless class_offset); zero for
// ignored rows and for the columns k ≥ K that are not classes. gx may be x itself (each element is
// read before it is written).
void cross_entropy_backward_into(const Tensor& g, const Tensor& x, const Tensor& t, const Tensor& lse_t,
                                 const Attrs& attrs, const Tensor& gx) {
  const int64_t C = x.shape().back(), N = x.numel() / C, K = attrs.i("classes");
  const int64_t ignore = attrs.i("ignore_index");
  const auto red = Reduction(attrs.i("reduction"));
  const ClassShard sh = class_shard(attrs, K);
  BLU_DISPATCH_INDEX(t.dtype(), "cross_entropy_backward", {
    using I = scalar_t;
    const I* tp = cdata<I>(t);
    const int64_t count = check_targets(tp, N, sh.vocab, ignore);
    BLU_DISPATCH_FLOATING(x.dtype(), "cross_entropy_backward", {
      using A = acc_t<scalar_t>;
      using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      const scalar_t* xp = cdata<scalar_t>(x);
      const S* gp = cdata<S>(g);  // the loss's gradient: statistics dtype
      const S* lse = cdata<S>(lse_t);
      scalar_t* op = gx.data<scalar_t>();
      const int nt = row_threads(N, x.numel());
      _Pragma("omp parallel for num_threads(nt) schedule(static)")
      for (int64_t n = 0; n < N; ++n) {
        const int64_t tv = int64_t(tp[n]);
        scalar_t* orow = op + n * C;
        if (tv == ignore) {
          std::fill(orow, orow + C, scalar_t(A(0)));
          continue;
        }
        A scale = red == Reduction::none ? A(gp[n]) : A(gp[0]);
        if (red == Reduction::mean) scale = A(double(scale) / double(count));
        const scalar_t* row = xp + n * C;
        const A l = A(lse[n]);
        const int64_t hot = tv - sh.offset;  // outside [0, K): another shard's class, no one-hot term here
        for (int64_t k = 0; k < K; ++k) {
          const A p = std::exp(A(row[k]) - l);
          orow[k] = scalar_t((p - A(k == hot ? 1 : 0)) * scale);
        }
        std::fill(orow + K, orow + C, scalar_t(A(0)));
      }
    });
  });
}
// Inputs (g, logits, target, lse); out gx.
void cross_entropy_backward_kernel(const KernelCall& c) {
  cross_entropy_backward_into(c.in[0], c.in[1], c.in[2], c.in[3], c.attrs, c.out[0]);
}
BLU_REGISTER_KERNEL(cpu, "cross_entropy_backward", cross_entropy_backward_kernel);
// Inputs (logits, overwritten by gx; g, target, lse).
void cross_entropy_backward_inplace_kernel(const KernelCall& c) {
  cross_entropy_backward_into(c.in[1], c.in[0], c.in[2], c.in[3], c.attrs, c.in[0]);
}
BLU_REGISTER_KERNEL(cpu, "cross_entropy_backward_", cross_entropy_backward_inplace_kernel);

// --- layer_norm --------------------------------------------------------------------------------

// Inputs (x [R, C] contiguous, weight or undefined, bias or undefined); outputs y, mean, rstd.
void layer_norm_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous(), "layer_norm: input must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  const double eps = c.attrs.f("eps");
  BLU_DISPATCH_FLOATING(x.dtype(), "layer_norm", {
    using A = acc_t<scalar_t>;
    using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* xp = cdata<scalar_t>(x);
    const scalar_t* wp = c.in[1].defined() ? cdata<scalar_t>(c.in[1]) : nullptr;
    const scalar_t* bp = c.in[2].defined() ? cdata<scalar_t>(c.in[2]) : nullptr;
    const int64_t ws = wp ? c.in[1].stride(0) : 0, bs = bp ? c.in[2].stride(0) : 0;
    scalar_t* yp = c.out[0].data<scalar_t>();
    S* mp = c.out[1].data<S>();
    S* rp = c.out[2].data<S>();
    const int nt = row_threads(R, x.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t r = 0; r < R; ++r) {
      const scalar_t* row = xp + r * C;
      double s = 0;
      for (int64_t k = 0; k < C; ++k) s += double(A(row[k]));
      const double mean = s / double(C);
      double v = 0;
      for (int64_t k = 0; k < C; ++k) {
        const double d = double(A(row[k])) - mean;
        v += d * d;
      }
      const double rstd = 1.0 / std::sqrt(v / double(C) + eps);
      mp[r] = S(mean);
      rp[r] = S(rstd);
      const A ma = A(mean), ra = A(rstd);
      for (int64_t k = 0; k < C; ++k) {
        A y = (A(row[k]) - ma) * ra;
        if (wp) y = y * A(wp[k * ws]);
        if (bp) y = y + A(bp[k * bs]);
        yp[r * C + k] = scalar_t(y);
      }
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "layer_norm", layer_norm_kernel);

// Inputs (g, x, weight or undefined, mean, rstd[, pending]), g and x contiguous. With xh = (x -
// mean) * rstd and gh = g * w:  gx = rstd * (gh - mean(gh) - xh * mean(gh * xh)) [+ pending, after
// rounding];  gw = sum_rows g * xh;  gb = sum_rows g. The column sums run serially over rows in
// double (deterministic).
void layer_norm_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& x = c.in[1];
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous(), "layer_norm_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  BLU_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", {
    using A = acc_t<scalar_t>;
    using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* gp = cdata<scalar_t>(g);
    const scalar_t* xp = cdata<scalar_t>(x);
    const scalar_t* wp = c.in[2].defined() ? cdata<scalar_t>(c.in[2]) : nullptr;
    const int64_t ws = wp ? c.in[2].stride(0) : 0;
    const S* mp = cdata<S>(c.in[3]);
    const S* rp = cdata<S>(c.in[4]);
    const Tensor pending = c.optional_in(5);
    const scalar_t* pp = pending.defined() ? cdata<scalar_t>(pending) : nullptr;
    scalar_t* gxp = c.out[0].data<scalar_t>();
    const int nt = row_threads(R, x.numel());
    _Pragma("omp parallel for num_threads(nt) schedule(static)")
    for (int64_t r = 0; r < R; ++r) {
      const scalar_t* grow = gp + r * C;
      const scalar_t* xrow = xp + r * C;
      const double mean = double(mp[r]), rstd = double(rp[r]);
      double sg = 0, sgx = 0;
      for (int64_t k = 0; k < C; ++k) {
        const double gh = double(A(grow[k])) * (wp ? double(A(wp[k * ws])) : 1.0);
        sg += gh;
        sgx += gh * (double(A(xrow[k])) - mean) * rstd;
      }
      sg /= double(C);
      sgx /= double(C);
      for (int64_t k = 0; k < C; ++k) {
        const double xh = (double(A(xrow[k])) - mean) * rstd;
        const double gh = double(A(grow[k])) * (wp ? double(A(wp[k * ws])) : 1.0);
        const scalar_t gx = scalar_t(A(rstd * (gh - sg - xh * sgx)));
        gxp[r * C + k] = pp ? scalar_t(A(gx) + A(pp[r * C + k])) : gx;  // as add(pending, gx) rounds
      }
    }
    std::vector<double> gw(size_t(C), 0.0), gb(size_t(C), 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const double mean = double(mp[r]), rstd = double(rp[r]);
      for (int64_t k = 0; k < C; ++k) {
        const double gv = double(A(gp[r * C + k]));
        gw[size_t(k)] += gv * (double(A(xp[r * C + k])) - mean) * rstd;
        gb[size_t(k)] += gv;
      }
    }
    auto store = [&](Tensor& out, const std::vector<double>& v) {  // in x's dtype, or f32 (param_dtype)
      for (int64_t k = 0; k < C; ++k) {
        if (out.dtype() == DType::f32) out.data<float>()[k] = float(v[size_t(k)]);
        else out.data<scalar_t>()[k] = scalar_t(A(v[size_t(k)]));
      }
    };
    store(c.out[1], gw);
    store(c.out[2], gb);
  });
}
BLU_REGISTER_KERNEL(cpu, "layer_norm_backward", layer_norm_backward_kernel);

// --- embedding ---------------------------------------------------------------------------------

template <typename I>
void check_indices(const I* idx, int64_t n, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i)
    BLU_CHECK(idx[i] >= 0 && int64_t(idx[i]) < vocab, "embedding: index ", int64_t(idx[i]), " at position ", i,
              " is out of range for a weight of ", vocab, " rows (valid: [0, ", vocab, "))");
}

// Inputs (weight [V, C] any strides, indices contiguous); out[i, :] = weight[indices[i], :].
void embedding_kernel(const KernelCall& c) {
  const Tensor& w = c.in[0];
  const Tensor& idx = c.in[1];
  BLU_ASSERT(idx.is_contiguous(), "embedding: indices must be contiguous");
  const int64_t V = w.shape()[0], C = w.shape()[1], M = idx.numel();
  const int64_t s0 = w.stride(0), s1 = w.stride(1);
  BLU_DISPATCH_INDEX(idx.dtype(), "embedding", {
    using I = scalar_t;
    const I* ip = cdata<I>(idx);
    check_indices(ip, M, V);
    BLU_DISPATCH_FLOATING(w.dtype(), "embedding", {
      const scalar_t* wp = cdata<scalar_t>(w);
      scalar_t* op = c.out[0].data<scalar_t>();
      const int nt = row_threads(M, M * C);
      _Pragma("omp parallel for num_threads(nt) schedule(static)")
      for (int64_t i = 0; i < M; ++i) {
        const scalar_t* src = wp + int64_t(ip[i]) * s0;
        for (int64_t k = 0; k < C; ++k) op[i * C + k] = src[k * s1];
      }
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "embedding", embedding_kernel);

// out [V, C] = sum of g's rows per index (g [M, C] contiguous, indices [M]), or with `accumulate`
// out[v] += scale · that sum (rows no index names untouched). Sort-based: positions are stably
// sorted by index, then each distinct index sums its rows in order in the accumulation type and
// writes once — deterministic for any thread count, one rounding per row.
// first_row >= 0: out is the window of rows [first_row, first_row + V) of a larger table, and
// indices outside it are skipped (-1: the whole table, indices checked).
void embedding_backward_rows(const Tensor& g, const Tensor& idx, const Tensor& out, bool accumulate, double scale,
                             int64_t first_row = -1) {
  BLU_ASSERT(g.is_contiguous() && idx.is_contiguous(), "embedding_backward: inputs must be contiguous");
  const int64_t V = out.shape()[0], C = out.shape()[1], M = idx.numel();
  const int64_t base = std::max<int64_t>(first_row, 0);
  BLU_DISPATCH_INDEX(idx.dtype(), "embedding_backward", {
    using I = scalar_t;
    const I* ip = cdata<I>(idx);
    if (first_row < 0) check_indices(ip, M, V);
    std::vector<int64_t> order;  // the positions whose index is in the window
    for (int64_t j = 0; j < M; ++j)
      if (int64_t(ip[j]) >= base && int64_t(ip[j]) < base + V) order.push_back(j);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[a] < ip[b]; });
    const int64_t n = int64_t(order.size());
    std::vector<int64_t> starts;  // first position in `order` of each distinct index
    for (int64_t j = 0; j < n; ++j)
      if (j == 0 || ip[order[size_t(j)]] != ip[order[size_t(j - 1)]]) starts.push_back(j);
    starts.push_back(n);
    const int64_t groups = int64_t(starts.size()) - 1;
    BLU_DISPATCH_FLOATING(out.dtype(), "embedding_backward", {
      using A = acc_t<scalar_t>;
      const scalar_t* gp = cdata<scalar_t>(g);
      scalar_t* op = out.data<scalar_t>();
      if (!accumulate) std::fill(op, op + out.numel(), scalar_t(A(0)));
      const int nt = row_threads(groups, M * C);
      _Pragma("omp parallel num_threads(nt)")
      {
        std::vector<A> acc(static_cast<size_t>(C));
        _Pragma("omp for schedule(static)")
        for (int64_t q = 0; q < groups; ++q) {
          std::fill(acc.begin(), acc.end(), A(0));
          for (int64_t j = starts[size_t(q)]; j < starts[size_t(q + 1)]; ++j) {
            const scalar_t* src = gp + order[size_t(j)] * C;
            for (int64_t k = 0; k < C; ++k) acc[size_t(k)] += A(src[k]);
          }
          scalar_t* dst = op + (int64_t(ip[order[size_t(starts[size_t(q)])]]) - base) * C;
          if (accumulate) {
            for (int64_t k = 0; k < C; ++k) dst[k] = scalar_t(A(dst[k]) + A(scale) * acc[size_t(k)]);
          } else {
            for (int64_t k = 0; k < C; ++k) dst[k] = scalar_t(acc[size_t(k)]);
          }
        }
      }
    });
  });
}

void embedding_backward_kernel(const KernelCall& c) { embedding_backward_rows(c.in[0], c.in[1], c.out[0], false, 1.0); }
BLU_REGISTER_KERNEL(cpu, "embedding_backward", embedding_backward_kernel);

// Inputs (grad_weight, written; g [M, C]; indices [M]); attrs scale, first_row.
void embedding_backward_add_kernel(const KernelCall& c) {
  embedding_backward_rows(c.in[1], c.in[2], c.in[0], true, c.attrs.f("scale"), c.attrs.i("first_row"));
}
BLU_REGISTER_KERNEL(cpu, "embedding_backward_add_", embedding_backward_add_kernel);

// --- dropout -----------------------------------------------------------------------------------

// out[i] = keep(i) ? in[i] / (1 - p) : 0 with keep(i) = uniform(seed, offset + i/4, lane i%4) >= p,
// i the row-major index (so the mask does not depend on the input's layout). Used for the forward
// (in = x) and the backward (in = grad) alike. p == 1 drops everything.
void dropout_kernel(const KernelCall& c) {
  const Tensor& in = c.in[0];
  Tensor& out = c.out[0];
  const double p = c.attrs.f("p");
  const uint64_t seed = uint64_t(c.attrs.i("seed")), offset = uint64_t(c.attrs.i("offset"));
  const float pf = float(p);
  BLU_DISPATCH_FLOATING(out.dtype(), "dropout", {
    using A = acc_t<scalar_t>;
    const A scale = p < 1 ? A(1.0 / (1.0 - p)) : A(0);
    const scalar_t* ip = cdata<scalar_t>(in);
    scalar_t* op = out.data<scalar_t>();
    std::array<Shape, 2> strides{out.strides(), in.strides()};
    strided_loop(out.shape(), strides, [&](int64_t i, const std::array<int64_t, 2>& off) {
      const auto r = Philox::block(seed, offset + uint64_t(i) / 4);
      const bool keep = Philox::uniform(r[size_t(i % 4)]) >= pf;
      op[off[0]] = keep ? scalar_t(A(ip[off[1]]) * scale) : scalar_t(A(0));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "dropout", dropout_kernel);

}  // namespace

}  // namespace blu::cpu
