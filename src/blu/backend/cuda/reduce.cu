// CUDA kernels for ops/reduce: sum over any set of dims, max_dim/min_dim (values and i64
// indices) and scatter_dim (max/min's backward).
// Plan: the input's dims split into kept and reduced groups, each coalesced; an output index maps
// to a base offset through the kept group, a reduced index to an offset through the reduced one.
//   rows: the reduced elements of an output are contiguous (e.g. over the last dim) → a block per
//         output, threads stride over them, a shared-memory tree combines the threads' states;
//   cols: the outputs are contiguous and the reduced dims are not (e.g. a bias gradient, sum over
//         dim 0) → a block per 32 outputs, 16 lanes per output stride over the reduced elements;
//         many outputs over a few rows (sum_leading_rows) → a thread per 16 bytes of outputs.
// Few outputs over many elements split the reduced range: pass 1 writes one partial per
// (output, split), pass 2 sums each output's partials as a row.
// Every order is fixed by the shapes alone (never by timing or the device's SM count), so sums
// are deterministic. Floating sums accumulate in float (double for f64; the CPU reference uses
// double throughout, so f32 sums agree to rounding, not bit for bit), integer sums in i64.
// max/min: NaN wins, ties keep the first index (the combine is associative, so any tree gives
// the CPU's answer).
#include "blu/backend/cuda/loops.cuh"
#include "blu/memory/allocator.h"

namespace blu::cuda {

namespace {

template <typename T>
__device__ __forceinline__ bool is_nan_(T x) {
  if constexpr (std::is_floating_point_v<T>) return isnan(x);
  else return false;
}

template <typename Acc>
struct SumReducer {
  using State = Acc;
  __device__ State init() const { return Acc(0); }
  template <typename T>
  __device__ State visit(State s, T x, int64_t) const { return s + Acc(to_acc(x)); }
  __device__ State combine(State a, State b) const { return a + b; }
};

template <typename A, bool kMax>
struct ExtremeReducer {
  struct State {
    A v;
    int64_t i;  // -1: nothing seen
  };
  __device__ State init() const { return State{A(0), -1}; }
  template <typename T>
  __device__ State visit(State s, T x, int64_t r) const { return combine(s, State{A(to_acc(x)), r}); }
  __device__ State combine(State a, State b) const {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    const bool an = is_nan_(a.v), bn = is_nan_(b.v);
    if (an || bn) return an && bn ? (a.i < b.i ? a : b) : (an ? a : b);
    if (kMax ? b.v > a.v : b.v < a.v) return b;
    if (kMax ? a.v > b.v : a.v < b.v) return a;
    return a.i < b.i ? a : b;
  }
};

// Writers: task t is (output t / splits, split t % splits).
template <typename Out>
struct FinalWriter {
  Out* out;
  template <typename S>
  __device__ void operator()(int64_t t, S s) const { out[t] = from_acc<Out>(s); }
};
template <typename S>
struct PartialWriter {
  S* ws;
  __device__ void operator()(int64_t t, S s) const { ws[t] = s; }
};
template <typename T, typename S>
struct ExtremeWriter {
  T* vals;
  int64_t* idx;
  __device__ void operator()(int64_t t, S s) const {
    vals[t] = from_acc<T>(s.v);
    idx[t] = s.i;
  }
};

struct ReduceArgs {
  Indexer<1> kept, red;
  int64_t nout, nred, splits, chunk;
};

__device__ __forceinline__ int64_t offset_of(const Indexer<1>& ix, int64_t i) {
  int64_t off[1];
  ix.offsets(i, off);
  return off[0];
}

// blockDim.x a power of two; one task per block iteration.
template <typename R, typename T, typename W>
__global__ void reduce_rows_kernel(const T* __restrict__ in, ReduceArgs a, R op, W write) {
  using S = typename R::State;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S* sm = reinterpret_cast<S*>(smem_raw);
  const int64_t tasks = a.nout * a.splits;
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    const int64_t o = t / a.splits, s = t % a.splits;
    const int64_t base = offset_of(a.kept, o);
    const int64_t r0 = s * a.chunk, r1 = r0 + a.chunk < a.nred ? r0 + a.chunk : a.nred;
    S st = op.init();
    for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) st = op.visit(st, in[base + offset_of(a.red, r)], r);
    sm[threadIdx.x] = st;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) sm[threadIdx.x] = op.combine(sm[threadIdx.x], sm[threadIdx.x + w]);
      __syncthreads();
    }
    if (threadIdx.x == 0) write(t, sm[0]);
    __syncthreads();
  }
}

constexpr int kColsX = 32, kColsY = 16;

// blockDim (32, 16): x picks the output in a tile of 32 consecutive outputs, y the lane.
template <typename R, typename T, typename W>
__global__ void reduce_cols_kernel(const T* __restrict__ in, ReduceArgs a, R op, W write) {
  using S = typename R::State;
  __shared__ S sm[kColsY][kColsX];
  const int64_t tiles = (a.nout + kColsX - 1) / kColsX, tasks = tiles * a.splits;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t t = blockIdx.x; t < tasks; t += gridDim.x) {
    const int64_t tile = t / a.splits, s = t % a.splits;
    const int64_t o = tile * kColsX + tx;
    S st = op.init();
    if (o < a.nout) {
      const int64_t base = offset_of(a.kept, o);
      const int64_t r0 = s * a.chunk, r1 = r0 + a.chunk < a.nred ? r0 + a.chunk : a.nred;
      for (int64_t r = r0 + ty; r < r1; r += kColsY) st = op.visit(st, in[base + offset_of(a.red, r)], r);
    }
    sm[ty][tx] = st;
    __syncthreads();
    for (int w = kColsY / 2; w > 0; w >>= 1) {
      if (ty < w) sm[ty][tx] = op.combine(sm[ty][tx], sm[ty + w][tx]);
      __syncthreads();
    }
    if (ty == 0 && o < a.nout) write(o * a.splits + s, sm[0][tx]);
    __syncthreads();
  }
}

// Sums of many contiguous outputs over a few rows (a position embedding's gradient: Σ over the
// batch of [B, T·C]): a thread per V outputs adds its rows in order with 16-byte loads. The cols
// kernel gives each output 16 lanes for a handful of rows and moves 2-byte elements: GPT-2's
// [16, 786,432] bf16 takes 140 µs there, 14 µs here (H200).
constexpr int64_t kLeadingRowsMax = 64, kLeadingMinVectors = 8192;
template <typename T, typename Acc, typename Out, int V>
__global__ void sum_leading_rows_kernel(const T* __restrict__ in, int64_t nvec, int64_t nred, int64_t row_stride,
                                        Out* __restrict__ out) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += step) {
    Acc s[V];
#pragma unroll
    for (int e = 0; e < V; ++e) s[e] = Acc(0);
    const T* p = in + i * V;
#pragma unroll 4
    for (int64_t r = 0; r < nred; ++r) {
      const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(p + r * row_stride);
#pragma unroll
      for (int e = 0; e < V; ++e) s[e] += Acc(to_acc(v.v[e]));
    }
#pragma unroll
    for (int e = 0; e < V; ++e) out[i * V + e] = from_acc<Out>(s[e]);
  }
}

struct ReducePlan {
  Coalesced kept, red;  // innermost first, one operand (the input)
  int64_t nout = 1, nred = 1;
  bool cols = false;
  int64_t splits = 1;
};

ReducePlan plan_reduce(const Tensor& in, const std::vector<bool>& reduced) {
  Shape ks, kst, rs, rst;
  for (int64_t d = 0; d < in.dim(); ++d) {
    (reduced[d] ? rs : ks).push_back(in.shape()[d]);
    (reduced[d] ? rst : kst).push_back(in.strides()[d]);
  }
  ReducePlan p;
  p.kept = coalesce(ks, {kst});
  p.red = coalesce(rs, {rst});
  p.nout = numel(ks);
  p.nred = numel(rs);
  const bool red_inner_contig = !p.red.size.empty() && p.red.stride[0][0] == 1;
  const bool kept_inner_contig = !p.kept.size.empty() && p.kept.stride[0][0] == 1;
  p.cols = kept_inner_contig && !red_inner_contig;
  // Splits from the shapes only (determinism): enough tasks to fill the GPU, big enough pieces.
  constexpr int64_t kTargetTasks = 512;
  if (p.cols) {
    const int64_t tiles = (p.nout + kColsX - 1) / kColsX;
    p.splits = std::max<int64_t>(1, std::min((kTargetTasks + tiles - 1) / tiles, (p.nred + 1023) / 1024));
  } else {
    p.splits = std::max<int64_t>(1, std::min((kTargetTasks + p.nout - 1) / p.nout, (p.nred + 4095) / 4096));
  }
  return p;
}

ReduceArgs make_args(const Coalesced& kept, const Coalesced& red, int64_t nout, int64_t nred, int64_t splits) {
  ReduceArgs a;
  a.kept = make_indexer<1>(kept, nout);
  a.red = make_indexer<1>(red, nred);
  a.nout = nout;
  a.nred = nred;
  a.splits = splits;
  a.chunk = (nred + splits - 1) / splits;
  return a;
}

template <typename R, typename T, typename W>
void launch_reduce(cudaStream_t stream, const T* in, const ReduceArgs& a, bool cols, R op, W write) {
  using S = typename R::State;
  const int64_t cap = int64_t(sm_count()) * 32;
  if (cols) {
    const int64_t tasks = (a.nout + kColsX - 1) / kColsX * a.splits;
    reduce_cols_kernel<R, T, W><<<unsigned(std::min(tasks, cap)), dim3(kColsX, kColsY), 0, stream>>>(in, a, op, write);
  } else {
    int threads = 32;
    while (threads < 256 && threads < a.chunk) threads *= 2;
    const int64_t tasks = a.nout * a.splits;
    reduce_rows_kernel<R, T, W><<<unsigned(std::min(tasks, cap)), threads, threads * sizeof(S), stream>>>(in, a, op, write);
  }
  BLU_CUDA_CHECK_LAUNCH();
}

std::vector<bool> mask_of(const Tensor& t, const Shape& dims) {
  std::vector<bool> m(size_t(t.dim()), false);
  for (int64_t d : dims) m[d] = true;
  return m;
}

template <typename T, typename Acc, typename Out>
void sum_impl(const ExecContext& ctx, const Tensor& in, const std::vector<bool>& mask, const Tensor& out) {
  const cudaStream_t stream = stream_of(ctx);
  const ReducePlan p = plan_reduce(in, mask);
  if (p.nout == 0) return;
  Out* optr = static_cast<Out*>(out.raw_data());
  if (p.nred == 0) {
    BLU_CUDA_CHECK(cudaMemsetAsync(optr, 0, size_t(p.nout) * sizeof(Out), stream));
    return;
  }
  const T* iptr = static_cast<const T*>(in.raw_data());
  if constexpr (std::is_floating_point_v<Acc>) {
    constexpr int V = 16 / int(sizeof(T));
    if (p.cols && p.kept.size.size() == 1 && p.red.size.size() == 1 && p.nred <= kLeadingRowsMax &&
        p.nout % V == 0 && p.nout / V >= kLeadingMinVectors && p.red.stride[0][0] % V == 0 && aligned_to(iptr, 16)) {
      const int64_t nvec = p.nout / V;
      sum_leading_rows_kernel<T, Acc, Out, V><<<blocks_for(nvec), 256, 0, stream>>>(iptr, nvec, p.nred,
                                                                                   p.red.stride[0][0], optr);
      BLU_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  const SumReducer<Acc> op;
  if (p.splits == 1) {
    launch_reduce(stream, iptr, make_args(p.kept, p.red, p.nout, p.nred, 1), p.cols, op, FinalWriter<Out>{optr});
    return;
  }
  // Pass 1: partials [nout, splits] (in the call's workspace); pass 2: each output's partials
  // summed as a row.
  Acc* wptr = ctx.scratch->take<Acc>(size_t(p.nout * p.splits));
  launch_reduce(stream, iptr, make_args(p.kept, p.red, p.nout, p.nred, p.splits), p.cols, op, PartialWriter<Acc>{wptr});
  Coalesced kept2{{p.nout}, {{p.splits}}}, red2{{p.splits}, {{1}}};
  launch_reduce(stream, static_cast<const Acc*>(wptr), make_args(kept2, red2, p.nout, p.splits, 1), false, op,
                FinalWriter<Out>{optr});
}

void sum_kernel(const KernelCall& c) {
  const Tensor& in = c.in[0];
  const auto mask = mask_of(in, c.attrs.get<Shape>("dims"));
  BLU_DISPATCH_ALL(in.dtype(), "sum", {
    using T = dev_t<scalar_t>;
    if constexpr (std::is_same_v<scalar_t, double>) sum_impl<T, double, T>(c.ctx, in, mask, c.out[0]);
    else if constexpr (std::is_floating_point_v<acc_t<T>>) sum_impl<T, float, T>(c.ctx, in, mask, c.out[0]);
    else sum_impl<T, int64_t, int64_t>(c.ctx, in, mask, c.out[0]);
  });
}
BLU_REGISTER_KERNEL(cuda, "sum", sum_kernel);

template <bool kMax>
void extreme_kernel(const KernelCall& c) {
  const Tensor& in = c.in[0];
  std::vector<bool> mask(size_t(in.dim()), false);
  if (in.dim() > 0) mask[c.attrs.i("dim")] = true;  // 0-d: one output, one element
  const ReducePlan p = plan_reduce(in, mask);
  if (p.nout == 0) return;
  BLU_ASSERT(p.nred > 0, "max/min over an empty dim");
  const ReduceArgs a = make_args(p.kept, p.red, p.nout, p.nred, 1);
  BLU_DISPATCH_ALL(in.dtype(), kMax ? "max_dim" : "min_dim", {
    using T = dev_t<scalar_t>;
    using R = ExtremeReducer<acc_t<T>, kMax>;
    launch_reduce(stream_of(c.ctx), static_cast<const T*>(in.raw_data()), a, p.cols, R{},
                  ExtremeWriter<T, typename R::State>{static_cast<T*>(c.out[0].raw_data()),
                                                      static_cast<int64_t*>(c.out[1].raw_data())});
  });
}
BLU_REGISTER_KERNEL(cuda, "max_dim", extreme_kernel<true>);
BLU_REGISTER_KERNEL(cuda, "min_dim", extreme_kernel<false>);

// out = zeros(shape); out[..., idx[...], ...] = g along dim. Walks g's positions; the output
// offset is g's position with the coordinate along dim replaced by the index (operand 0 is the
// output with stride 0 along dim). Like the CPU kernel, the value goes through float
// (scalar_t(0.0f + float(g))), f64 included. Indices out of range are skipped.
template <typename T>
__global__ void scatter_dim_kernel(int64_t n, T* out, const T* g, const int64_t* idx, int64_t dim_stride,
                                   int64_t dim_size, Indexer<3> ix) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[3];
    ix.offsets(i, off);
    const int64_t k = idx[off[2]];
    if (k < 0 || k >= dim_size) continue;
    out[off[0] + k * dim_stride] = from_acc<T>(0.0f + float(to_acc(g[off[1]])));
  }
}

void scatter_dim(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& idx = c.in[1];
  const Tensor& out = c.out[0];
  const int64_t dim = c.attrs.i("dim");
  BLU_CHECK(idx.dtype() == DType::i64, "scatter_dim: indices must be i64, got ", idx.dtype());
  cudaStream_t stream = stream_of(c.ctx);
  BLU_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), stream));
  const int64_t n = g.numel();
  if (n == 0) return;
  Shape ostr = out.strides();
  const int64_t dim_stride = ostr[dim], dim_size = out.shape()[dim];
  ostr[dim] = 0;
  const Coalesced co = coalesce(g.shape(), {ostr, g.strides(), broadcast_strides(idx, g.shape())});
  const auto ix = make_indexer<3>(co, n);
  BLU_DISPATCH_FLOATING(out.dtype(), "scatter_dim", {
    using T = dev_t<scalar_t>;
    scatter_dim_kernel<T><<<blocks_for(n), 256, 0, stream>>>(n, static_cast<T*>(out.raw_data()),
                                                            static_cast<const T*>(g.raw_data()),
                                                            static_cast<const int64_t*>(idx.raw_data()),
                                                            dim_stride, dim_size, ix);
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "scatter_dim", scatter_dim);

}  // namespace

}  // namespace blu::cuda
