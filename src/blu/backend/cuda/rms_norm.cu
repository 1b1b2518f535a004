// CUDA kernels for ops/norm_rotary, part 1: rms_norm and rms_norm_backward, with the CPU kernel's
// semantics (backend/cpu/norm_rotary.cpp): inputs (x [R, C] contiguous, weight [C] contiguous or
// undefined), attr eps; outputs y and rstd [R] (f32; f64 for f64 inputs). The backward gives
// grad_x and grad_weight (in x's dtype, or f32 under attr param_dtype: Note [Wide gradients]).
// Fast path (f32/bf16/f16, C a multiple of one 16-byte vector of V elements, at most 2048 vectors,
// 16-byte aligned operands): a group of TPR threads owns a row and keeps it in registers — thread
// t holds vectors t, t + TPR, … (NV of them) — so the forward reads x once and the backward reads
// g and x once. TPR is 32 (one warp, four rows to a 128-thread block) for rows of up to 256
// vectors, else 128 or 256 (one row to a block, the warps' sums added through shared memory).
// In the backward each thread adds g·x̂ into per-column sums in shared memory that it alone
// touches (stored thread-minor, so a warp hits 32 banks), across the rows its group visits; the
// block then adds its groups' sums in group order into one partial row of grad_weight, and a last
// kernel sums the partial rows of each column in block order, in double. The grid depends only
// on R and C, so reruns are bit-identical; no atomics.
// General path (f64, other widths): one warp per row, row sums in fp32 (f64 for f64), grad_weight
// from 32-column tiles over chunks of rows into per-chunk partials, then the same last kernel.
#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

namespace {

__device__ __forceinline__ float rsqrt_acc(float v) { return 1.f / sqrtf(v); }
__device__ __forceinline__ double rsqrt_acc(double v) { return 1.0 / sqrt(v); }

// --- general path ---
constexpr int kRowsPerBlock = 8;  // warps per block, one row each
constexpr int kChunkRows = 256;   // rows per partial sum of the weight gradient

template <typename T>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, int64_t R, int64_t C,
                                        double eps, T* __restrict__ y, acc_of<T>* __restrict__ rstd_out) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;  // whole warps leave together: no block barrier below
  const T* xr = x + row * C;
  A ss = 0;
  for (int64_t k = lane; k < C; k += 32) {
    const A v = to_acc(xr[k]);
    ss += v * v;
  }
  const A rstd = rsqrt_acc(warp_sum(ss) / A(C) + A(eps));
  if (lane == 0) rstd_out[row] = rstd;
  T* yr = y + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    A o = to_acc(xr[k]) * rstd;
    if (w) o = o * to_acc(w[k]);
    yr[k] = from_acc<T>(o);
  }
}

// gx = rstd·(gh − x̂·mean(gh·x̂)) [+ pending], gh = g·w, x̂ = x·rstd.
template <typename T>
__global__ void rms_norm_grad_x_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                                       const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                       const T* __restrict__ pending, T* __restrict__ gx) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;
  const T* gr = g + row * C;
  const T* xr = x + row * C;
  const A rstd = rstd_in[row];
  A sgx = 0;
  for (int64_t k = lane; k < C; k += 32) sgx += to_acc(gr[k]) * (w ? to_acc(w[k]) : A(1)) * to_acc(xr[k]) * rstd;
  sgx = warp_sum(sgx) / A(C);
  T* out = gx + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    const A xh = to_acc(xr[k]) * rstd;
    const A gh = to_acc(gr[k]) * (w ? to_acc(w[k]) : A(1));
    const T v = from_acc<T>(rstd * (gh - xh * sgx));
    out[k] = pending ? add_pending(v, pending[row * C + k]) : v;
  }
}

// Block (32, 8) over columns [32·bx, 32·bx + 32) and rows [kChunkRows·by, …): thread (tx, ty) sums
// rows ty, ty + 8, … of its column; the 8 sums are added in ty order. partial[by, col] = Σ g·x̂.
template <typename T>
__global__ void rms_norm_grad_w_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                               const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                               acc_of<T>* __restrict__ partial) {
  using A = acc_of<T>;
  __shared__ A s[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kChunkRows;
  const int64_t r1 = min(R, r0 + kChunkRows);
  A acc = 0;
  if (col < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_acc(g[r * C + col]) * to_acc(x[r * C + col]) * rstd_in[r];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    A t = 0;
    for (int i = 0; i < 8; ++i) t += s[i][threadIdx.x];
    partial[int64_t(blockIdx.y) * C + col] = t;
  }
}

// grad_weight (out[1], in T or f32 under param_dtype f32) from `chunks` partial rows: their column
// sums in double (column_sums_final, colsum.cuh).
template <typename T>
void rms_norm_grad_w_final(const KernelCall& c, const acc_of<T>* partial, int64_t chunks, int64_t C, int threads_y) {
  cudaStream_t s = stream_of(c.ctx);
  if (c.out[1].dtype() == DType::f32 && !std::is_same_v<T, float>)
    column_sums_final(ColumnSums<acc_of<T>, float, 1>{{partial}, {static_cast<float*>(c.out[1].raw_data())}}, chunks,
                      C, threads_y, s);
  else
    column_sums_final(ColumnSums<acc_of<T>, T, 1>{{partial}, {static_cast<T*>(c.out[1].raw_data())}}, chunks, C,
                      threads_y, s);
}

// --- fast path ---
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte vector

template <typename T>
struct alignas(16) Vec16 {
  T v[kVec<T>];
};

// Threads per block for TPR threads per row: four one-warp rows, or one row.
template <int TPR>
constexpr int kBlockOf = TPR == 32 ? 128 : TPR;
constexpr int kMaxVecsPerThread = 8;
// Partial rows of the weight gradient: 512 beat 1024, 384 and 256 (H200, llama-250m B=8: the
// step's 33 backwards 0.94 → 0.80 ms; fewer partial rows to write and to sum).
constexpr int kFastMaxBlocks = 512;

// Thread t's NV vectors of a row (vectors past C / V are zeros, never stored).
template <typename T, int NV, int TPR>
__device__ __forceinline__ void load_row(const T* row, int nvec, int t, float (&out)[NV][kVec<T>]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = t + TPR * j;
    if (vi < nvec) {
      const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(row)[vi];
#pragma unroll
      for (int e = 0; e < kVec<T>; ++e) out[j][e] = float(to_acc(v.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < kVec<T>; ++e) out[j][e] = 0.f;
    }
  }
}

// Sum over the TPR threads of a row: a warp sum, and for TPR > 32 (one row per block) the warps'
// sums added in warp order through `red` (TPR / 32 floats) — every thread gets the same value.
// For TPR > 32 every thread of the block must call it.
template <int TPR>
__device__ __forceinline__ float row_sum(float v, float* red) {
  v = warp_sum(v);
  if constexpr (TPR == 32) {
    return v;
  } else {
    __syncthreads();  // `red` may still be read from the previous row
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < TPR / 32; ++i) t += red[i];
    return t;
  }
}

template <typename T, int NV, int TPR>
__global__ void __launch_bounds__(kBlockOf<TPR>) rms_norm_forward_vec_kernel(const T* __restrict__ x,
                                                                             const T* __restrict__ w, int64_t R, int C,
                                                                             float eps, T* __restrict__ y,
                                                                             float* __restrict__ rstd_out) {
  constexpr int V = kVec<T>, RPB = kBlockOf<TPR> / TPR;
  __shared__ float red[TPR / 32];
  const int t = threadIdx.x % TPR, nvec = C / V;
  const int64_t row = int64_t(blockIdx.x) * RPB + threadIdx.x / TPR;
  if (row >= R) return;  // only with TPR == 32 (RPB > 1): whole warps, no block barrier
  float xv[NV][V];
  load_row<T, NV, TPR>(x + row * C, nvec, t, xv);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) ss += xv[j][e] * xv[j][e];
  const float rstd = 1.f / sqrtf(row_sum<TPR>(ss, red) / float(C) + eps);
  if (t == 0) rstd_out[row] = rstd;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = t + TPR * j;
    if (vi >= nvec) continue;
    Vec16<T> wv, o;
    if (w) wv = reinterpret_cast<const Vec16<T>*>(w)[vi];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float r = xv[j][e] * rstd;
      if (w) r = r * float(to_acc(wv.v[e]));
      o.v[e] = from_acc<T>(r);
    }
    reinterpret_cast<Vec16<T>*>(y + row * C)[vi] = o;
  }
}

// grad_x per row (as rms_norm_grad_x_kernel) and this block's partial column sums of g·x̂, written
// to partial[blockIdx.x][C]. Shared memory: [RPB][S] column sums (S = NV·V·TPR; element e of
// thread t's vector j at (j·V + e)·TPR + t), then TPR / 32 floats for row_sum.
template <typename T, int NV, int TPR>
__global__ void __launch_bounds__(kBlockOf<TPR>) rms_norm_backward_vec_kernel(
    const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ rstd_in,
    int64_t R, int C, const T* __restrict__ pending, T* __restrict__ gx, float* __restrict__ partial) {
  constexpr int V = kVec<T>, RPB = kBlockOf<TPR> / TPR, S = NV * V * TPR;
  extern __shared__ float smem[];
  const int t = threadIdx.x % TPR, group = threadIdx.x / TPR, nvec = C / V;
  float* sw = smem + group * S;
  float* red = smem + RPB * S;
  for (int i = t; i < S; i += TPR) sw[i] = 0.f;  // thread t's own entries (i ≡ t mod TPR)
  Vec16<T> wv[NV];  // the weight, packed: the same for every row
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = t + TPR * j;
#pragma unroll
    for (int e = 0; e < V; ++e) wv[j].v[e] = from_acc<T>(1.f);
    if (w && vi < nvec) wv[j] = reinterpret_cast<const Vec16<T>*>(w)[vi];
  }
  // With TPR > 32 the block is one group, so every thread runs the same rows (row_sum's barrier).
  for (int64_t row = int64_t(blockIdx.x) * RPB + group; row < R; row += int64_t(gridDim.x) * RPB) {
    float gv[NV][V], xh[NV][V];
    load_row<T, NV, TPR>(g + row * C, nvec, t, gv);
    load_row<T, NV, TPR>(x + row * C, nvec, t, xh);
    const float rstd = rstd_in[row];
    float sgx = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xh[j][e] = xh[j][e] * rstd;
        sgx += gv[j][e] * float(to_acc(wv[j].v[e])) * xh[j][e];  // padding: g = 0
      }
    sgx = row_sum<TPR>(sgx, red) / float(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = t + TPR * j;
      if (vi >= nvec) continue;
      Vec16<T> o, pv;
      if (pending) pv = reinterpret_cast<const Vec16<T>*>(pending + row * C)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float gh = gv[j][e] * float(to_acc(wv[j].v[e]));
        o.v[e] = from_acc<T>(rstd * (gh - xh[j][e] * sgx));
        if (pending) o.v[e] = add_pending(o.v[e], pv.v[e]);
        sw[(j * V + e) * TPR + t] += gv[j][e] * xh[j][e];
      }
      reinterpret_cast<Vec16<T>*>(gx + row * C)[vi] = o;
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < C; col += blockDim.x) {
    const int vi = col / V, idx = ((vi / TPR) * V + col % V) * TPR + vi % TPR;
    float tw = 0.f;
    for (int k = 0; k < RPB; ++k) tw += smem[k * S + idx];
    partial[int64_t(blockIdx.x) * C + col] = tw;
  }
}

// The fast path's shape for C columns of T: threads per row and vectors per thread (TPR 0: the
// fast path does not apply). The fewest threads that need at most 8 vectors each, the vectors
// rounded up to 2, 4 or 8 — so the shapes are 32x2, 32x4, 32x8 (up to 256 vectors), 128x4,
// 128x8 (up to 1024) and 256x8 (up to 2048): 2048 bf16/f16 or 1024 f32 columns in one warp,
// 16384 or 8192 in a block of 256.
struct FastShape {
  int tpr = 0, nv = 0;
};
template <typename T>
FastShape fast_shape(int64_t C) {
  if constexpr (sizeof(T) == 8) {
    return {};
  } else {
    if (C % kVec<T> != 0) return {};
    const int64_t nvec = C / kVec<T>;
    for (int tpr : {32, 128, 256}) {
      const int64_t nv = (nvec + tpr - 1) / tpr;
      if (nv <= kMaxVecsPerThread) return {tpr, nv <= 2 ? 2 : nv <= 4 ? 4 : 8};
    }
    return {};
  }
}

#define BLU_RMS_SHAPES(shape, ...)                                                 \
  switch (shape.tpr * 16 + shape.nv) {                                             \
    case 32 * 16 + 2: { constexpr int TPR = 32, NV = 2; __VA_ARGS__; break; }      \
    case 32 * 16 + 4: { constexpr int TPR = 32, NV = 4; __VA_ARGS__; break; }      \
    case 32 * 16 + 8: { constexpr int TPR = 32, NV = 8; __VA_ARGS__; break; }      \
    case 128 * 16 + 4: { constexpr int TPR = 128, NV = 4; __VA_ARGS__; break; }    \
    case 128 * 16 + 8: { constexpr int TPR = 128, NV = 8; __VA_ARGS__; break; }    \
    case 256 * 16 + 8: { constexpr int TPR = 256, NV = 8; __VA_ARGS__; break; }    \
    default: BLU_ASSERT(false, "rms_norm: fast shape ", shape.tpr, "x", shape.nv); \
  }

template <typename T>
const T* opt_ptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// Contiguous and 16-byte aligned (undefined operands pass).
bool fast_operands(std::initializer_list<Tensor> ts) {
  for (const Tensor& t : ts)
    if (t.defined() && (!t.is_contiguous() || reinterpret_cast<uintptr_t>(t.raw_data()) % 16 != 0)) return false;
  return true;
}

// The fast path when it applies (see the header); false: use the general kernels.
template <typename T>
bool rms_norm_forward_fast(const KernelCall& c, int64_t R, int64_t C, double eps) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    const FastShape fs = fast_shape<T>(C);
    if (fs.tpr == 0 || !fast_operands({c.in[0], c.in[1], c.out[0]})) return false;
    BLU_RMS_SHAPES(fs, {
      constexpr int RPB = kBlockOf<TPR> / TPR;
      rms_norm_forward_vec_kernel<T, NV, TPR><<<unsigned((R + RPB - 1) / RPB), kBlockOf<TPR>, 0, stream_of(c.ctx)>>>(
          static_cast<const T*>(c.in[0].raw_data()), opt_ptr<T>(c.in[1]), R, int(C), float(eps),
          static_cast<T*>(c.out[0].raw_data()), static_cast<float*>(c.out[1].raw_data()));
    });
    BLU_CUDA_CHECK_LAUNCH();
    return true;
  }
}

template <typename T>
bool rms_norm_backward_fast(const KernelCall& c, int64_t R, int64_t C) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    const FastShape fs = fast_shape<T>(C);
    const Tensor pending = c.optional_in(4);
    if (R == 0 || fs.tpr == 0 || !fast_operands({c.in[0], c.in[1], c.in[2], c.out[0], pending})) return false;
    cudaStream_t s = stream_of(c.ctx);
    // Blocks: a function of R and C alone (reruns and other GPUs sum alike).
    const int block = fs.tpr == 32 ? kBlockOf<32> : fs.tpr, rpb = block / fs.tpr;
    const int64_t nb = std::min<int64_t>((R + rpb - 1) / rpb, kFastMaxBlocks);
    Scratch partial(c.ctx, size_t(nb * C) * sizeof(float));
    BLU_RMS_SHAPES(fs, {
      const size_t smem = (size_t(kBlockOf<TPR>) * NV * kVec<T> + TPR / 32) * sizeof(float);  // ≤ 64 KiB + 32 B
      if (smem > (48u << 10))  // past the default: opt in (cheap; per device)
        BLU_CUDA_CHECK(cudaFuncSetAttribute(rms_norm_backward_vec_kernel<T, NV, TPR>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      rms_norm_backward_vec_kernel<T, NV, TPR><<<unsigned(nb), kBlockOf<TPR>, smem, s>>>(
          static_cast<const T*>(c.in[0].raw_data()), static_cast<const T*>(c.in[1].raw_data()), opt_ptr<T>(c.in[2]),
          static_cast<const float*>(c.in[3].raw_data()), R, int(C), opt_ptr<T>(pending),
          static_cast<T*>(c.out[0].raw_data()), partial.as<float>());
    });
    BLU_CUDA_CHECK_LAUNCH();
    rms_norm_grad_w_final<T>(c, partial.as<float>(), nb, C, 32);
    return true;
  }
}

void rms_norm_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous() && (!c.in[1].defined() || c.in[1].is_contiguous()),
             "rms_norm: operands must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (R == 0) return;
  const double eps = c.attrs.f("eps");
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "rms_norm", {
    using A = acc_of<scalar_t>;
    if (rms_norm_forward_fast<scalar_t>(c, R, C, eps)) return;
    rms_norm_forward_kernel<scalar_t>
        <<<unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0, stream_of(c.ctx)>>>(
            static_cast<const scalar_t*>(x.raw_data()), opt_ptr<scalar_t>(c.in[1]), R, C, eps,
            static_cast<scalar_t*>(c.out[0].raw_data()), static_cast<A*>(c.out[1].raw_data()));
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "rms_norm", rms_norm_kernel);

// Inputs (g, x, weight or undefined, rstd[, pending]); outputs grad_x (+ pending), grad_weight.
void rms_norm_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& x = c.in[1];
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous() && c.in[3].is_contiguous() &&
                 (!c.in[2].defined() || c.in[2].is_contiguous()),
             "rms_norm_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (C == 0) return;
  cudaStream_t s = stream_of(c.ctx);
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "rms_norm_backward", {
    using A = acc_of<scalar_t>;
    if (rms_norm_backward_fast<scalar_t>(c, R, C)) return;
    const auto* gp = static_cast<const scalar_t*>(g.raw_data());
    const auto* xp = static_cast<const scalar_t*>(x.raw_data());
    const A* rp = static_cast<const A*>(c.in[3].raw_data());
    if (R > 0) {
      rms_norm_grad_x_kernel<scalar_t><<<unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                         s>>>(gp, xp, opt_ptr<scalar_t>(c.in[2]), rp, R, C,
                                              opt_ptr<scalar_t>(c.optional_in(4)),
                                              static_cast<scalar_t*>(c.out[0].raw_data()));
      BLU_CUDA_CHECK_LAUNCH();
    }
    const int64_t chunks = std::max<int64_t>((R + kChunkRows - 1) / kChunkRows, 1);
    BLU_CHECK(chunks <= 65535, "rms_norm_backward: ", R, " rows exceed the grid's ", 65535 * kChunkRows);
    Scratch partial(c.ctx, size_t(chunks * C) * sizeof(A));
    rms_norm_grad_w_partial_kernel<scalar_t>
        <<<dim3(unsigned((C + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, s>>>(gp, xp, rp, R, C, partial.as<A>());
    BLU_CUDA_CHECK_LAUNCH();
    rms_norm_grad_w_final<scalar_t>(c, partial.as<A>(), chunks, C, 8);
  });
}
BLU_REGISTER_KERNEL(cuda, "rms_norm_backward", rms_norm_backward_kernel);

}  // namespace

}  // namespace blu::cuda
