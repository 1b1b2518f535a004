// CUDA kernels for ops/nn, part 1: softmax / log_softmax and their backward ops, and the fused
// cross-entropy (log-softmax + NLL) with its backward. Semantics as the CPU kernels in
// backend/cpu/nn.cpp: same attrs, same outputs (cross_entropy: the loss and the per-row
// logsumexp), 16-bit types computed in float, statistics in f32 (f64 for f64 inputs).
// Row kernels: one block per row, 16-byte vector loads where the row is aligned; the
// cross-entropy forward makes one pass over the vocabulary with an online (max, sum) pair.
// Differences from the CPU, stated: row sums are fp32 (the CPU sums in double), and a target
// outside [0, C) cannot be reported without a host synchronisation, so its row's loss (and
// gradient) is NaN instead of an error.
// Reductions over rows (mean/sum) run in a second single-block kernel in a fixed order, in double:
// results are bit-identical run to run.
#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"
#include "blu/core/reduction.h"

#include <type_traits>

namespace blu::cuda {

namespace {

// 16 bytes of T: the unit of a vector load.
template <typename T>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};
template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
__device__ __forceinline__ float log_acc(float v) { return logf(v); }
__device__ __forceinline__ double log_acc(double v) { return log(v); }

int row_threads(int64_t n) { return n >= 4096 ? 512 : n >= 512 ? 256 : n >= 128 ? 128 : 32; }

// --- softmax / log_softmax -------------------------------------------------------------------

// Rows along the last dim (inner == 1): one block per row.
template <typename T, bool kLog>
__global__ void softmax_rows_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  using A = acc_of<T>;
  __shared__ A shared[32];
  const T* xr = x + int64_t(blockIdx.x) * n;
  T* yr = y + int64_t(blockIdx.x) * n;
  A m = A(-INFINITY);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) m = max(m, to_acc(xr[k]));
  m = block_max(m, shared);
  A s = 0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s += exp_acc(to_acc(xr[k]) - m);
  s = block_sum(s, shared);
  if constexpr (kLog) {
    const A lse = m + log_acc(s);
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) yr[k] = from_acc<T>(to_acc(xr[k]) - lse);
  } else {
    const A inv = A(1) / s;
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) yr[k] = from_acc<T>(exp_acc(to_acc(xr[k]) - m) * inv);
  }
}

// Any other dim: one thread per (outer, inner) column, walking n with stride inner (coalesced
// across the threads of a warp, which hold neighbouring inner indices).
template <typename T, bool kLog>
__global__ void softmax_cols_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t outer, int64_t n,
                                    int64_t inner) {
  using A = acc_of<T>;
  for (int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; col < outer * inner;
       col += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * n * inner + col % inner;
    A m = A(-INFINITY);
    for (int64_t k = 0; k < n; ++k) m = max(m, to_acc(x[base + k * inner]));
    A s = 0;
    for (int64_t k = 0; k < n; ++k) s += exp_acc(to_acc(x[base + k * inner]) - m);
    if constexpr (kLog) {
      const A lse = m + log_acc(s);
      for (int64_t k = 0; k < n; ++k) y[base + k * inner] = from_acc<T>(to_acc(x[base + k * inner]) - lse);
    } else {
      const A inv = A(1) / s;
      for (int64_t k = 0; k < n; ++k)
        y[base + k * inner] = from_acc<T>(exp_acc(to_acc(x[base + k * inner]) - m) * inv);
    }
  }
}

// softmax: gx = y * (g - Σ g·y); log_softmax: gx = g - exp(y) * Σ g.
template <typename T, bool kLog>
__global__ void softmax_backward_rows_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ gx,
                                             int64_t n) {
  using A = acc_of<T>;
  __shared__ A shared[32];
  const int64_t base = int64_t(blockIdx.x) * n;
  A s = 0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
    s += kLog ? to_acc(g[base + k]) : to_acc(g[base + k]) * to_acc(y[base + k]);
  s = block_sum(s, shared);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const A gv = to_acc(g[base + k]), yv = to_acc(y[base + k]);
    gx[base + k] = from_acc<T>(kLog ? gv - exp_acc(yv) * s : yv * (gv - s));
  }
}
template <typename T, bool kLog>
__global__ void softmax_backward_cols_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ gx,
                                             int64_t outer, int64_t n, int64_t inner) {
  using A = acc_of<T>;
  for (int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; col < outer * inner;
       col += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * n * inner + col % inner;
    A s = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = base + k * inner;
      s += kLog ? to_acc(g[i]) : to_acc(g[i]) * to_acc(y[i]);
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = base + k * inner;
      const A gv = to_acc(g[i]), yv = to_acc(y[i]);
      gx[i] = from_acc<T>(kLog ? gv - exp_acc(yv) * s : yv * (gv - s));
    }
  }
}

// A contiguous tensor seen as [outer, n, inner] around `dim` (a 0-d tensor is [1, 1, 1]).
struct Rows {
  int64_t outer = 1, n = 1, inner = 1;
  Rows(const Shape& s, int64_t dim) {
    for (int64_t d = 0; d < int64_t(s.size()); ++d) (d < dim ? outer : d == dim ? n : inner) *= s[size_t(d)];
  }
};

template <bool kLog>
void softmax_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous(), c.op, ": input must be contiguous");
  const Rows r(x.shape(), x.dim() == 0 ? 0 : c.attrs.i("dim"));
  if (x.numel() == 0) return;
  cudaStream_t s = stream_of(c.ctx);
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), c.op, {
    const auto* xp = static_cast<const scalar_t*>(x.raw_data());
    auto* yp = static_cast<scalar_t*>(c.out[0].raw_data());
    if (r.inner == 1) {
      softmax_rows_kernel<scalar_t, kLog><<<unsigned(r.outer), row_threads(r.n), 0, s>>>(xp, yp, r.n);
    } else {
      softmax_cols_kernel<scalar_t, kLog><<<grid_for(r.outer * r.inner), 256, 0, s>>>(xp, yp, r.outer, r.n, r.inner);
    }
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "softmax", softmax_kernel<false>);
BLU_REGISTER_KERNEL(cuda, "log_softmax", softmax_kernel<true>);

template <bool kLog>
void softmax_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& y = c.in[1];
  BLU_ASSERT(g.is_contiguous() && y.is_contiguous(), c.op, ": inputs must be contiguous");
  const Rows r(y.shape(), y.dim() == 0 ? 0 : c.attrs.i("dim"));
  if (y.numel() == 0) return;
  cudaStream_t s = stream_of(c.ctx);
  BLU_CUDA_DISPATCH_FLOATING(y.dtype(), c.op, {
    const auto* gp = static_cast<const scalar_t*>(g.raw_data());
    const auto* yp = static_cast<const scalar_t*>(y.raw_data());
    auto* op = static_cast<scalar_t*>(c.out[0].raw_data());
    if (r.inner == 1) {
      softmax_backward_rows_kernel<scalar_t, kLog><<<unsigned(r.outer), row_threads(r.n), 0, s>>>(gp, yp, op, r.n);
    } else {
      softmax_backward_cols_kernel<scalar_t, kLog>
          <<<grid_for(r.outer * r.inner), 256, 0, s>>>(gp, yp, op, r.outer, r.n, r.inner);
    }
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "softmax_backward", softmax_backward_kernel<false>);
BLU_REGISTER_KERNEL(cuda, "log_softmax_backward", softmax_backward_kernel<true>);

// --- cross_entropy ---------------------------------------------------------------------------

// The online (max, sum of exp(x - max)) pair and its merge; -inf maxima merge without NaNs.
template <typename A>
struct MaxSum {
  A m, s;
};
template <typename A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  const A m = max(a.m, b.m);
  if (m == A(-INFINITY)) return {m, a.s + b.s};
  return {m, a.s * exp_acc(a.m - m) + b.s * exp_acc(b.m - m)};
}
template <typename A>
__device__ __forceinline__ MaxSum<A> block_merge(MaxSum<A> v, A* sm, A* ss) {
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, MaxSum<A>{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    sm[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  v = lane < nwarps ? MaxSum<A>{sm[lane], ss[lane]} : MaxSum<A>{A(-INFINITY), A(0)};
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, MaxSum<A>{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

// Note [Loss rows' exp]
// The logsumexp of a row of bf16 logits is bound by its exp, not by memory: expf is a range
// reduction and a polynomial around the SFU's ex2, ~10 instructions for 2 bytes read (GPT-2's
// 16384 x 50304 rows: 476 us with expf, 384 us as below, H200; scripts/lab/cross_entropy_reread.cu).
// In the vector loop, exp(v - m) is 2^(v*log2 e - m*log2 e): one FMA and exp2f (the SFU's ex2,
// 2 ulp), what Triton's exp is. The shift m*log2 e is rounded once per vector, so a thread's
// terms share one relative error of at most |m| * 2^-24: lse moves by ~1e-7 relative (7.8e-8 on
// GPT-2's rows), below the fp32 tolerances the op is tested against. The gradient's kernel keeps
// expf: it is bound by its bytes, and the same change there measured nothing
// (scripts/lab/fast_exp_16bit_outputs.patch).
constexpr float kLog2e = 1.4426950408889634f;

// One block per row of C columns whose first K are classes [off, off + K) of a vocabulary of
// `vocab` (off 0, vocab K unless the op runs on a shard of the classes): lse[n] =
// logsumexp(x[n, :K]); row_loss[n] = lse - x[n, t - off] (0 when ignored or when t is another
// shard's class, NaN when t is outside [0, vocab)). One pass over the K classes, 16-byte loads
// when the row is aligned.
template <typename T, typename I>
__global__ void cross_entropy_rows_kernel(const T* __restrict__ x, const I* __restrict__ target, int64_t C,
                                          int64_t K, int64_t off, int64_t vocab, int64_t ignore,
                                          acc_of<T>* __restrict__ lse, acc_of<T>* __restrict__ loss) {
  using A = acc_of<T>;
  __shared__ A sm[32], ss[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  MaxSum<A> acc{A(-INFINITY), A(0)};
  auto add = [&](A v) {
    if (v == A(-INFINITY)) return;  // exp(-inf) adds nothing (and -inf - -inf would be NaN)
    if (v > acc.m) {
      acc.s = acc.s * exp_acc(acc.m - v) + A(1);
      acc.m = v;
    } else {
      acc.s += exp_acc(v - acc.m);
    }
  };
  int64_t k0 = 0;
  if (aligned16(xr)) {
    constexpr int V = Vec<T>::kN;
    const int64_t nv = K / V;
    const Vec<T>* xv = reinterpret_cast<const Vec<T>*>(xr);
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
      const Vec<T> p = xv[j];
      A vals[V];
      A vmax = to_acc(p.v[0]);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        vals[i] = to_acc(p.v[i]);
        vmax = max(vmax, vals[i]);
      }
      if (vmax > acc.m) {  // rescale once per vector
        acc.s = acc.m == A(-INFINITY) ? A(0) : acc.s * exp_acc(acc.m - vmax);
        acc.m = vmax;
      }
      if (acc.m != A(-INFINITY)) {
        if constexpr (std::is_same_v<A, float>) {
          // Note [Loss rows' exp]
          const float ml = acc.m * kLog2e;
#pragma unroll
          for (int i = 0; i < V; ++i) acc.s += exp2f(fmaf(vals[i], kLog2e, -ml));
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) acc.s += exp_acc(vals[i] - acc.m);
        }
      }
    }
    k0 = nv * V;
  }
  for (int64_t k = k0 + threadIdx.x; k < K; k += blockDim.x) add(to_acc(xr[k]));
  acc = block_merge(acc, sm, ss);
  if (threadIdx.x == 0) {
    const A l = acc.m + log_acc(acc.s);
    lse[row] = l;
    const int64_t t = int64_t(target[row]);
    A lo;
    if (t == ignore) lo = A(0);
    else if (t < 0 || t >= vocab) lo = A(NAN);
    else if (t < off || t >= off + K) lo = A(0);
    else lo = l - to_acc(xr[t - off]);
    loss[row] = lo;
  }
}

// reduction none: out[n] = loss[n]; sum/mean: one block sums in double in a fixed order (and
// counts the rows that are not ignored for the mean; 0/0 = NaN as in PyTorch).
template <typename T, typename A>
__global__ void cross_entropy_none_kernel(const A* loss, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_acc<T>(loss[i]);
}
template <typename T, typename A, typename I>
__global__ void cross_entropy_reduce_kernel(const A* loss, const I* target, int64_t n, int64_t ignore, bool mean,
                                            T* out) {
  __shared__ double shared[32];
  double s = 0, cnt = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    s += double(loss[i]);
    cnt += int64_t(target[i]) == ignore ? 0.0 : 1.0;
  }
  s = block_sum(s, shared);
  cnt = block_sum(cnt, shared);
  if (threadIdx.x == 0) out[0] = from_acc<T>(acc_of<T>(mean ? s / cnt : s));
}

// The number of rows whose target is not ignored, as a double in count[0] (exact below 2^53).
template <typename I>
__global__ void count_targets_kernel(const I* target, int64_t n, int64_t ignore, double* count) {
  __shared__ double shared[32];
  double cnt = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) cnt += int64_t(target[i]) == ignore ? 0.0 : 1.0;
  cnt = block_sum(cnt, shared);
  if (threadIdx.x == 0) count[0] = cnt;
}

// gx[n, k] = (exp(x[n, k] - lse[n]) - [k + off == t[n]]) * scale for the classes k < K, scale = g[n]
// (none), g[0] (sum) or g[0] / count (mean); zero rows where t is ignored and zero columns k ≥ K
// (not classes: the padded columns are written, never left as they were). One block per row of
// C columns, vector loads and stores. gx may be x (Note [Donated buffers]): each element is read
// and then written by the same thread, so x and gx are not __restrict__.
template <typename T, typename I>
__global__ void cross_entropy_backward_kernel(const acc_of<T>* __restrict__ g, const T* x,
                                              const I* __restrict__ target, const acc_of<T>* __restrict__ lse,
                                              const double* count, int red, int64_t C, int64_t K, int64_t off,
                                              int64_t vocab, int64_t ignore, T* gx) {
  using A = acc_of<T>;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  T* gr = gx + row * C;
  const int64_t t0 = int64_t(target[row]);
  const bool ignored = t0 == ignore;
  const int64_t t = t0 - off;  // outside [0, K): another shard's class, no one-hot term here
  A scale = A(0);
  if (!ignored) {
    scale = red == int(Reduction::none) ? g[row] : g[0];
    if (red == int(Reduction::mean)) scale = A(double(scale) / count[0]);
    if (t0 < 0 || t0 >= vocab) scale = A(NAN);
  }
  const A l = lse[row];
  int64_t k0 = 0;
  if (aligned16(xr) && aligned16(gr)) {
    constexpr int V = Vec<T>::kN;
    const int64_t nv = C / V;
    const Vec<T>* xv = reinterpret_cast<const Vec<T>*>(xr);
    Vec<T>* gv = reinterpret_cast<Vec<T>*>(gr);
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
      Vec<T> o;
      if (ignored || j * V >= K) {
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = from_acc<T>(A(0));
      } else {
        const Vec<T> p = xv[j];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int64_t k = j * V + i;
          o.v[i] = k < K ? from_acc<T>((exp_acc(to_acc(p.v[i]) - l) - A(k == t ? 1 : 0)) * scale) : from_acc<T>(A(0));
        }
      }
      gv[j] = o;
    }
    k0 = nv * V;
  }
  for (int64_t k = k0 + threadIdx.x; k < C; k += blockDim.x)
    gr[k] = ignored || k >= K ? from_acc<T>(A(0))
                              : from_acc<T>((exp_acc(to_acc(xr[k]) - l) - A(k == t ? 1 : 0)) * scale);
}

void cross_entropy_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  const Tensor& t = c.in[1];
  BLU_ASSERT(x.is_contiguous() && t.is_contiguous(), "cross_entropy: inputs must be contiguous");
  const int64_t C = x.shape().back(), N = x.numel() / C, K = c.attrs.i("classes");
  const int64_t ignore = c.attrs.i("ignore_index");
  const auto red = Reduction(c.attrs.i("reduction"));
  const int64_t off = c.attrs.has("class_offset") ? c.attrs.i("class_offset") : 0;
  const int64_t vocab = c.attrs.has("class_offset") ? c.attrs.i("vocab") : K;
  cudaStream_t s = stream_of(c.ctx);
  BLU_CUDA_DISPATCH_INDEX(t.dtype(), "cross_entropy", {
    using I = scalar_t;
    const I* tp = static_cast<const I*>(t.raw_data());
    BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "cross_entropy", {
      using A = acc_of<scalar_t>;
      A* out = static_cast<A*>(c.out[0].raw_data());  // the loss: statistics dtype (fp32 for 16-bit)
      A* lse = static_cast<A*>(c.out[1].raw_data());
      Scratch loss(c.ctx, size_t(std::max<int64_t>(N, 1)) * sizeof(A));
      if (N > 0) {
        cross_entropy_rows_kernel<scalar_t, I><<<unsigned(N), 256, 0, s>>>(
            static_cast<const scalar_t*>(x.raw_data()), tp, C, K, off, vocab, ignore, lse, loss.as<A>());
        BLU_CUDA_CHECK_LAUNCH();
      }
      if (red == Reduction::none) {
        if (N > 0) {
          cross_entropy_none_kernel<A, A><<<grid_for(N), 256, 0, s>>>(loss.as<A>(), out, N);
          BLU_CUDA_CHECK_LAUNCH();
        }
      } else {
        cross_entropy_reduce_kernel<A, A, I>
            <<<1, 1024, 0, s>>>(loss.as<A>(), tp, N, ignore, red == Reduction::mean, out);
        BLU_CUDA_CHECK_LAUNCH();
      }
    });
  });
}
BLU_REGISTER_KERNEL(cuda, "cross_entropy", cross_entropy_kernel);

void cross_entropy_backward_into(const ExecContext& ctx, const Tensor& g, const Tensor& x, const Tensor& t,
                                 const Tensor& lse_t, const Attrs& attrs, const Tensor& gx) {
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous() && t.is_contiguous() && lse_t.is_contiguous(),
             "cross_entropy_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), N = x.numel() / C, K = attrs.i("classes");
  if (N == 0) return;
  const int64_t ignore = attrs.i("ignore_index");
  const auto red = Reduction(attrs.i("reduction"));
  const int64_t off = attrs.has("class_offset") ? attrs.i("class_offset") : 0;
  const int64_t vocab = attrs.has("class_offset") ? attrs.i("vocab") : K;
  cudaStream_t s = stream_of(ctx);
  BLU_CUDA_DISPATCH_INDEX(t.dtype(), "cross_entropy_backward", {
    using I = scalar_t;
    const I* tp = static_cast<const I*>(t.raw_data());
    Scratch count(ctx, sizeof(double));
    if (red == Reduction::mean) {
      count_targets_kernel<I><<<1, 1024, 0, s>>>(tp, N, ignore, count.as<double>());
      BLU_CUDA_CHECK_LAUNCH();
    }
    BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "cross_entropy_backward", {
      using A = acc_of<scalar_t>;
      cross_entropy_backward_kernel<scalar_t, I><<<unsigned(N), 256, 0, s>>>(
          static_cast<const A*>(g.raw_data()), static_cast<const scalar_t*>(x.raw_data()), tp,
          static_cast<const A*>(lse_t.raw_data()), count.as<double>(), int(red), C, K, off, vocab, ignore,
          static_cast<scalar_t*>(gx.raw_data()));
      BLU_CUDA_CHECK_LAUNCH();
    });
  });
}
// Inputs (g, logits, target, lse); out gx.
void cross_entropy_backward_kernel_entry(const KernelCall& c) {
  cross_entropy_backward_into(c.ctx, c.in[0], c.in[1], c.in[2], c.in[3], c.attrs, c.out[0]);
}
BLU_REGISTER_KERNEL(cuda, "cross_entropy_backward", cross_entropy_backward_kernel_entry);
// Inputs (logits, overwritten by gx; g, target, lse).
void cross_entropy_backward_inplace_entry(const KernelCall& c) {
  cross_entropy_backward_into(c.ctx, c.in[1], c.in[0], c.in[2], c.in[3], c.attrs, c.in[0]);
}
BLU_REGISTER_KERNEL(cuda, "cross_entropy_backward_", cross_entropy_backward_inplace_entry);

}  // namespace

}  // namespace blu::cuda
