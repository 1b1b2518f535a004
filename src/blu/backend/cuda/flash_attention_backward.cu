// Flash-attention backward on CUDA: the "flash_attention_backward" kernel of ops/attention.cpp.
// With P = exp(S·scale − lse) recomputed from the saved logsumexp, and Dsum = rowsum(dO ∘ O):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − Dsum) · scale,  dQ = dS·K,  dK = dSᵀ·Q.
//
// 1. preprocess: Dsum per row (one 16-byte vector of O and dO per thread), and the fp32 dQ accumulator
//    zeroed by the same kernel.
// 2. Tensor-core kernel (bf16/f16), FlashAttention-2 style: a CTA of 4 warps owns 64 keys (16 per
//    warp) and walks the query tiles of 64 rows that can see them (causal: from the diagonal on),
//    Q and dO tiles (with their lse and Dsum) double-buffered by cp.async; each tile is taken in
//    slices of 16 queries to bound registers (168 at D = 64: 3 CTAs per SM). Each warp computes
//    Sᵀ and dPᵀ for its 16 keys (keys as rows, so P and dS land in registers already shaped as A operands for dV += Pᵀ·dO
//    and dK += dSᵀ·Q, which stay in registers for the whole walk). dSᵀ goes to shared memory once,
//    and the 4 warps then compute dQ_tile = dS·K (16 query rows each) and add it to the fp32
//    accumulator with float2 atomics.
//    Determinism: dK and dV are deterministic; dQ is summed by atomics in an order that may vary
//    between runs (differences at fp32 rounding level before the final cast).
//    GQA (p.group > 1): a CTA owns 64 keys of one key/value head and walks the query tiles of each
//    of its group's query heads in turn (Note [GQA backward]; the Gqa instantiation).
// 3. dQ = accumulator cast to the output dtype.
// On Hopper (sm_90a build, compute capability 9.0) step 2 is the wgmma kernel of
// flash_attention_wgmma_backward.cu instead (set_flash_attention_wgmma_backward(false) keeps it here).
// f32: the TF32 tensor-core kernels of flash_attention_tf32.cu.
#include "blu/backend/backend.h"
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_f32.h"
#include "blu/backend/cuda/flash_attention_wgmma.h"
#include "blu/backend/cuda/rotary.cuh"
#include "blu/backend/cuda/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>

namespace blu::cuda {

namespace flash {

// ---------------------------------------------------------------------------------------------
// Dsum[row] = Σ_d dO[row, d] · O[row, d], and (when dq_accum is set) the row of the fp32 dQ
// accumulator zeroed, in one pass: D/V threads per row, each with one 16-byte vector (V elements)
// of O and of dO, summed across its row's threads by shuffles, and V floats of dq_accum cleared.
// One kernel instead of a memset plus a warp-per-row kernel of 4-byte loads: on an H200 at GPT-2
// shapes (B16 H12 T1024 D64, bf16) the two take 37.3 µs + the memset's ~12 µs, this one 24.9 µs
// (ncu).
template <typename T, int D>
__global__ void __launch_bounds__(256) flash_bwd_dsum_kernel(FlashBwdParams p) {
  constexpr int V = 16 / int(sizeof(T));  // elements per 16-byte vector
  constexpr int TPR = D / V;              // threads per row: 8 (16-bit, D 64) to 32 (f32, D 128)
  static_assert(TPR <= 32 && 32 % TPR == 0 && V % 4 == 0, "a row's threads within one warp");
  const int64_t rows = int64_t(p.B) * p.H * p.T;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / TPR;
  const int part = int(threadIdx.x) % TPR;
  const bool valid = row < rows;  // a row's threads are all valid or all not (shuffles below)
  float acc = 0.f;
  if (valid) {
    const int i = int(row % p.T);
    const int bh = int(row / p.T), b = bh / p.H, h = bh % p.H;
    union {
      uint4 u;
      T e[V];
    } o, d;
    o.u = __ldg(reinterpret_cast<const uint4*>(slice<T>(p.o, b, h) + int64_t(i) * p.o.st) + part);
    d.u = __ldg(reinterpret_cast<const uint4*>(slice<T>(p.dout, b, h) + int64_t(i) * p.dout.st) + part);
#pragma unroll
    for (int e = 0; e < V; ++e) acc += Elem<T>::load(&o.e[e]) * Elem<T>::load(&d.e[e]);
    if (p.dq_accum) {
      float4* z = reinterpret_cast<float4*>(p.dq_accum + row * D) + part * (V / 4);
#pragma unroll
      for (int j = 0; j < V / 4; ++j) z[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#pragma unroll
  for (int off = TPR / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (valid && part == 0) p.dsum[row] = acc;
}

// Blocks of 256 threads for flash_bwd_dsum_kernel<T, D>.
template <typename T, int D>
unsigned dsum_blocks(const FlashBwdParams& p) {
  const int64_t threads = int64_t(p.B) * p.H * p.T * (D * int64_t(sizeof(T)) / 16);
  const int64_t blocks = (threads + 255) / 256;
  BLU_CHECK(blocks <= 0x7fffffff, "flash_attention_backward: too many rows");
  return unsigned(blocks);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core backward.
constexpr int kBwdBQ = 64, kBwdBK = 64, kBwdThreads = 128;
// Sᵀ, dPᵀ and their dV/dK products go through the query tile in kBwdSplit slices of
// BQ / kBwdSplit queries: with dK and dV resident (64 registers at D = 64), the live set of a
// whole tile of Sᵀ and dPᵀ (64 more) held the kernel at 2 CTAs per SM. Slices of 16 fit 168
// registers (3 CTAs) at the price of reloading the K/V A fragments per slice.
constexpr int kBwdSplit = 4;

template <int D>
constexpr int bwd_smem_bytes() {
  // K, V [BK][D]; Q, dO [2][BQ][D]; dSᵀ [BK][BQ] (16-bit); lse and Dsum [2][BQ] (fp32).
  return (2 * kBwdBK * D + 4 * kBwdBQ * D + kBwdBK * kBwdBQ) * 2 + 4 * kBwdBQ * 4;
}

// Registers capped for 3 CTAs (12 warps) per SM at D = 64; D = 128 keeps the 2-CTA budget.
template <int D>
constexpr int bwd_min_blocks() { return D == 64 ? 3 : 2; }

// Gqa: the CTA's query tiles are those of its key/value head's `group` query heads (Note [GQA
// backward]); false: of the one head, its query tiles in order.
template <typename T, int D, bool Gqa>
__global__ void __launch_bounds__(kBwdThreads, bwd_min_blocks<D>()) flash_bwd_mma_kernel(FlashBwdParams p) {
  constexpr int BQ = kBwdBQ, BK = kBwdBK;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // [BK][D]
  T* sV = sK + BK * D;                     // [BK][D]
  T* sQ = sV + BK * D;                     // [2][BQ][D]
  T* sdO = sQ + 2 * BQ * D;                // [2][BQ][D]
  T* sdS = sdO + 2 * BQ * D;               // [BK][BQ]: dSᵀ, keys as rows
  float* sL = reinterpret_cast<float*>(sdS + BK * BQ);  // [2][BQ] lse
  float* sDs = sL + 2 * BQ;                             // [2][BQ] Dsum

  // Key tile in the slowest grid dimension: causal, the heavy tiles (small k0, most queries)
  // are launched first. The grid's x is (batch, key/value head).
  const int kt = int(blockIdx.y);
  const int Hkv = Gqa ? p.H / p.group : p.H;
  const int b = int(blockIdx.x) / Hkv, hk = int(blockIdx.x) % Hkv;
  const int k0 = kt * BK;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  const int qt_begin = p.causal ? k0 / BQ : 0;
  const int num_qt = (p.T + BQ - 1) / BQ;
  const int G = Gqa ? p.group : 1, n_tiles = G * (num_qt - qt_begin);  // GQA: the walk's length
  // Without GQA the one query head's operands (with GQA those of head hk·G, the first).
  const int64_t bh = int64_t(b) * p.H + hk * G;
  const T* Qg = slice<T>(p.q, b, hk * G);
  const T* dOg = slice<T>(p.dout, b, hk * G);
  const float* lse_g = p.lse + bh * p.T;
  const float* dsum_g = p.dsum + bh * p.T;
  float* dq_acc_g = p.dq_accum + bh * p.T * D;

  load_tile_async<T, D, BK, kBwdThreads>(sK, slice<T>(p.k, b, hk), p.k.st, k0, p.T, tid);
  load_tile_async<T, D, BK, kBwdThreads>(sV, slice<T>(p.v, b, hk), p.v.st, k0, p.T, tid);
  // Q, dO, lse, Dsum of query tile qt of query head h (hk·G without GQA) into `stage`.
  auto load_q_tile = [&](int h, int qt, int stage) {
    const int64_t bhq = int64_t(b) * p.H + h;
    const T* Qh = Gqa ? slice<T>(p.q, b, h) : Qg;
    const T* dOh = Gqa ? slice<T>(p.dout, b, h) : dOg;
    const float* lse_h = Gqa ? p.lse + bhq * p.T : lse_g;
    const float* dsum_h = Gqa ? p.dsum + bhq * p.T : dsum_g;
    load_tile_async<T, D, BQ, kBwdThreads>(sQ + stage * BQ * D, Qh, p.q.st, qt * BQ, p.T, tid);
    load_tile_async<T, D, BQ, kBwdThreads>(sdO + stage * BQ * D, dOh, p.dout.st, qt * BQ, p.T, tid);
    for (int i = tid; i < BQ; i += kBwdThreads) {
      const int q = qt * BQ + i;
      cp_async_4(sL + stage * BQ + i, lse_h + (q < p.T ? q : 0), q < p.T);
      cp_async_4(sDs + stage * BQ + i, dsum_h + (q < p.T ? q : 0), q < p.T);
    }
  };
  load_q_tile(hk * G, qt_begin, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];  // this warp's 16 keys x D; n-tile j holds columns 8j..8j+7
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int key_lo = k0 + warp * 16 + g;  // this thread's keys: key_lo and key_lo + 8

  // The walk (Note [GQA backward]): query tiles qt_begin.. of head h, then (GQA) of head h + 1.
  int h = hk * G;
  for (int qt = qt_begin, it = 0; Gqa ? it < n_tiles : qt < num_qt; ++qt, ++it) {
    if (Gqa && qt == num_qt) qt = qt_begin, ++h;
    const int stage = it & 1;
    if (Gqa ? it + 1 < n_tiles : qt + 1 < num_qt) {
      if (!Gqa || qt + 1 < num_qt) load_q_tile(h, qt + 1, stage ^ 1);
      else load_q_tile(h + 1, qt_begin, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* q_s = sQ + stage * BQ * D;
    const T* do_s = sdO + stage * BQ * D;
    const float* l_s = sL + stage * BQ;
    const float* ds_s = sDs + stage * BQ;
    const int q0 = qt * BQ;
    float* dq_acc = Gqa ? p.dq_accum + (int64_t(b) * p.H + h) * p.T * D : dq_acc_g;

    // The query tile in kBwdSplit slices of HQ queries (see kBwdSplit).
    const bool need_mask = q0 + BQ > p.T || k0 + BK > p.T || (p.causal && q0 < k0 + BK - 1);
#pragma unroll
    for (int hq = 0; hq < kBwdSplit; ++hq) {
      constexpr int HQ = BQ / kBwdSplit;
      // Sᵀ = K_w·Qᵀ and dPᵀ = V_w·dOᵀ (16 keys x HQ queries). A = 16 rows of K (V) of this warp,
      // (rows 0-7, d 0-7), (rows 8-15, d 0-7), (rows 0-7, d 8-15), (rows 8-15, d 8-15); B[k=d][n=q]
      // = Q[q][d] (dO[q][d]): non-transposed blocks, as K in the forward.
      float st[HQ / 8][4], dpt[HQ / 8][4];
#pragma unroll
      for (int j = 0; j < HQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4], va[4];
        const int arow = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = kk * 16 + (lane >> 4) * 8;
        ldmatrix_x4(ka, sK + swz<D>(arow, acol));
        ldmatrix_x4(va, sV + swz<D>(arow, acol));
#pragma unroll
        for (int nn = 0; nn < HQ / 16; ++nn) {
          const int brow = hq * HQ + nn * 16 + (lane & 7) + (lane >> 4) * 8, bcol = kk * 16 + ((lane >> 3) & 1) * 8;
          uint32_t r[4], s[4];
          ldmatrix_x4(r, q_s + swz<D>(brow, bcol));
          ldmatrix_x4(s, do_s + swz<D>(brow, bcol));
          mma_16816<T>(st[2 * nn], ka, r[0], r[1]);
          mma_16816<T>(st[2 * nn + 1], ka, r[2], r[3]);
          mma_16816<T>(dpt[2 * nn], va, s[0], s[1]);
          mma_16816<T>(dpt[2 * nn + 1], va, s[2], s[3]);
        }
      }

      // Pᵀ and dSᵀ. Element (j, e): key key_lo + 8(e>>1), query q0 + hq·HQ + 8j + 2t + (e&1).
#pragma unroll
      for (int j = 0; j < HQ / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = hq * HQ + j * 8 + 2 * t + (e & 1);
          float pv = fast_exp2(st[j][e] * sl2 - l_s[qi] * kLog2e);
          if (need_mask) {
            const int key = key_lo + (e >> 1) * 8, q = q0 + qi;
            if (q >= p.T || key >= p.T || (p.causal && key > q)) pv = 0.f;
          }
          st[j][e] = pv;
          dpt[j][e] = pv * (dpt[j][e] - ds_s[qi]) * p.scale;
        }

      // dV += Pᵀ·dO and dK += dSᵀ·Q. A from registers (k step kk = queries hq·HQ + 16kk.. +15:
      // n-tiles 2kk and 2kk+1); B[k=q][n=d] = dO[q][d] (Q[q][d]): transposed blocks, as V in the
      // forward.
#pragma unroll
      for (int kk = 0; kk < HQ / 16; ++kk) {
        uint32_t pa[4], dsa[4];
        pa[0] = Elem<T>::pack(st[2 * kk][0], st[2 * kk][1]);
        pa[1] = Elem<T>::pack(st[2 * kk][2], st[2 * kk][3]);
        pa[2] = Elem<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
        pa[3] = Elem<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
        dsa[0] = Elem<T>::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
        dsa[1] = Elem<T>::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
        dsa[2] = Elem<T>::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
        dsa[3] = Elem<T>::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
        // dSᵀ to shared memory: rows = keys (warp*16 + g, +8), columns = queries.
        const int qc = hq * HQ + kk * 16 + 2 * t;
        *reinterpret_cast<uint32_t*>(sdS + swz<BQ>(warp * 16 + g, qc)) = dsa[0];
        *reinterpret_cast<uint32_t*>(sdS + swz<BQ>(warp * 16 + g + 8, qc)) = dsa[1];
        *reinterpret_cast<uint32_t*>(sdS + swz<BQ>(warp * 16 + g, qc + 8)) = dsa[2];
        *reinterpret_cast<uint32_t*>(sdS + swz<BQ>(warp * 16 + g + 8, qc + 8)) = dsa[3];
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {
          const int brow = hq * HQ + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, bcol = nn * 16 + (lane >> 4) * 8;
          uint32_t r[4], s[4];
          ldmatrix_x4_trans(r, do_s + swz<D>(brow, bcol));
          ldmatrix_x4_trans(s, q_s + swz<D>(brow, bcol));
          mma_16816<T>(dv[2 * nn], pa, r[0], r[1]);
          mma_16816<T>(dv[2 * nn + 1], pa, r[2], r[3]);
          mma_16816<T>(dk[2 * nn], dsa, s[0], s[1]);
          mma_16816<T>(dk[2 * nn + 1], dsa, s[2], s[3]);
        }
      }
    }
    __syncthreads();

    // dQ_tile = dS·K: warp w takes query rows 16w..16w+15. A[q][key] = dSᵀ[key][q]: transposed
    // blocks of sdS, matrices (q 0-7, keys 0-7), (q 8-15, keys 0-7), (q 0-7, keys 8-15),
    // (q 8-15, keys 8-15). B[k=key][n=d] = K[key][d]: transposed blocks.
    uint32_t dsq[BK / 16][4];
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      ldmatrix_x4_trans(dsq[kk], sdS + swz<BQ>(kk * 16 + (lane & 7) + (lane >> 4) * 8, warp * 16 + ((lane >> 3) & 1) * 8));
    const int qrow = q0 + warp * 16 + g;
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, sK + swz<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, nn * 16 + (lane >> 4) * 8));
        mma_16816<T>(c[0], dsq[kk], r[0], r[1]);
        mma_16816<T>(c[1], dsq[kk], r[2], r[3]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = nn * 16 + half * 8 + 2 * t;
        if (qrow < p.T) atomic_add2(dq_acc + int64_t(qrow) * D + col, c[half][0], c[half][1]);
        if (qrow + 8 < p.T) atomic_add2(dq_acc + int64_t(qrow + 8) * D + col, c[half][2], c[half][3]);
      }
    }
    // The next iteration's first __syncthreads() orders these sdS reads before its sdS writes;
    // its prefetch writes the stage this iteration read before the __syncthreads() above.
  }

  // Epilogue: dK, dV rows of this warp.
  T* dKg = slice_mut<T>(p.dk, b, hk);
  T* dVg = slice_mut<T>(p.dv, b, hk);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + r * 8;
    if (key >= p.T) continue;
    T* dkr = dKg + int64_t(key) * p.dk.st;
    T* dvr = dVg + int64_t(key) * p.dv.st;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<uint32_t*>(dkr + j * 8 + 2 * t) = Elem<T>::pack(dk[j][2 * r], dk[j][2 * r + 1]);
      *reinterpret_cast<uint32_t*>(dvr + j * 8 + 2 * t) = Elem<T>::pack(dv[j][2 * r], dv[j][2 * r + 1]);
    }
  }
}

// dQ = the fp32 accumulator [B, H, T, D] (contiguous) cast into the strided output; 4 elements per thread.
template <typename T, int D>
__global__ void flash_bwd_dq_convert_kernel(FlashBwdParams p) {
  const int64_t n4 = int64_t(p.B) * p.H * p.T * D / 4;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n4;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = idx * 4;
    const int d = int(e % D);
    const int64_t row = e / D;
    const int i = int(row % p.T);
    const int bh = int(row / p.T), b = bh / p.H, h = bh % p.H;
    const float4 v = reinterpret_cast<const float4*>(p.dq_accum)[idx];
    T* dst = slice_mut<T>(p.dq, b, h) + int64_t(i) * p.dq.st + d;
    uint2 packed;
    packed.x = Elem<T>::pack(v.x, v.y);
    packed.y = Elem<T>::pack(v.z, v.w);
    *reinterpret_cast<uint2*>(dst) = packed;
  }
}

// ---------------------------------------------------------------------------------------------
template <typename T, int D>
bool launch_bwd_mma(const FlashBwdParams& p, DType dtype, cudaStream_t stream) {
  BLU_ASSERT(p.dq_accum, "flash_attention_backward: the tensor-core path needs dq_accum");
  const int64_t n = int64_t(p.B) * p.H * p.T * D;
  flash_bwd_dsum_kernel<T, D><<<dsum_blocks<T, D>(p), 256, 0, stream>>>(p);  // also zeroes dq_accum
  BLU_CUDA_CHECK_LAUNCH();

  if (flash_attention_wgmma_backward() && flash_attention_wgmma_available()) {
    flash_attention_backward_wgmma(p, dtype, stream);  // casts dq itself, rotated back under RoPE
    return p.rope_cos != nullptr;
  }
  if (p.group > 1)
    launch_tiles<flash_bwd_mma_kernel<T, D, true>>(p, kBwdBK, kBwdThreads, bwd_smem_bytes<D>(),
                                                   "flash_attention_backward", stream, p.H / p.group);
  else
    launch_tiles<flash_bwd_mma_kernel<T, D, false>>(p, kBwdBK, kBwdThreads, bwd_smem_bytes<D>(),
                                                    "flash_attention_backward", stream);
  flash_bwd_dq_convert_kernel<T, D><<<grid_for(n / 4), 256, 0, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
  return false;
}

template <int D>
bool bwd_dispatch_d(const FlashBwdParams& p, DType dtype, cudaStream_t s) {
  switch (dtype) {
    case DType::f32: flash_attention_backward_f32(p, s); return false;
    case DType::bf16: return launch_bwd_mma<__nv_bfloat16, D>(p, dtype, s);
    case DType::f16: return launch_bwd_mma<__half, D>(p, dtype, s);
    default: BLU_ASSERT(false, "flash_attention_backward: unsupported dtype ", dtype);
  }
  return false;
}

}  // namespace flash

namespace {
// BLU_FLASH_WGMMA_BWD=0 in the environment starts with the wgmma backward off (the mma.sync one runs).
std::atomic<bool> g_wgmma_bwd{[] {
  const char* e = std::getenv("BLU_FLASH_WGMMA_BWD");
  return !(e && std::string_view(e) == "0");
}()};
}  // namespace

void set_flash_attention_wgmma_backward(bool on) { g_wgmma_bwd.store(on); }
bool flash_attention_wgmma_backward() { return g_wgmma_bwd.load(); }

bool flash_attention_backward(const FlashBwdParams& p, DType dtype, cudaStream_t stream) {
  BLU_ASSERT(flash_attention_supported(dtype, p.D), "flash_attention_backward: ", dtype, " D=", p.D);
  if (int64_t(p.B) * p.H * p.T == 0) return p.rope_cos != nullptr;
  if (p.D == 64) return flash::bwd_dispatch_d<64>(p, dtype, stream);
  return flash::bwd_dispatch_d<128>(p, dtype, stream);
}

namespace {

// Heads [first, first + n) of a contiguous [B, T, heads·D...] buffer whose rows (dim 1) hold
// D-element heads side by side ([B, T, 3, H, D] or [B, T, H + 2·Hkv, D]), as a [B, n, T, D] operand.
AttnOperand operand_heads(const Tensor& packed, int64_t first, int64_t D) {
  return {static_cast<char*>(packed.raw_data()) + first * D * int64_t(packed.itemsize()), packed.stride(0), D,
          packed.stride(1)};
}

// "flash_attention_backward": in dO, q, o ([B, H, T, D], strided), k, v ([B, Hkv, T, D], strided),
// lse [B, H, T], and under RoPE (packed only) its cos, sin tables [T, D] f32; attrs causal, scale,
// packed. Out: dq, dk, dv side by side in one contiguous buffer (packed: [B, T, 3, H, D] or
// [B, T, H + 2·Hkv, D]) or as three contiguous [B, T, H, D], [B, T, Hkv, D], [B, T, Hkv, D]
// buffers. Under RoPE dq and dk are rotated back (the gradients of q and k before RoPE): by the
// wgmma backward where that runs, else in place by rotary_backward_heads_in_place.
void flash_attention_backward_kernel(const KernelCall& c) {
  const Tensor& q = c.in[1];
  FlashBwdParams p;
  p.dout = operand_bhtd(c.in[0]);
  p.q = operand_bhtd(q);
  p.k = operand_bhtd(c.in[2]);
  p.v = operand_bhtd(c.in[3]);
  p.o = operand_bhtd(c.in[4]);
  p.lse = static_cast<const float*>(c.in[5].raw_data());
  p.B = int(q.size(0));
  p.H = int(q.size(1));
  p.T = int(q.size(2));
  p.D = int(q.size(3));
  const int Hkv = int(c.in[2].size(1));
  p.group = std::max(1, p.H / Hkv);  // (the op checked H % Hkv == 0)
  if (c.out.size() == 1) {
    p.dq = operand_heads(c.out[0], 0, p.D);
    p.dk = operand_heads(c.out[0], p.H, p.D);
    p.dv = operand_heads(c.out[0], p.H + Hkv, p.D);
  } else {
    p.dq = operand_bthd(c.out[0]);
    p.dk = operand_bthd(c.out[1]);
    p.dv = operand_bthd(c.out[2]);
  }
  p.scale = float(c.attrs.f("scale"));
  p.causal = c.attrs.b("causal");
  const int64_t rows = int64_t(p.B) * p.H * p.T;
  if (rows == 0) return;
  // Scratch from the call's workspace (Note [Execution context]).
  p.dsum = c.ctx.scratch->take<float>(size_t(rows));
  if (flash_attention_needs_dq_accum(q.dtype()))
    p.dq_accum = c.ctx.scratch->take<float>(size_t(flash_dq_accum_floats(p.B, p.H, p.T, p.D)));
  const bool rope = c.in.size() == 8;
  if (rope) {
    BLU_ASSERT(c.out.size() == 1, "flash_attention_backward: RoPE needs the packed gradient");
    p.rope_cos = static_cast<const float*>(c.in[6].raw_data());
    p.rope_sin = static_cast<const float*>(c.in[7].raw_data());
  }
  const bool rotated = flash_attention_backward(p, q.dtype(), stream_of(c.ctx));
  if (rope && !rotated) rotary_backward_heads_in_place(stream_of(c.ctx), c.out[0], 0, p.H + Hkv, c.in[6], c.in[7]);
}

BLU_REGISTER_KERNEL(cuda, "flash_attention_backward", flash_attention_backward_kernel);

}  // namespace

}  // namespace blu::cuda
