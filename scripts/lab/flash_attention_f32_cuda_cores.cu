// Lab variant (not built): flash attention in IEEE fp32 on CUDA cores (register-blocked, no TF32,
// deterministic). The shipping f32 path is the TF32 tensor-core kernels (3xTF32 under "ieee"):
// H200, B16 H12 T1024 D64 causal, forward 0.8695 ms and fwd+bwd 3.7911 ms here against 0.7631 /
// 2.6537 for 3xTF32 (docs/performance.md). To run it again: add this file to src/blu/backend/cuda/
// (as flash_attention_f32_cuda_cores.cu), declare fwd_f32<D> / bwd_f32<D> in flash_attention_f32.h
// (drop their anonymous namespace), route flash_attention_forward_f32 / _backward_f32 to them, and
// run build-cuda/tests/test_cuda --gtest_filter='FlashAttentionF32*:FlashAttentionPerf*'.
//
// Flash attention in IEEE fp32 on CUDA cores (no TF32), and the router of the f32 path
// (flash_attention.cu, flash_attention_backward.cu send f32 here): by default f32 runs the TF32
// tensor-core kernels of flash_attention_tf32.cu, 1xTF32 or 3xTF32 as matmul_precision() says
// ("tf32" / "ieee", read at each launch); these CUDA-core kernels run when
// set_flash_attention_f32_cuda_cores(true) asks for them (exact IEEE fp32 products, deterministic).
//
// Written like a register-blocked SGEMM. A CTA of 256 threads works on 64x64 score tiles; thread
// (ty, tx) = (tid / 16, tid % 16) owns rows 4ty..4ty+3 and columns tx + 16j (j < 4) of a score
// tile, and rows 4ty..4ty+3, columns 4tx + 64c (+0..3) of a [64, D] accumulator. Tiles live in
// shared memory row-major with rows padded by 4 floats (bank spread, 16-byte cp.async). Three
// building blocks serve every product:
//   mm_abt: S[4][4] += A[rows]·B[cols]ᵀ, both operands row-major [row][d] (float4 along d);
//   store_t: a score micro-tile to shared memory transposed, [col][row] (float4 over the 4 rows);
//   mm_pv:  O[4][D/16] += Pᵀ-stored tile · V, i.e. Σ_k P[k][row] V[k][col].
// The 16 threads that share a row are lanes 0..15 or 16..31 of one warp, so row max reductions
// are 4 xor shuffles; row sums stay per thread until the end (alpha is uniform across them).
//
// Forward: CTA per 64 query rows (heaviest causal tiles first); K/V tiles of 64 keys double-
// buffered by cp.async; online softmax in exp2 with scale·log2e folded in; writes O and the
// natural-log lse of the scaled scores (flash_attention.h).
// Backward (P = exp(scale·S − lse), Dsum = rowsum(dO ∘ O), dS = P ∘ (dP − Dsum) · scale):
//   1. dQ kernel, CTA per 64 query rows over the key tiles it sees: computes Dsum for its rows
//      (written to p.dsum for step 2), S = Q·Kᵀ, dP = dO·Vᵀ, dQ += dS·K, written straight to dq.
//   2. dK/dV kernel, CTA per 64 keys over the query tiles that see them: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ,
//      dV += Pᵀ·dO, dK += dSᵀ·Q. GQA: the 64 keys of a key/value head, over the query tiles of
//      each of its group's query heads in turn (Note [GQA backward]).
//   Both deterministic (no atomics); scores are recomputed in each.
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_f32.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/precision.h"

#include <atomic>

namespace blu::cuda::flash {

namespace {

constexpr int kTile = 64;      // query rows and keys per tile
constexpr int kThreads = 256;  // 16 x 16 threads, 4x4 score micro-tile each
constexpr int kLdS = kTile + 4;  // row stride (floats) of a transposed score tile
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kPosInf = __builtin_huge_valf();

template <int D>
constexpr int ld() {
  return D + 4;  // row stride (floats) of a [64, D] operand tile
}
template <int D>
constexpr int tile_floats() {
  return kTile * ld<D>();
}

// Rows [r0, r0 + 64) of a [T, D] slice (row stride `st`) into `tile`; rows >= T zero-filled.
// Issues cp.async only: the caller commits and waits.
template <int D>
__device__ __forceinline__ void load_tile(float* tile, const float* base, int64_t st, int r0, int T, int tid) {
  constexpr int kChunks = D / 4;
#pragma unroll
  for (int i = 0; i < kTile * kChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r0 + r < T;
    const float* src = valid ? base + int64_t(r0 + r) * st + c * 4 : base;
    cp_async_16(tile + r * ld<D>() + c * 4, src, valid);
  }
}

// acc[i][j] += Σ_d A[4ty + i][d] · B[tx + 16j][d].
template <int D>
__device__ __forceinline__ void mm_abt(float (&acc)[4][4], const float* A, const float* B, int tx, int ty) {
  const float* a = A + 4 * ty * ld<D>();
  const float* bp = B + tx * ld<D>();
#pragma unroll 2
  for (int d = 0; d < D; d += 4) {
    float4 av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = *reinterpret_cast<const float4*>(a + i * ld<D>() + d);
#pragma unroll
    for (int j = 0; j < 4; ++j) bv[j] = *reinterpret_cast<const float4*>(bp + 16 * j * ld<D>() + d);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j] = fmaf(av[i].x, bv[j].x, acc[i][j]);
        acc[i][j] = fmaf(av[i].y, bv[j].y, acc[i][j]);
        acc[i][j] = fmaf(av[i].z, bv[j].z, acc[i][j]);
        acc[i][j] = fmaf(av[i].w, bv[j].w, acc[i][j]);
      }
  }
}

// S[tx + 16j][4ty + i] = v[i][j] (a [64][kLdS] tile).
__device__ __forceinline__ void store_t(float* S, const float (&v)[4][4], int tx, int ty) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<float4*>(S + (tx + 16 * j) * kLdS + 4 * ty) = make_float4(v[0][j], v[1][j], v[2][j], v[3][j]);
}

// acc[i][4c + e] += Σ_k P[k][4ty + i] · V[k][64c + 4tx + e]; P is [64][kLdS], V is [64][ld<D>].
template <int D>
__device__ __forceinline__ void mm_pv(float (&acc)[4][D / 16], const float* P, const float* V, int tx, int ty) {
  const float* pp = P + 4 * ty;
  const float* vp = V + 4 * tx;
#pragma unroll 4
  for (int k = 0; k < kTile; ++k) {
    const float4 pv = *reinterpret_cast<const float4*>(pp + k * kLdS);
    const float pr[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      const float4 vv = *reinterpret_cast<const float4*>(vp + k * ld<D>() + 64 * c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[i][4 * c + 0] = fmaf(pr[i], vv.x, acc[i][4 * c + 0]);
        acc[i][4 * c + 1] = fmaf(pr[i], vv.y, acc[i][4 * c + 1]);
        acc[i][4 * c + 2] = fmaf(pr[i], vv.z, acc[i][4 * c + 2]);
        acc[i][4 * c + 3] = fmaf(pr[i], vv.w, acc[i][4 * c + 3]);
      }
    }
  }
}

// Rows r0 + 4ty + i (< T) of `acc` times `mul[i]` to out (row stride st), float4 per column group.
template <int D>
__device__ __forceinline__ void store_rows(float* out, int64_t st, int r0, int T, const float (&acc)[4][D / 16],
                                           const float (&mul)[4], int tx, int ty) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + 4 * ty + i;
    if (r >= T) continue;
    float* o = out + int64_t(r) * st + 4 * tx;
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
      *reinterpret_cast<float4*>(o + 64 * c) = make_float4(acc[i][4 * c] * mul[i], acc[i][4 * c + 1] * mul[i],
                                                           acc[i][4 * c + 2] * mul[i], acc[i][4 * c + 3] * mul[i]);
  }
}

__device__ __forceinline__ float row_max16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float row_sum16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Forward. Shared: Q, 2 x (K, V), P.
template <int D>
constexpr int fwd_smem_bytes() {
  return (5 * tile_floats<D>() + kTile * kLdS) * 4;
}

template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) fa32_fwd_kernel(FlashFwdParams p) {
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);
  float* Ks = Qs + tile_floats<D>();      // 2 stages
  float* Vs = Ks + 2 * tile_floats<D>();  // 2 stages
  float* Ps = Vs + 2 * tile_floats<D>();
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int T = p.T;
  const int nt = (T + kTile - 1) / kTile;
  const int qt = nt - 1 - int(blockIdx.y);  // heaviest (causal) first
  const int q0 = qt * kTile;
  const int nk = p.causal ? qt + 1 : nt;
  const float* qb = slice<float>(p.q, b, h);
  const float* kb = slice<float>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
  const float* vb = slice<float>(p.v, b, h / p.group);

  load_tile<D>(Qs, qb, p.q.st, q0, T, tid);
  load_tile<D>(Ks, kb, p.k.st, 0, T, tid);
  load_tile<D>(Vs, vb, p.v.st, 0, T, tid);
  cp_async_commit();

  const float c = p.scale * kLog2e;
  float m[4], l[4], acc[4][D / 16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < D / 16; ++e) acc[i][e] = 0.f;
  }

  for (int kt = 0; kt < nk; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < nk) {
      load_tile<D>(Ks + (stage ^ 1) * tile_floats<D>(), kb, p.k.st, (kt + 1) * kTile, T, tid);
      load_tile<D>(Vs + (stage ^ 1) * tile_floats<D>(), vb, p.v.st, (kt + 1) * kTile, T, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    float s[4][4] = {};
    mm_abt<D>(s, Qs, Ks + stage * tile_floats<D>(), tx, ty);
    const int k0 = kt * kTile;
    const bool mask = k0 + kTile > T || (p.causal && kt == qt);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + 4 * ty + i;
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = k0 + tx + 16 * j;
        s[i][j] *= c;
        if (mask && (key >= T || (p.causal && key > row))) s[i][j] = kNegInf;
        mx = fmaxf(mx, s[i][j]);
      }
      // Every processed tile holds at least one visible key per row, so m_new is finite.
      const float m_new = fmaxf(m[i], row_max16(mx));
      const float alpha = fast_exp2(m[i] - m_new);
      m[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = fast_exp2(s[i][j] - m_new);
        sum += s[i][j];
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int e = 0; e < D / 16; ++e) acc[i][e] *= alpha;
    }
    store_t(Ps, s, tx, ty);
    __syncthreads();
    mm_pv<D>(acc, Ps, Vs + stage * tile_floats<D>(), tx, ty);
    __syncthreads();  // P and this stage are overwritten next
  }

  float inv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    l[i] = row_sum16(l[i]);
    inv[i] = 1.f / l[i];
  }
  store_rows<D>(slice_mut<float>(p.o, b, h), p.o.st, q0, T, acc, inv, tx, ty);
  if (tx == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + 4 * ty + i;
      if (row < T) p.lse[int64_t(bh) * T + row] = m[i] * kLn2 + logf(l[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, dQ (and Dsum). Shared: Q, dO, K, V, dS, lse·log2e and Dsum of the 64 rows.
template <int D>
constexpr int bwd_dq_smem_bytes() {
  return (4 * tile_floats<D>() + kTile * kLdS + 2 * kTile) * 4;
}

template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) fa32_bwd_dq_kernel(FlashBwdParams p) {
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);
  float* dOs = Qs + tile_floats<D>();
  float* Ks = dOs + tile_floats<D>();
  float* Vs = Ks + tile_floats<D>();
  float* dSs = Vs + tile_floats<D>();
  float* lse_s = dSs + kTile * kLdS;
  float* dsum_s = lse_s + kTile;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16, lane = tid % 32, warp = tid / 32;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int T = p.T;
  const int nt = (T + kTile - 1) / kTile;
  const int qt = nt - 1 - int(blockIdx.y);
  const int q0 = qt * kTile;
  const int nk = p.causal ? qt + 1 : nt;
  const float* kb = slice<float>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
  const float* vb = slice<float>(p.v, b, h / p.group);

  load_tile<D>(Qs, slice<float>(p.q, b, h), p.q.st, q0, T, tid);
  load_tile<D>(dOs, slice<float>(p.dout, b, h), p.dout.st, q0, T, tid);
  cp_async_commit();

  // Dsum of rows q0 + 8·warp .. +7, from global memory (a warp per row, D/32 columns per lane).
  {
    const float* ob = slice<float>(p.o, b, h);
    const float* dob = slice<float>(p.dout, b, h);
    for (int r = warp * 8; r < warp * 8 + 8; ++r) {
      const int row = q0 + r;
      float acc = 0.f;
      if (row < T) {
#pragma unroll
        for (int e = 0; e < D / 32; ++e)
          acc += ob[int64_t(row) * p.o.st + lane + 32 * e] * dob[int64_t(row) * p.dout.st + lane + 32 * e];
      }
      acc = warp_sum(acc);
      if (lane == 0) {
        dsum_s[r] = acc;
        lse_s[r] = row < T ? p.lse[int64_t(bh) * T + row] * kLog2e : kPosInf;
        if (row < T) p.dsum[int64_t(bh) * T + row] = acc;
      }
    }
  }
  __syncthreads();
  float lse2[4], dsum[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lse2[i] = lse_s[4 * ty + i];
    dsum[i] = dsum_s[4 * ty + i];
  }

  const float c = p.scale * kLog2e;
  float acc[4][D / 16] = {};
  for (int kt = 0; kt < nk; ++kt) {
    const int k0 = kt * kTile;
    load_tile<D>(Ks, kb, p.k.st, k0, T, tid);
    load_tile<D>(Vs, vb, p.v.st, k0, T, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float s[4][4] = {}, dp[4][4] = {};
    mm_abt<D>(s, Qs, Ks, tx, ty);
    mm_abt<D>(dp, dOs, Vs, tx, ty);
    const bool mask = k0 + kTile > T || (p.causal && kt == qt);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + 4 * ty + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = k0 + tx + 16 * j;
        float pij = fast_exp2(fmaf(s[i][j], c, -lse2[i]));
        if (mask && (key >= T || (p.causal && key > row))) pij = 0.f;
        s[i][j] = pij * (dp[i][j] - dsum[i]) * p.scale;
      }
    }
    store_t(dSs, s, tx, ty);
    __syncthreads();
    mm_pv<D>(acc, dSs, Ks, tx, ty);
    __syncthreads();
  }
  const float one[4] = {1.f, 1.f, 1.f, 1.f};
  store_rows<D>(slice_mut<float>(p.dq, b, h), p.dq.st, q0, T, acc, one, tx, ty);
}

// ---------------------------------------------------------------------------------------------
// Backward, dK and dV. Shared: K, V, Q, dO, P, dS, lse·log2e and Dsum of the query tile.
template <int D>
constexpr int bwd_dkv_smem_bytes() {
  return (4 * tile_floats<D>() + 2 * kTile * kLdS + 2 * kTile) * 4;
}

template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) fa32_bwd_dkv_kernel(FlashBwdParams p) {
  extern __shared__ float4 smem4[];
  float* Ks = reinterpret_cast<float*>(smem4);
  float* Vs = Ks + tile_floats<D>();
  float* Qs = Vs + tile_floats<D>();
  float* dOs = Qs + tile_floats<D>();
  float* Ps = dOs + tile_floats<D>();
  float* dSs = Ps + kTile * kLdS;
  float* lse_s = dSs + kTile * kLdS;
  float* dsum_s = lse_s + kTile;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int Hkv = p.H / p.group;  // the grid's x is (batch, key/value head)
  const int b = int(blockIdx.x) / Hkv, hk = int(blockIdx.x) % Hkv;
  const int T = p.T;
  const int nt = (T + kTile - 1) / kTile;
  const int kt = int(blockIdx.y);  // causal: the first key tiles see the most queries
  const int k0 = kt * kTile;

  load_tile<D>(Ks, slice<float>(p.k, b, hk), p.k.st, k0, T, tid);
  load_tile<D>(Vs, slice<float>(p.v, b, hk), p.v.st, k0, T, tid);

  const float c = p.scale * kLog2e;
  float dk[4][D / 16] = {}, dv[4][D / 16] = {};
  // The query tiles of each of hk's query heads in turn (Note [GQA backward]; one head without GQA).
  for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
    const int64_t bh = int64_t(b) * p.H + h;
    const float* qb = slice<float>(p.q, b, h);
    const float* dob = slice<float>(p.dout, b, h);
    const float* lse = p.lse + bh * T;
    const float* dsum_g = p.dsum + bh * T;
    for (int qt = p.causal ? kt : 0; qt < nt; ++qt) {
      const int q0 = qt * kTile;
      load_tile<D>(Qs, qb, p.q.st, q0, T, tid);
      load_tile<D>(dOs, dob, p.dout.st, q0, T, tid);
      cp_async_commit();
      if (tid < kTile) {
        const int row = q0 + tid;
        lse_s[tid] = row < T ? lse[row] * kLog2e : kPosInf;  // rows past T: P = 0
        dsum_s[tid] = row < T ? dsum_g[row] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();

      // Scores transposed: s[i][j] is key 4ty + i against query tx + 16j.
      float s[4][4] = {}, dp[4][4] = {};
      mm_abt<D>(s, Ks, Qs, tx, ty);
      mm_abt<D>(dp, Vs, dOs, tx, ty);
      const bool mask = p.causal && qt == kt;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int qi = tx + 16 * j;
        const float l2 = lse_s[qi], ds = dsum_s[qi];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float pij = fast_exp2(fmaf(s[i][j], c, -l2));
          if (mask && 4 * ty + i > qi) pij = 0.f;
          s[i][j] = pij;
          dp[i][j] = pij * (dp[i][j] - ds) * p.scale;
        }
      }
      store_t(Ps, s, tx, ty);
      store_t(dSs, dp, tx, ty);
      __syncthreads();
      mm_pv<D>(dv, Ps, dOs, tx, ty);
      mm_pv<D>(dk, dSs, Qs, tx, ty);
      __syncthreads();
    }
  }
  const float one[4] = {1.f, 1.f, 1.f, 1.f};
  store_rows<D>(slice_mut<float>(p.dk, b, hk), p.dk.st, k0, T, dk, one, tx, ty);
  store_rows<D>(slice_mut<float>(p.dv, b, hk), p.dv.st, k0, T, dv, one, tx, ty);
}

template <int D>
void fwd_f32(const FlashFwdParams& p, cudaStream_t stream) {
  launch_tiles<fa32_fwd_kernel<D>>(p, kTile, kThreads, fwd_smem_bytes<D>(), "flash_attention", stream);
}

template <int D>
void bwd_f32(const FlashBwdParams& p, cudaStream_t stream) {
  BLU_ASSERT(p.dsum, "flash_attention_backward: the f32 path needs the dsum scratch");
  launch_tiles<fa32_bwd_dq_kernel<D>>(p, kTile, kThreads, bwd_dq_smem_bytes<D>(), "flash_attention_backward", stream);
  launch_tiles<fa32_bwd_dkv_kernel<D>>(p, kTile, kThreads, bwd_dkv_smem_bytes<D>(), "flash_attention_backward",
                                       stream, p.H / p.group);
}

}  // namespace

}  // namespace blu::cuda::flash
