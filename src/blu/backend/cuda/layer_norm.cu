// CUDA kernels for ops/nn, part 2: layer_norm and layer_norm_backward, with the CPU kernel's
// semantics (backend/cpu/nn.cpp): inputs (x [R, C] contiguous, weight or undefined, bias or
// undefined), attr eps; outputs y, mean [R], rstd [R] (f32; f64 for f64 inputs).
// Fast path (fp32/bf16/f16 with C a multiple of one 16-byte vector and at most 2048 columns,
// contiguous weight and bias): a warp owns a row and keeps it in registers — lane l holds the
// 16-byte vectors l, l + 32, … — so the forward reads x once (mean, then the variance around it,
// from registers) and the backward reads g and x once: grad_x from the two row sums, and each
// lane adds g·x̂ and g into per-column accumulators it keeps across the rows its warp visits.
// A block's 8 warps then add their accumulators into shared memory one warp after another, the
// block writes one partial row for grad_weight and grad_bias, and a last kernel sums the
// partials of each column in block order, in double. The grid size depends only on R, so
// reruns are bit-identical.
// General path (f64, other widths): one warp per row (8 rows per 256-thread block), row sums in
// fp32 (f64 for f64; the CPU uses double), mean and variance in two passes (the second pass
// reads L1); grad_weight and grad_bias from a kernel that sums 32-column tiles over chunks of
// rows into per-chunk partials, then the same last kernel. No atomics anywhere.
#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each
constexpr int kChunkRows = 256;   // rows per partial sum of the weight gradients

__device__ __forceinline__ float sqrt_acc(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_acc(double v) { return sqrt(v); }

template <typename T>
__global__ void layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, int64_t ws,
                                          const T* __restrict__ b, int64_t bs, int64_t R, int64_t C, double eps,
                                          T* __restrict__ y, acc_of<T>* __restrict__ mean_out,
                                          acc_of<T>* __restrict__ rstd_out) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;  // whole warps leave together: no block barrier below
  const T* xr = x + row * C;
  A s = 0;
  for (int64_t k = lane; k < C; k += 32) s += to_acc(xr[k]);
  const A mean = warp_sum(s) / A(C);
  A v = 0;
  for (int64_t k = lane; k < C; k += 32) {
    const A d = to_acc(xr[k]) - mean;
    v += d * d;
  }
  const A rstd = A(1) / sqrt_acc(warp_sum(v) / A(C) + A(eps));
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  T* yr = y + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    A o = (to_acc(xr[k]) - mean) * rstd;
    if (w) o = o * to_acc(w[k * ws]);
    if (b) o = o + to_acc(b[k * bs]);
    yr[k] = from_acc<T>(o);
  }
}

// gx = rstd * (gh - mean(gh) - xh * mean(gh * xh)) [+ pending], gh = g * w, xh = (x - mean) * rstd.
template <typename T>
__global__ void layer_norm_grad_x_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                                         int64_t ws, const acc_of<T>* __restrict__ mean_in,
                                         const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                         const T* __restrict__ pending, T* __restrict__ gx) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;
  const T* gr = g + row * C;
  const T* xr = x + row * C;
  const A mean = mean_in[row], rstd = rstd_in[row];
  A sg = 0, sgx = 0;
  for (int64_t k = lane; k < C; k += 32) {
    const A gh = to_acc(gr[k]) * (w ? to_acc(w[k * ws]) : A(1));
    sg += gh;
    sgx += gh * (to_acc(xr[k]) - mean) * rstd;
  }
  sg = warp_sum(sg) / A(C);
  sgx = warp_sum(sgx) / A(C);
  T* out = gx + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    const A xh = (to_acc(xr[k]) - mean) * rstd;
    const A gh = to_acc(gr[k]) * (w ? to_acc(w[k * ws]) : A(1));
    const T v = from_acc<T>(rstd * (gh - sg - xh * sgx));
    out[k] = pending ? add_pending(v, pending[row * C + k]) : v;
  }
}

// Block (32, 8) over columns [32·bx, 32·bx + 32) and rows [kChunkRows·by, ...): thread (tx, ty)
// sums rows ty, ty + 8, ... of its column; the 8 sums are then added in ty order.
// partial_w[by, col] = Σ g·xh, partial_b[by, col] = Σ g over the chunk.
template <typename T>
__global__ void layer_norm_grad_wb_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                                  const acc_of<T>* __restrict__ mean_in,
                                                  const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                                  acc_of<T>* __restrict__ partial_w, acc_of<T>* __restrict__ partial_b) {
  using A = acc_of<T>;
  __shared__ A sw[8][33], sb[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kChunkRows;
  const int64_t r1 = min(R, r0 + kChunkRows);
  A aw = 0, ab = 0;
  if (col < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const A gv = to_acc(g[r * C + col]);
      aw += gv * (to_acc(x[r * C + col]) - mean_in[r]) * rstd_in[r];
      ab += gv;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    A tw = 0, tb = 0;
    for (int i = 0; i < 8; ++i) {
      tw += sw[i][threadIdx.x];
      tb += sb[i][threadIdx.x];
    }
    partial_w[int64_t(blockIdx.y) * C + col] = tw;
    partial_b[int64_t(blockIdx.y) * C + col] = tb;
  }
}

// --- fast path ---
template <typename T>
constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte vector
constexpr int kMaxVecsPerLane = 8;            // C ≤ 32·8·V: 2048 bf16/f16 columns, 1024 fp32
// Partial rows of the weight gradients: 512 beat 1024, 384 and 256 (H200, GPT-2 124M B=16: the
// step's 25 backwards 1.12 → 0.94 ms; fewer partial rows to write and to sum).
constexpr int kFastMaxBlocks = 512;

template <typename T>
struct alignas(16) Vec16 {
  T v[kVec<T>];
};

// Loads lane's NV vectors of a row (those past C / V are zeros and never stored).
template <typename T, int NV>
__device__ __forceinline__ void load_row(const T* row, int nvec, int lane, float (&out)[NV][kVec<T>]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = lane + 32 * j;
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

template <typename T, int NV>
__global__ void __launch_bounds__(256) layer_norm_forward_vec_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                     const T* __restrict__ b, int64_t R, int C,
                                                                     float eps, T* __restrict__ y,
                                                                     float* __restrict__ mean_out,
                                                                     float* __restrict__ rstd_out) {
  constexpr int V = kVec<T>;
  const int lane = threadIdx.x % 32, nvec = C / V;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;
  float xv[NV][V];
  load_row<T, NV>(x + row * C, nvec, lane, xv);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) s += xv[j][e];
  const float mean = warp_sum(s) / float(C);
  float v = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j)
    if (lane + 32 * j < nvec)
#pragma unroll
      for (int e = 0; e < V; ++e) v += (xv[j][e] - mean) * (xv[j][e] - mean);
  const float rstd = 1.f / sqrtf(warp_sum(v) / float(C) + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = lane + 32 * j;
    if (vi >= nvec) continue;
    Vec16<T> wv, bv, o;
    if (w) wv = reinterpret_cast<const Vec16<T>*>(w)[vi];
    if (b) bv = reinterpret_cast<const Vec16<T>*>(b)[vi];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float r = (xv[j][e] - mean) * rstd;
      if (w) r = r * float(to_acc(wv.v[e]));
      if (b) r = r + float(to_acc(bv.v[e]));
      o.v[e] = from_acc<T>(r);
    }
    reinterpret_cast<Vec16<T>*>(y + row * C)[vi] = o;
  }
}

// grad_x per row (as layer_norm_grad_x_kernel) and this block's partial column sums of g·x̂
// (grad_weight) and g (grad_bias), written to partial_w/partial_b[blockIdx.x][C]. Each warp adds
// its rows' terms into its own shared-memory column sums (a lane owns its columns, so no two
// threads touch one address), stored lane-minor — element e of the lane's vector j at
// (j·V + e)·32 + lane — so a warp's 32 accesses hit 32 banks; the block then adds the warps'
// sums in warp order.
constexpr int kBwdWarps = 4;
template <typename T, int NV>
__global__ void __launch_bounds__(32 * kBwdWarps) layer_norm_backward_vec_kernel(
    const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ mean_in,
    const float* __restrict__ rstd_in, int64_t R, int C, const T* __restrict__ pending, T* __restrict__ gx,
    float* __restrict__ partial_w, float* __restrict__ partial_b) {
  constexpr int V = kVec<T>, S = NV * V * 32;  // S: one warp's sums of one kind
  extern __shared__ float smem[];                // [kBwdWarps][2][S]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nvec = C / V;
  float* sw = smem + warp * 2 * S;
  float* sb = sw + S;
  for (int i = lane; i < S; i += 32) sw[i] = sb[i] = 0.f;
  Vec16<T> wv[NV];  // the weight, packed: the same for every row
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = lane + 32 * j;
#pragma unroll
    for (int e = 0; e < V; ++e) wv[j].v[e] = from_acc<T>(1.f);
    if (w && vi < nvec) wv[j] = reinterpret_cast<const Vec16<T>*>(w)[vi];
  }
  __syncwarp();
  for (int64_t row = int64_t(blockIdx.x) * kBwdWarps + warp; row < R; row += int64_t(gridDim.x) * kBwdWarps) {
    float gv[NV][V], xh[NV][V];
    load_row<T, NV>(g + row * C, nvec, lane, gv);
    load_row<T, NV>(x + row * C, nvec, lane, xh);
    // The pending gradient loaded with g and x, before the row sums wait on them: GPT-2's 16,384 ×
    // 768 in 37.3 → 33 µs on an H200 (the RMSNorm backward's rows lost by the same: 23.7 → 28.0).
    Vec16<T> pv[NV];
    if (pending)
#pragma unroll
      for (int j = 0; j < NV; ++j)
        if (lane + 32 * j < nvec) pv[j] = reinterpret_cast<const Vec16<T>*>(pending + row * C)[lane + 32 * j];
    const float mean = mean_in[row], rstd = rstd_in[row];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xh[j][e] = (xh[j][e] - mean) * rstd;  // padding lanes: g = 0 cancels whatever this is
        const float gh = gv[j][e] * float(to_acc(wv[j].v[e]));
        sg += gh;
        sgx += gh * xh[j][e];
      }
    sg = warp_sum(sg) / float(C);
    sgx = warp_sum(sgx) / float(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = lane + 32 * j;
      if (vi >= nvec) continue;
      Vec16<T> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float gh = gv[j][e] * float(to_acc(wv[j].v[e]));
        o.v[e] = from_acc<T>(rstd * (gh - sg - xh[j][e] * sgx));
        if (pending) o.v[e] = add_pending(o.v[e], pv[j].v[e]);
        sw[(j * V + e) * 32 + lane] += gv[j][e] * xh[j][e];
        sb[(j * V + e) * 32 + lane] += gv[j][e];
      }
      reinterpret_cast<Vec16<T>*>(gx + row * C)[vi] = o;
    }
  }
  __syncthreads();
  for (int col = threadIdx.x; col < C; col += blockDim.x) {
    const int vi = col / V, idx = ((vi / 32) * V + col % V) * 32 + vi % 32;
    float tw = 0.f, tb = 0.f;
    for (int k = 0; k < kBwdWarps; ++k) {
      tw += smem[k * 2 * S + idx];
      tb += smem[k * 2 * S + S + idx];
    }
    partial_w[int64_t(blockIdx.x) * C + col] = tw;
    partial_b[int64_t(blockIdx.x) * C + col] = tb;
  }
}

// Blocks for the fast backward: a function of R alone (reruns and other GPUs sum alike).
inline int64_t fast_backward_blocks(int64_t R) {
  return std::min<int64_t>((R + kBwdWarps - 1) / kBwdWarps, kFastMaxBlocks);
}

// Vectors per lane the fast path needs for C columns (0: it does not apply).
template <typename T>
int fast_vecs_per_lane(int64_t C) {
  if constexpr (sizeof(T) == 8) {
    return 0;
  } else {
    if (C % kVec<T> != 0) return 0;
    const int64_t nv = (C / kVec<T> + 31) / 32;
    return nv <= kMaxVecsPerLane ? int(nv) : 0;
  }
}

#define BLU_LN_VECS(nv, ...)                                   \
  switch (nv) {                                                \
    case 1: { constexpr int NV = 1; __VA_ARGS__; break; }      \
    case 2: { constexpr int NV = 2; __VA_ARGS__; break; }      \
    case 3: { constexpr int NV = 3; __VA_ARGS__; break; }      \
    case 4: { constexpr int NV = 4; __VA_ARGS__; break; }      \
    case 5: case 6: { constexpr int NV = 6; __VA_ARGS__; break; } \
    default: { constexpr int NV = 8; __VA_ARGS__; break; }     \
  }

// The weight/bias gradient sums of `chunks` partial rows into out[1], out[2] (in T, or f32 under
// param_dtype f32): one column_sums_final (colsum.cuh) over both.
template <typename T>
void layer_norm_grad_wb_final(const KernelCall& c, const acc_of<T>* pw, const acc_of<T>* pb, int64_t chunks,
                              int64_t C, int threads_y) {
  cudaStream_t s = stream_of(c.ctx);
  if (c.out[1].dtype() == DType::f32 && !std::is_same_v<T, float>)
    column_sums_final(ColumnSums<acc_of<T>, float, 2>{{pw, pb},
                                                      {static_cast<float*>(c.out[1].raw_data()),
                                                       static_cast<float*>(c.out[2].raw_data())}},
                      chunks, C, threads_y, s);
  else
    column_sums_final(ColumnSums<acc_of<T>, T, 2>{{pw, pb},
                                                  {static_cast<T*>(c.out[1].raw_data()),
                                                   static_cast<T*>(c.out[2].raw_data())}},
                      chunks, C, threads_y, s);
}

template <typename T>
const T* opt_ptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

// The fast path's operand rules: contiguous, 16-byte aligned (undefined operands pass).
bool fast_operands(std::initializer_list<Tensor> ts) {
  for (const Tensor& t : ts)
    if (t.defined() && (!t.is_contiguous() || reinterpret_cast<uintptr_t>(t.raw_data()) % 16 != 0)) return false;
  return true;
}

// The fast path when it applies (see the header); false: use the general kernels.
template <typename T>
bool layer_norm_forward_fast(const KernelCall& c, int64_t R, int64_t C, double eps) {
  const int nv = fast_vecs_per_lane<T>(C);
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    if (nv == 0 || !fast_operands({c.in[0], c.in[1], c.in[2]})) return false;
    const unsigned blocks = unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock);
    BLU_LN_VECS(nv, layer_norm_forward_vec_kernel<T, NV><<<blocks, 32 * kRowsPerBlock, 0, stream_of(c.ctx)>>>(
                        static_cast<const T*>(c.in[0].raw_data()), opt_ptr<T>(c.in[1]), opt_ptr<T>(c.in[2]), R,
                        int(C), float(eps), static_cast<T*>(c.out[0].raw_data()),
                        static_cast<float*>(c.out[1].raw_data()), static_cast<float*>(c.out[2].raw_data())));
    BLU_CUDA_CHECK_LAUNCH();
    return true;
  }
}

template <typename T>
bool layer_norm_backward_fast(const KernelCall& c, int64_t R, int64_t C) {
  const int nv = fast_vecs_per_lane<T>(C);
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    const Tensor pending = c.optional_in(5);
    if (R == 0 || nv == 0 || !fast_operands({c.in[0], c.in[1], c.in[2], c.out[0], pending})) return false;
    cudaStream_t s = stream_of(c.ctx);
    const int64_t nb = fast_backward_blocks(R);
    Scratch partial(c.ctx, size_t(2 * nb * C) * sizeof(float));
    float* pw = partial.as<float>();
    BLU_LN_VECS(nv, {
      const size_t smem = size_t(kBwdWarps * 2 * NV * kVec<T> * 32) * sizeof(float);  // ≤ 64 KiB
      if (smem > (48u << 10))  // past the default: opt in (cheap; per device)
        BLU_CUDA_CHECK(cudaFuncSetAttribute(layer_norm_backward_vec_kernel<T, NV>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      layer_norm_backward_vec_kernel<T, NV><<<unsigned(nb), 32 * kBwdWarps, smem, s>>>(
                        static_cast<const T*>(c.in[0].raw_data()), static_cast<const T*>(c.in[1].raw_data()),
                        opt_ptr<T>(c.in[2]), static_cast<const float*>(c.in[3].raw_data()),
                        static_cast<const float*>(c.in[4].raw_data()), R, int(C), opt_ptr<T>(pending),
                        static_cast<T*>(c.out[0].raw_data()), pw, pw + nb * C);
    });
    BLU_CUDA_CHECK_LAUNCH();
    layer_norm_grad_wb_final<T>(c, pw, pw + nb * C, nb, C, 32);
    return true;
  }
}

void layer_norm_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous(), "layer_norm: input must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (R == 0) return;
  const double eps = c.attrs.f("eps");
  const unsigned blocks = unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock);
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm", {
    using A = acc_of<scalar_t>;
    if (layer_norm_forward_fast<scalar_t>(c, R, C, eps)) return;
    layer_norm_forward_kernel<scalar_t><<<blocks, 32 * kRowsPerBlock, 0, stream_of(c.ctx)>>>(
        static_cast<const scalar_t*>(x.raw_data()), opt_ptr<scalar_t>(c.in[1]),
        c.in[1].defined() ? c.in[1].stride(0) : 0, opt_ptr<scalar_t>(c.in[2]),
        c.in[2].defined() ? c.in[2].stride(0) : 0, R, C, eps, static_cast<scalar_t*>(c.out[0].raw_data()),
        static_cast<A*>(c.out[1].raw_data()), static_cast<A*>(c.out[2].raw_data()));
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "layer_norm", layer_norm_kernel);

// Inputs (g, x, weight or undefined, mean, rstd[, pending]); outputs grad_x (+ pending), grad_weight,
// grad_bias.
void layer_norm_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& x = c.in[1];
  const Tensor& w = c.in[2];
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous() && c.in[3].is_contiguous() && c.in[4].is_contiguous(),
             "layer_norm_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (C == 0) return;
  cudaStream_t s = stream_of(c.ctx);
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", {
    using A = acc_of<scalar_t>;
    const auto* gp = static_cast<const scalar_t*>(g.raw_data());
    const auto* xp = static_cast<const scalar_t*>(x.raw_data());
    const A* mp = static_cast<const A*>(c.in[3].raw_data());
    const A* rp = static_cast<const A*>(c.in[4].raw_data());
    if (layer_norm_backward_fast<scalar_t>(c, R, C)) return;
    if (R > 0) {
      layer_norm_grad_x_kernel<scalar_t><<<unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                           s>>>(gp, xp, opt_ptr<scalar_t>(w), w.defined() ? w.stride(0) : 0, mp, rp,
                                                R, C, opt_ptr<scalar_t>(c.optional_in(5)),
                                                static_cast<scalar_t*>(c.out[0].raw_data()));
      BLU_CUDA_CHECK_LAUNCH();
    }
    const int64_t chunks = std::max<int64_t>((R + kChunkRows - 1) / kChunkRows, 1);
    BLU_CHECK(chunks <= 65535, "layer_norm_backward: ", R, " rows exceed the grid's ", 65535 * kChunkRows);
    Scratch partial(c.ctx, size_t(2 * chunks * C) * sizeof(A));
    A* pw = partial.as<A>();
    A* pb = pw + chunks * C;
    layer_norm_grad_wb_partial_kernel<scalar_t>
        <<<dim3(unsigned((C + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, s>>>(gp, xp, mp, rp, R, C, pw, pb);
    BLU_CUDA_CHECK_LAUNCH();
    layer_norm_grad_wb_final<scalar_t>(c, pw, pb, chunks, C, 8);
  });
}
BLU_REGISTER_KERNEL(cuda, "layer_norm_backward", layer_norm_backward_kernel);

}  // namespace

}  // namespace blu::cuda
