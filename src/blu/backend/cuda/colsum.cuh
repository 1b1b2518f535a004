// Deterministic column sums of a row-major [R, N] matrix whose rows a kernel reads or makes: the
// bias gradient Σ_r g[r, :] (linalg.cu), and the same sum taken by the kernel that writes g
// (gelu_and_backward with its bias gradient, elementwise.cu), so that the two give the same bits.
// Partition (a function of R and N only): block (32, 8) owns a slab of 32·V columns (V = 16 bytes
// of T) and a chunk of rows; lane l of warp w takes vector l of rows w, w + 8, … of the chunk
// (16-byte loads, 512 contiguous bytes a warp-row) and adds them in order in float; the 8 warps
// are added in order into partial[chunk][col]; column_sums_final_kernel adds the chunks in order,
// in double (the norms' weight and bias gradients end in the same kernel). Chunks are 256 rows, halved (to 64 at least) until there are 512 blocks: a narrow g
// (GPT-2's 768 columns, 3 slabs) in 256-row chunks gives 192 blocks for 132 multiprocessors, and
// its loads then reach 2.0 TB/s of an H200's 4.8 (13.4 µs for 16,384 rows).
// Self-contained: nn_common.cuh includes it, and so may a file built on loops.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "blu/core/cuda/runtime.h"
#include "blu/core/exec_context.h"

namespace blu::cuda {

// Σ_i p[(first + i·step)·C + col] over the rows first, first + step, … < rows, added in that
// order in double: one column's share of a fixed-order sum of partial rows (the weight and bias
// gradients of the norms, column sums). Eight loads are issued before their additions, so a
// thread has eight rows in flight instead of one; the order of the additions does not change.
template <typename P>
__device__ __forceinline__ double column_sum_rows(const P* __restrict__ p, int64_t rows, int64_t C, int64_t col,
                                                  int64_t first, int64_t step) {
  constexpr int kInFlight = 8;
  double t = 0;
  int64_t i = first;
  for (; i + (kInFlight - 1) * step < rows; i += kInFlight * step) {
    P v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) v[k] = p[(i + k * step) * C + col];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) t += double(v[k]);
  }
  for (; i < rows; i += step) t += double(p[i * C + col]);
  return t;
}

template <typename T>
constexpr int kColVec = 16 / int(sizeof(T));
// 16 bytes of T: what a row functor hands colsum_partial_kernel.
template <typename T>
struct alignas(16) ColVec {
  T v[kColVec<T>];
};

namespace colsum_detail {
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return float(v);
}
// The double sum rounded once to a double output, else to float and then to O (ties to even).
template <typename O>
__device__ __forceinline__ O from_double(double t) {
  if constexpr (std::is_same_v<O, double>) return t;
  const float f = float(t);
  if constexpr (std::is_same_v<O, __nv_bfloat16>) return __float2bfloat16_rn(f);
  else if constexpr (std::is_same_v<O, __half>) return __float2half_rn(f);
  else return O(f);
}
}  // namespace colsum_detail

inline int64_t colsum_slabs(int64_t N, int v) { return (N + 32 * v - 1) / (32 * v); }
inline int64_t colsum_chunk(int64_t R, int64_t slabs) {
  int64_t chunk = 256;
  while (chunk > 64 && slabs * ((R + chunk - 1) / chunk) < 512) chunk /= 2;
  return chunk;
}

// Reads g's rows. A row functor has load(r, N, col0) -> In, the operands of 16 bytes of row r
// from column col0, and finish(r, N, col0, In) -> ColVec<T>, the 16 bytes summed (and whatever
// else it writes).
template <typename T>
struct ColsumLoad {
  using In = ColVec<T>;
  const T* g;
  __device__ __forceinline__ In load(int64_t r, int64_t N, int64_t col0) const {
    return *reinterpret_cast<const ColVec<T>*>(g + r * N + col0);
  }
  __device__ __forceinline__ ColVec<T> finish(int64_t, int64_t, int64_t, const In& v) const { return v; }
};

// Block (32, 8) of grid (slabs, chunks): partial[chunk][col] of the rows `row` gives.
template <typename T, typename Row>
__global__ void __launch_bounds__(256) colsum_partial_kernel(int64_t R, int64_t N, int64_t chunk, Row row,
                                                             float* __restrict__ partial) {
  constexpr int V = kColVec<T>;
  __shared__ float sm[8][32 * V + 1];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t col0 = (int64_t(blockIdx.x) * 32 + lane) * V;
  const int64_t r0 = int64_t(blockIdx.y) * chunk, r1 = min(R, r0 + chunk);
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.f;
  auto add = [&](const ColVec<T>& v) {
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] += colsum_detail::to_float(v.v[e]);
  };
  if (col0 < N)
    for (int64_t r = r0 + warp; r < r1; r += 8) add(row.finish(r, N, col0, row.load(r, N, col0)));
#pragma unroll
  for (int e = 0; e < V; ++e) sm[warp][lane * V + e] = acc[e];
  __syncthreads();
  for (int i = warp * 32 + lane; i < 32 * V; i += 256) {
    const int64_t col = int64_t(blockIdx.x) * 32 * V + i;
    if (col >= N) continue;
    float t = 0.f;
    for (int w = 0; w < 8; ++w) t += sm[w][i];
    partial[int64_t(blockIdx.y) * N + col] = t;
  }
}

// K column sums at once: out[k][col] = Σ_c partial[k][c·N + col] over the `chunks` partial rows
// (the column sums' and the norms' weight and bias gradients), in double, rounded once
// (from_double). Block (32, Y ≤ 32) over 32 columns: thread (tx, ty) adds rows ty, ty + Y, … in
// order, then the Y sums are added in ty order. A null out[k] is skipped.
template <typename P, typename O, int K>
struct ColumnSums {
  const P* partial[K];
  O* out[K];
};

template <typename P, typename O, int K>
__global__ void column_sums_final_kernel(ColumnSums<P, O, K> a, int64_t chunks, int64_t N) {
  __shared__ double sm[K][32][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
#pragma unroll
  for (int k = 0; k < K; ++k)
    sm[k][threadIdx.y][threadIdx.x] = col < N ? column_sum_rows(a.partial[k], chunks, N, col, threadIdx.y, blockDim.y) : 0.0;
  __syncthreads();
  if (threadIdx.y != 0 || col >= N) return;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    double t = 0;
    for (unsigned i = 0; i < blockDim.y; ++i) t += sm[k][i][threadIdx.x];
    if (a.out[k]) a.out[k][col] = colsum_detail::from_double<O>(t);
  }
}

template <typename P, typename O, int K>
void column_sums_final(const ColumnSums<P, O, K>& a, int64_t chunks, int64_t N, int threads_y, cudaStream_t s) {
  column_sums_final_kernel<P, O, K><<<unsigned((N + 31) / 32), dim3(32, unsigned(threads_y)), 0, s>>>(a, chunks, N);
  BLU_CUDA_CHECK_LAUNCH();
}

// Whether colsum_launch can sum g [R, N] of T: N a multiple of 16 bytes of T, few enough chunks.
template <typename T>
bool colsum_fits(int64_t R, int64_t N) {
  constexpr int v = kColVec<T>;
  if (N % v != 0 || R <= 0 || N <= 0) return false;
  const int64_t chunk = colsum_chunk(R, colsum_slabs(N, v));
  return (R + chunk - 1) / chunk <= 65535;
}

// out[N] (T, or f32 when out_f32) = Σ_r of the rows `row` gives; scratch from ws. colsum_fits must
// hold.
template <typename T, typename Row>
void colsum_launch(int64_t R, int64_t N, Row row, void* out, bool out_f32, cudaStream_t s, Workspace& ws) {
  constexpr int v = kColVec<T>;
  const int64_t slabs = colsum_slabs(N, v), chunk = colsum_chunk(R, slabs), chunks = (R + chunk - 1) / chunk;
  float* partial = ws.take<float>(size_t(chunks * N));
  colsum_partial_kernel<T, Row><<<dim3(unsigned(slabs), unsigned(chunks)), dim3(32, 8), 0, s>>>(R, N, chunk, row, partial);
  BLU_CUDA_CHECK_LAUNCH();
  if (out_f32)
    column_sums_final(ColumnSums<float, float, 1>{{partial}, {static_cast<float*>(out)}}, chunks, N, 32, s);
  else
    column_sums_final(ColumnSums<float, T, 1>{{partial}, {static_cast<T*>(out)}}, chunks, N, 32, s);
}

}  // namespace blu::cuda
