// llama-250m's two memory-bound kernels that run below the H200's bandwidth in the compiled step's
// trace (bf16, B=8, T=1024): the RMSNorm backward with the residual gradient's add (x, g, pending
// [8192, 1024], 33 calls a step, 2.6 TB/s) and RoPE over the packed q/k/v heads ([8, 1024, 24, 64],
// q and k rotated with f32 cos/sin [1024, 64], v copied; 32 calls, 2.4 TB/s). Each variant beside
// the kernel as it is in backend/cuda (rms_norm.cu, rotary_swiglu.cu), checked bitwise against it.
//
// RMSNorm backward (rms_norm_backward_vec_kernel<bf16, 4, 32>: one warp a row, 4 rows a block):
//   base       as shipped, at 512 blocks (and at 3 or 4 blocks a multiprocessor, 1024 blocks)
//   lb4        with __launch_bounds__(128, 4): at most 128 registers, as the shipped build gets
//   early      the pending gradient loaded with g and x (before the row sum)
//   asyncN     each warp's rows staged through shared memory by cp.async, N stages of (g, x,
//              pending); the column sums in registers, added over the warps at the end
//   two warps  two warps a row (2 vectors a thread), the row's sum through shared memory behind a
//              named barrier, the column sums in registers; blocks of 128–512 threads, with and
//              without launch bounds that hold it to 64 or 80 registers
//   bytes      no norm at all: gx = g + x + pending, once with base's rows and grid, once as a
//              flat grid-stride pass — the traffic's own time at this size, the bound for any variant
// RoPE:
//   base       one thread a 16-byte vector of one head (j, j + D/2), cos/sin read per head
//   heads=G    one thread the same vector of G heads of one token, cos/sin read once for them
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -o /tmp/llama_small_kernels scripts/lab/llama_small_kernels.cu && /tmp/llama_small_kernels
//
// Times in µs a call (CUDA events, 40 calls after 5, operands rotated over four copies so they do
// not stay in L2 between calls), and the bandwidth of the bytes a call must move. The RMSNorm
// backward's kernel is timed without the last kernel (the sum of its partial rows), which is timed
// apart.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lab_check.cuh"

typedef __nv_bfloat16 T;
constexpr int V = 8;
struct alignas(16) Vec16 {
  T v[V];
};
struct alignas(32) VecF {
  float v[V];
};
__device__ __forceinline__ float to_f(T x) { return __bfloat162float(x); }
__device__ __forceinline__ T to_t(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// --- RMSNorm backward, TPR = 32 threads a row, NV = 4 vectors a thread (C = 1024) -------------
constexpr int NV = 4, TPR = 32, RPB = 4, BLOCK = 128, S = NV * V * TPR;

// Thread t's NV vectors of a row (vectors past C / V are zeros), as rms_norm.cu's load_row.
__device__ __forceinline__ void load_row(const T* row, int nvec, int t, float (&out)[NV][V]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = t + TPR * j;
    if (vi < nvec) {
      const Vec16 v = reinterpret_cast<const Vec16*>(row)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) out[j][e] = to_f(v.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) out[j][e] = 0.f;
    }
  }
}

// rms_norm_backward_vec_kernel<bf16, 4, 32> with a pending gradient; kEarly: the pending vectors
// loaded with g and x instead of after the row sum. kMinBlocks: __launch_bounds__'s second
// argument (1: the compiler's choice of registers).
template <bool kEarly, int kMinBlocks>
__global__ void __launch_bounds__(BLOCK, kMinBlocks) rms_bwd(const T* __restrict__ g, const T* __restrict__ x,
                                                 const T* __restrict__ w, const float* __restrict__ rstd_in, int64_t R,
                                                 int C, const T* __restrict__ pending, T* __restrict__ gx,
                                                 float* __restrict__ partial) {
  extern __shared__ float smem[];
  const int t = threadIdx.x % TPR, group = threadIdx.x / TPR, nvec = C / V;
  float* sw = smem + group * S;
  for (int i = t; i < S; i += TPR) sw[i] = 0.f;
  Vec16 wv[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = t + TPR * j;
#pragma unroll
    for (int e = 0; e < V; ++e) wv[j].v[e] = to_t(1.f);
    if (w && vi < nvec) wv[j] = reinterpret_cast<const Vec16*>(w)[vi];
  }
  for (int64_t row = int64_t(blockIdx.x) * RPB + group; row < R; row += int64_t(gridDim.x) * RPB) {
    float gv[NV][V], xh[NV][V];
    load_row(g + row * C, nvec, t, gv);
    load_row(x + row * C, nvec, t, xh);
    Vec16 pv[NV];
    if (kEarly && pending)
#pragma unroll
      for (int j = 0; j < NV; ++j)
        if (t + TPR * j < nvec) pv[j] = reinterpret_cast<const Vec16*>(pending + row * C)[t + TPR * j];
    const float rstd = rstd_in[row];
    float sgx = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xh[j][e] = xh[j][e] * rstd;
        sgx += gv[j][e] * to_f(wv[j].v[e]) * xh[j][e];
      }
    sgx = warp_sum(sgx) / float(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = t + TPR * j;
      if (vi >= nvec) continue;
      Vec16 o;
      if (!kEarly && pending) pv[j] = reinterpret_cast<const Vec16*>(pending + row * C)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float gh = gv[j][e] * to_f(wv[j].v[e]);
        o.v[e] = to_t(rstd * (gh - xh[j][e] * sgx));
        if (pending) o.v[e] = to_t(__fadd_rn(to_f(o.v[e]), to_f(pv[j].v[e])));
        sw[(j * V + e) * TPR + t] += gv[j][e] * xh[j][e];
      }
      reinterpret_cast<Vec16*>(gx + row * C)[vi] = o;
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

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The same rows, sums and partition as rms_bwd, with each warp's rows staged through shared
// memory by cp.async, NS stages of (g, x, pending) a warp: the next NS - 1 rows load while one
// is computed. A thread's column sums stay in registers (it owns the same columns in every row);
// the block adds its warps' sums in warp order at the end.
template <int NS>
__global__ void __launch_bounds__(BLOCK) rms_bwd_async(const T* __restrict__ g, const T* __restrict__ x,
                                                       const T* __restrict__ w, const float* __restrict__ rstd_in,
                                                       int64_t R, int C, const T* __restrict__ pending,
                                                       T* __restrict__ gx, float* __restrict__ partial) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nvec = C / V;
  T* stages = reinterpret_cast<T*>(smem_raw) + int64_t(warp) * NS * 3 * C;
  Vec16 wv[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = lane + TPR * j;
#pragma unroll
    for (int e = 0; e < V; ++e) wv[j].v[e] = to_t(1.f);
    if (w && vi < nvec) wv[j] = reinterpret_cast<const Vec16*>(w)[vi];
  }
  float acc[NV][V];
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[j][e] = 0.f;
  const int64_t step = int64_t(gridDim.x) * RPB;
  const int64_t first = int64_t(blockIdx.x) * RPB + warp;
  auto issue = [&](int64_t r, int st) {
    if (r < R) {
      T* d = stages + int64_t(st) * 3 * C;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int vi = lane + TPR * j;
        if (vi < nvec) {
          cp_async_16(d + vi * V, g + r * C + vi * V);
          cp_async_16(d + C + vi * V, x + r * C + vi * V);
          if (pending) cp_async_16(d + 2 * C + vi * V, pending + r * C + vi * V);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < NS - 1; ++k) issue(first + k * step, k);
  int k = 0;
  for (int64_t row = first; row < R; row += step, ++k) {
    issue(row + (NS - 1) * step, (k + NS - 1) % NS);
    const float rstd = rstd_in[row];
    cp_async_wait<NS - 1>();
    __syncwarp();
    const T* sg = stages + int64_t(k % NS) * 3 * C;
    const T* sx = sg + C;
    const T* sp = sg + 2 * C;
    float sgx = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = lane + TPR * j;
      if (vi >= nvec) continue;
      const Vec16 a = reinterpret_cast<const Vec16*>(sg)[vi], b = reinterpret_cast<const Vec16*>(sx)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) sgx += to_f(a.v[e]) * to_f(wv[j].v[e]) * (to_f(b.v[e]) * rstd);
    }
    sgx = warp_sum(sgx) / float(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = lane + TPR * j;
      if (vi >= nvec) continue;
      const Vec16 a = reinterpret_cast<const Vec16*>(sg)[vi], b = reinterpret_cast<const Vec16*>(sx)[vi];
      Vec16 pv, o;
      if (pending) pv = reinterpret_cast<const Vec16*>(sp)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float gf = to_f(a.v[e]), xh = to_f(b.v[e]) * rstd;
        o.v[e] = to_t(rstd * (gf * to_f(wv[j].v[e]) - xh * sgx));
        if (pending) o.v[e] = to_t(__fadd_rn(to_f(o.v[e]), to_f(pv.v[e])));
        acc[j][e] += gf * xh;
      }
      reinterpret_cast<Vec16*>(gx + row * C)[vi] = o;
    }
    __syncwarp();  // every lane has read this stage before a later issue() refills it
  }
  cp_async_wait<0>();
  __syncthreads();
  float* sums = reinterpret_cast<float*>(smem_raw);  // [RPB][C], over the stages
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int vi = lane + TPR * j;
    if (vi < nvec)
#pragma unroll
      for (int e = 0; e < V; ++e) sums[warp * C + vi * V + e] = acc[j][e];
  }
  __syncthreads();
  for (int col = threadIdx.x; col < C; col += blockDim.x) {
    float tw = 0.f;
    for (int r = 0; r < RPB; ++r) tw += sums[r * C + col];
    partial[int64_t(blockIdx.x) * C + col] = tw;
  }
}

// The bytes alone: gx = g + x + pending over the same [R, C] rows, as base reads and writes them
// (one warp a row, 4 rows a block, 512 blocks) and as a flat grid-stride copy (8 blocks of 256 a
// multiprocessor): what the RMSNorm backward's traffic can take at best at this size.
__global__ void __launch_bounds__(BLOCK) stream_rows(const T* __restrict__ g, const T* __restrict__ x,
                                                     const T* __restrict__, const float* __restrict__, int64_t R,
                                                     int C, const T* __restrict__ pending, T* __restrict__ gx,
                                                     float* __restrict__) {
  const int t = threadIdx.x % TPR, group = threadIdx.x / TPR, nvec = C / V;
  for (int64_t row = int64_t(blockIdx.x) * RPB + group; row < R; row += int64_t(gridDim.x) * RPB)
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int vi = t + TPR * j;
      if (vi >= nvec) continue;
      const Vec16 a = reinterpret_cast<const Vec16*>(g + row * C)[vi], b = reinterpret_cast<const Vec16*>(x + row * C)[vi],
                  c = reinterpret_cast<const Vec16*>(pending + row * C)[vi];
      Vec16 o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = to_t(to_f(a.v[e]) + to_f(b.v[e]) + to_f(c.v[e]));
      reinterpret_cast<Vec16*>(gx + row * C)[vi] = o;
    }
}
__global__ void __launch_bounds__(256) stream_flat(const T* __restrict__ g, const T* __restrict__ x,
                                                   const T* __restrict__ pending, T* __restrict__ gx, int64_t nvec) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * blockDim.x) {
    const Vec16 a = reinterpret_cast<const Vec16*>(g)[i], b = reinterpret_cast<const Vec16*>(x)[i],
                c = reinterpret_cast<const Vec16*>(pending)[i];
    Vec16 o;
#pragma unroll
    for (int e = 0; e < V; ++e) o.v[e] = to_t(to_f(a.v[e]) + to_f(b.v[e]) + to_f(c.v[e]));
    reinterpret_cast<Vec16*>(gx)[i] = o;
  }
}

// Two warps a row (TPR2 = 64 threads, NV2 = 2 vectors a thread for C = 1024), BLOCK2 threads a
// block: the row's sum is the two warps' sums through shared memory behind a named barrier of the
// row's 64 threads (two slots used in turn, so one barrier a row suffices); a thread's column sums
// stay in registers (it owns the same columns in every row) and the block adds its rows' sums in
// group order at the end. Half the registers of base a thread, so twice the warps a multiprocessor.
template <int BLOCK2, int kMinBlocks2 = 1>
__global__ void __launch_bounds__(BLOCK2, kMinBlocks2) rms_bwd_two_warps(const T* __restrict__ g, const T* __restrict__ x,
                                                            const T* __restrict__ w, const float* __restrict__ rstd_in,
                                                            int64_t R, int C, const T* __restrict__ pending,
                                                            T* __restrict__ gx, float* __restrict__ partial) {
  constexpr int TPR2 = 64, NV2 = 2, RPB2 = BLOCK2 / TPR2;
  __shared__ float red[RPB2][2][2];
  __shared__ float sums[RPB2][1024];
  const int t = threadIdx.x % TPR2, group = threadIdx.x / TPR2, half = t / 32, nvec = C / V;
  Vec16 wv[NV2];
  float acc[NV2][V];
#pragma unroll
  for (int j = 0; j < NV2; ++j) {
    const int vi = t + TPR2 * j;
#pragma unroll
    for (int e = 0; e < V; ++e) wv[j].v[e] = to_t(1.f), acc[j][e] = 0.f;
    if (w && vi < nvec) wv[j] = reinterpret_cast<const Vec16*>(w)[vi];
  }
  int it = 0;
#pragma unroll 1
  for (int64_t row = int64_t(blockIdx.x) * RPB2 + group; row < R; row += int64_t(gridDim.x) * RPB2, ++it) {
    float gv[NV2][V], xh[NV2][V];
#pragma unroll
    for (int j = 0; j < NV2; ++j) {
      const Vec16 a = reinterpret_cast<const Vec16*>(g + row * C)[t + TPR2 * j];
      const Vec16 b = reinterpret_cast<const Vec16*>(x + row * C)[t + TPR2 * j];
#pragma unroll
      for (int e = 0; e < V; ++e) gv[j][e] = to_f(a.v[e]), xh[j][e] = to_f(b.v[e]);
    }
    const float rstd = rstd_in[row];
    float sgx = 0.f;
#pragma unroll
    for (int j = 0; j < NV2; ++j)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xh[j][e] = xh[j][e] * rstd;
        sgx += gv[j][e] * to_f(wv[j].v[e]) * xh[j][e];
      }
    sgx = warp_sum(sgx);
    if (t % 32 == 0) red[group][it & 1][half] = sgx;
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(TPR2) : "memory");
    sgx = (red[group][it & 1][0] + red[group][it & 1][1]) / float(C);
#pragma unroll
    for (int j = 0; j < NV2; ++j) {
      const int vi = t + TPR2 * j;
      Vec16 o, pv;
      if (pending) pv = reinterpret_cast<const Vec16*>(pending + row * C)[vi];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float gh = gv[j][e] * to_f(wv[j].v[e]);
        o.v[e] = to_t(rstd * (gh - xh[j][e] * sgx));
        if (pending) o.v[e] = to_t(__fadd_rn(to_f(o.v[e]), to_f(pv.v[e])));
        acc[j][e] += gv[j][e] * xh[j][e];
      }
      reinterpret_cast<Vec16*>(gx + row * C)[vi] = o;
    }
  }
#pragma unroll
  for (int j = 0; j < NV2; ++j)
#pragma unroll
    for (int e = 0; e < V; ++e) sums[group][(t + TPR2 * j) * V + e] = acc[j][e];
  __syncthreads();
  for (int col = threadIdx.x; col < C; col += BLOCK2) {
    float tw = 0.f;
    for (int k = 0; k < RPB2; ++k) tw += sums[k][col];
    partial[int64_t(blockIdx.x) * C + col] = tw;
  }
}

__global__ void rms_final(const float* __restrict__ partial, int64_t chunks, int64_t C, T* __restrict__ gw) {
  __shared__ double s[32][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double t = 0;
  if (col < C)
    for (int64_t r = threadIdx.y; r < chunks; r += blockDim.y) t += double(partial[r * C + col]);
  s[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    t = 0;
    for (unsigned i = 0; i < blockDim.y; ++i) t += s[i][threadIdx.x];
    gw[col] = to_t(float(t));
  }
}

// --- RoPE over [B, T, H, D] contiguous, heads [0, rot) rotated ---------------------------------
struct Rope {
  int B, T, H, D, rot;
};

__global__ void rope_base(const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                          T* __restrict__ y, Rope s) {
  const int h = s.D / 2, per_row = h / V;
  const int64_t n = int64_t(s.B) * s.T * s.H * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row;
    const int j = int(i - row * per_row) * V;
    const int hh = int(row % s.H), t = int(row / s.H % s.T);
    const T* xr = x + row * s.D;
    const Vec16 x1 = *reinterpret_cast<const Vec16*>(xr + j), x2 = *reinterpret_cast<const Vec16*>(xr + j + h);
    Vec16 y1 = x1, y2 = x2;
    if (hh < s.rot) {
      const VecF c1 = *reinterpret_cast<const VecF*>(cs + t * s.D + j), c2 = *reinterpret_cast<const VecF*>(cs + t * s.D + j + h);
      const VecF s1 = *reinterpret_cast<const VecF*>(sn + t * s.D + j), s2 = *reinterpret_cast<const VecF*>(sn + t * s.D + j + h);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float a = to_f(x1.v[e]), b = to_f(x2.v[e]);
        y1.v[e] = to_t(__fsub_rn(__fmul_rn(a, c1.v[e]), __fmul_rn(b, s1.v[e])));
        y2.v[e] = to_t(__fadd_rn(__fmul_rn(b, c2.v[e]), __fmul_rn(a, s2.v[e])));
      }
    }
    T* yr = y + row * s.D;
    *reinterpret_cast<Vec16*>(yr + j) = y1;
    *reinterpret_cast<Vec16*>(yr + j + h) = y2;
  }
}

// One thread: vector j of heads g0, g0 + 1, ..., g0 + G - 1 of token (b, t); the G heads' loads
// are issued before any store.
template <int G>
__global__ void rope_heads(const T* __restrict__ x, const float* __restrict__ cs, const float* __restrict__ sn,
                           T* __restrict__ y, Rope s) {
  const int h = s.D / 2, per_row = h / V, groups = (s.H + G - 1) / G;
  const int64_t n = int64_t(s.B) * s.T * groups * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int j = int(i % per_row) * V;
    const int64_t q = i / per_row;
    const int grp = int(q % groups);
    const int64_t bt = q / groups;
    const int t = int(bt % s.T), h0 = grp * G;
    const T* xr = x + (bt * s.H + h0) * s.D;
    T* yr = y + (bt * s.H + h0) * s.D;
    Vec16 a1[G], a2[G];
#pragma unroll
    for (int k = 0; k < G; ++k)
      if (h0 + k < s.H) {
        a1[k] = *reinterpret_cast<const Vec16*>(xr + k * s.D + j);
        a2[k] = *reinterpret_cast<const Vec16*>(xr + k * s.D + j + h);
      }
    VecF c1, c2, s1, s2;
    if (h0 < s.rot) {
      c1 = *reinterpret_cast<const VecF*>(cs + t * s.D + j), c2 = *reinterpret_cast<const VecF*>(cs + t * s.D + j + h);
      s1 = *reinterpret_cast<const VecF*>(sn + t * s.D + j), s2 = *reinterpret_cast<const VecF*>(sn + t * s.D + j + h);
    }
#pragma unroll
    for (int k = 0; k < G; ++k) {
      if (h0 + k >= s.H) continue;
      Vec16 y1 = a1[k], y2 = a2[k];
      if (h0 + k < s.rot) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float a = to_f(a1[k].v[e]), b = to_f(a2[k].v[e]);
          y1.v[e] = to_t(__fsub_rn(__fmul_rn(a, c1.v[e]), __fmul_rn(b, s1.v[e])));
          y2.v[e] = to_t(__fadd_rn(__fmul_rn(b, c2.v[e]), __fmul_rn(a, s2.v[e])));
        }
      }
      *reinterpret_cast<Vec16*>(yr + k * s.D + j) = y1;
      *reinterpret_cast<Vec16*>(yr + k * s.D + j + h) = y2;
    }
  }
}

// --- harness ----------------------------------------------------------------------------------
__global__ void fill(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    p[i] = to_t(scale * (float(h & 0xffff) / 32768.f - 1.f));
  }
}
T* rand_bf16(int64_t n, uint32_t seed, float scale = 1.f) {
  T* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  fill<<<1024, 256>>>(p, n, seed, scale);
  return p;
}
bool same(const void* a, const void* b, size_t bytes) {
  std::vector<char> x(bytes), y(bytes);
  CK(cudaMemcpy(x.data(), a, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), b, bytes, cudaMemcpyDeviceToHost));
  return std::memcmp(x.data(), y.data(), bytes) == 0;
}
template <typename F>
float time_us(F&& call) {
  for (int i = 0; i < 5; ++i) call(i);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < 40; ++i) call(i);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  return ms * 1000.f / 40;
}

int main() {
  constexpr int kCopies = 4;
  // RMSNorm backward.
  {
    const int64_t R = 8192, C = 1024, n = R * C;
    T *g[kCopies], *x[kCopies], *p[kCopies], *gx[kCopies];
    float* rstd;
    for (int k = 0; k < kCopies; ++k) {
      g[k] = rand_bf16(n, 11 + k), x[k] = rand_bf16(n, 21 + k), p[k] = rand_bf16(n, 31 + k);
      CK(cudaMalloc(&gx[k], n * sizeof(T)));
    }
    T* w = rand_bf16(C, 5);
    T *gw, *gw_ref, *gx_ref;
    CK(cudaMalloc(&gw, C * sizeof(T)));
    CK(cudaMalloc(&gw_ref, C * sizeof(T)));
    CK(cudaMalloc(&gx_ref, n * sizeof(T)));
    std::vector<float> rs(R);
    for (int64_t r = 0; r < R; ++r) rs[r] = 1.f + 0.001f * float(r % 97);
    CK(cudaMalloc(&rstd, R * sizeof(float)));
    CK(cudaMemcpy(rstd, rs.data(), R * sizeof(float), cudaMemcpyHostToDevice));
    float* partial;
    CK(cudaMalloc(&partial, 4096 * C * sizeof(float)));
    const size_t smem = size_t(BLOCK) * NV * V * sizeof(float);
    using Kern = void (*)(const T*, const T*, const T*, const float*, int64_t, int, const T*, T*, float*);
    auto run = [&](Kern kern, int blocks, int k, T* out, T* wout) {
      kern<<<blocks, BLOCK, smem>>>(g[k], x[k], w, rstd, R, int(C), p[k], out, partial);
      rms_final<<<dim3(unsigned(C / 32)), dim3(32, 32)>>>(partial, blocks, C, wout);
    };
    const double bytes = 4.0 * n * sizeof(T);  // g, x, pending read; gx written
    run(rms_bwd<false, 1>, 512, 0, gx_ref, gw_ref);
    std::printf("RMSNorm backward, bf16 [%lld, %lld] with pending (%.1f MB a call)\n", (long long)R, (long long)C,
                bytes / 1e6);
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    struct Variant {
      const char* name;
      Kern kern;
      int blocks;
    } variants[] = {
        {"base (512 blocks)", rms_bwd<false, 1>, 512},  {"base lb4 512", rms_bwd<false, 4>, 512},
        {"base lb4 4/SM", rms_bwd<false, 4>, 4 * sms},  {"base 3/SM", rms_bwd<false, 1>, 3 * sms},
        {"base 4/SM", rms_bwd<false, 1>, 4 * sms},      {"base 1024", rms_bwd<false, 1>, 1024},
        {"early", rms_bwd<true, 1>, 512},               {"early 3/SM", rms_bwd<true, 1>, 3 * sms},
        {"early lb4 512", rms_bwd<true, 4>, 512},       {"early lb4 4/SM", rms_bwd<true, 4>, 4 * sms},
        {"early lb4 1024", rms_bwd<true, 4>, 1024},
        {"async2 512", rms_bwd_async<2>, 512},          {"async3 512", rms_bwd_async<3>, 512},
        {"async2 1024", rms_bwd_async<2>, 1024},        {"async3 3/SM", rms_bwd_async<3>, 3 * sms},
        {"async4 512", rms_bwd_async<4>, 512},
        {"two warps 256x512", rms_bwd_two_warps<256>, 512}, {"two warps 128x1024", rms_bwd_two_warps<128>, 1024},
        {"two warps 256x4/SM", rms_bwd_two_warps<256>, 4 * sms}, {"two warps 512x256", rms_bwd_two_warps<512>, 256},
        {"two warps lb 256x512", rms_bwd_two_warps<256, 4>, 512}, {"two warps lb 128x1024", rms_bwd_two_warps<128, 8>, 1024},
        {"two warps lb 256x4/SM", rms_bwd_two_warps<256, 4>, 4 * sms},
        {"two warps lb3 256x512", rms_bwd_two_warps<256, 3>, 512}, {"two warps lb3 256x3/SM", rms_bwd_two_warps<256, 3>, 3 * sms},
        {"bytes: rows 512", stream_rows, 512},       {"bytes: rows 4/SM", stream_rows, 4 * sms},
    };
    for (const Variant& v : variants) {
      size_t sm = smem;
      if (v.kern == rms_bwd_async<2>) sm = size_t(RPB) * 2 * 3 * C * sizeof(T);
      if (v.kern == rms_bwd_async<3>) sm = size_t(RPB) * 3 * 3 * C * sizeof(T);
      if (v.kern == rms_bwd_async<4>) sm = size_t(RPB) * 4 * 3 * C * sizeof(T);
      const bool two = v.kern == rms_bwd_two_warps<256> || v.kern == rms_bwd_two_warps<128> ||
                       v.kern == rms_bwd_two_warps<512> || v.kern == rms_bwd_two_warps<256, 4> || v.kern == rms_bwd_two_warps<256, 3> ||
                       v.kern == rms_bwd_two_warps<128, 8>;
      const int threads = v.kern == rms_bwd_two_warps<128> || v.kern == rms_bwd_two_warps<128, 8> ? 128
                          : v.kern == rms_bwd_two_warps<512>                                    ? 512
                          : two                                                                 ? 256
                                                                                                : BLOCK;
      if (two || v.kern == stream_rows) sm = 0;
      if (sm) CK(cudaFuncSetAttribute(v.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sm)));
      auto go = [&](int k, T* out) {
        v.kern<<<v.blocks, threads, sm>>>(g[k], x[k], w, rstd, R, int(C), p[k], out, partial);
        rms_final<<<dim3(unsigned(C / 32)), dim3(32, 32)>>>(partial, v.blocks, C, gw);
      };
      const float us = time_us([&](int i) {
        const int k = i % kCopies;
        v.kern<<<v.blocks, threads, sm>>>(g[k], x[k], w, rstd, R, int(C), p[k], gx[k], partial);
      });
      const float us_final = time_us([&](int) { rms_final<<<dim3(unsigned(C / 32)), dim3(32, 32)>>>(partial, v.blocks, C, gw); });
      go(0, gx[0]);
      CK(cudaDeviceSynchronize());
      const bool gx_same = same(gx[0], gx_ref, n * sizeof(T));
      const bool gw_same = v.blocks == 512 ? same(gw, gw_ref, C * sizeof(T)) : true;
      std::printf("  %-20s %7.2f us  %5.2f TB/s  gx %s%s; the partial rows' sum %.2f us\n", v.name, us,
                  bytes / us / 1e6, gx_same ? "bitwise" : "DIFFERS", gw_same ? "" : ", gw DIFFERS", us_final);
    }
    const float flat = time_us([&](int i) {
      const int k = i % kCopies;
      stream_flat<<<8 * sms, 256>>>(g[k], x[k], p[k], gx[k], n / V);
    });
    std::printf("  %-20s %7.2f us  %5.2f TB/s\n", "bytes: flat 8/SM", flat, bytes / flat / 1e6);
  }
  // RoPE.
  {
    const Rope s{8, 1024, 24, 64, 20};  // 16 q heads and 4 k heads rotated, 4 v heads copied
    const int64_t n = int64_t(s.B) * s.T * s.H * s.D;
    T *x[kCopies], *y[kCopies], *y_ref;
    for (int k = 0; k < kCopies; ++k) {
      x[k] = rand_bf16(n, 41 + k);
      CK(cudaMalloc(&y[k], n * sizeof(T)));
    }
    CK(cudaMalloc(&y_ref, n * sizeof(T)));
    std::vector<float> c(s.T * s.D), sn(s.T * s.D);
    for (int t = 0; t < s.T; ++t)
      for (int d = 0; d < s.D / 2; ++d) {
        const double a = t * std::pow(10000.0, -2.0 * d / s.D);
        c[t * s.D + d] = c[t * s.D + d + s.D / 2] = float(std::cos(a));
        sn[t * s.D + d] = sn[t * s.D + d + s.D / 2] = float(std::sin(a));
      }
    float *cd, *sd;
    CK(cudaMalloc(&cd, c.size() * 4));
    CK(cudaMalloc(&sd, sn.size() * 4));
    CK(cudaMemcpy(cd, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sd, sn.data(), sn.size() * 4, cudaMemcpyHostToDevice));
    const double bytes = 2.0 * n * sizeof(T);
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    auto grid = [&](int64_t items) { return unsigned(std::min<int64_t>((items + 255) / 256, int64_t(sms) * 8)); };
    const int64_t base_items = n / V / 2;
    rope_base<<<grid(base_items), 256>>>(x[0], cd, sd, y_ref, s);
    std::printf("RoPE, bf16 [%d, %d, %d, %d], %d heads rotated (%.1f MB a call)\n", s.B, s.T, s.H, s.D, s.rot,
                bytes / 1e6);
    auto report = [&](const char* name, float us) {
      CK(cudaDeviceSynchronize());
      std::printf("  %-20s %7.2f us  %5.2f TB/s  %s\n", name, us, bytes / us / 1e6,
                  same(y[0], y_ref, n * sizeof(T)) ? "bitwise" : "DIFFERS");
    };
    float us = time_us([&](int i) { rope_base<<<grid(base_items), 256>>>(x[i % kCopies], cd, sd, y[i % kCopies], s); });
    rope_base<<<grid(base_items), 256>>>(x[0], cd, sd, y[0], s);
    report("base", us);
    auto heads = [&]<int G>(const char* name) {
      const int64_t items = int64_t(s.B) * s.T * ((s.H + G - 1) / G) * (s.D / 2 / V);
      const float t = time_us([&](int i) { rope_heads<G><<<grid(items), 256>>>(x[i % kCopies], cd, sd, y[i % kCopies], s); });
      CK(cudaMemset(y[0], 0, n * sizeof(T)));
      rope_heads<G><<<grid(items), 256>>>(x[0], cd, sd, y[0], s);
      report(name, t);
    };
    heads.template operator()<2>("heads=2");
    heads.template operator()<4>("heads=4");
    heads.template operator()<8>("heads=8");
  }
  return 0;
}
