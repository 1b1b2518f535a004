// Flash attention for f32 on tensor cores (TF32 mma.sync m16n8k8, sm_80+), the default f32 path of
// flash_attention_forward / flash_attention_backward (flash_attention_f32.cu routes here).
//
// Numerics. Every product goes through mma.sync.m16n8k8 with TF32 operands (8 exponent bits, 10
// mantissa bits) and fp32 accumulation. The template parameter kSplit picks how an fp32 operand
// x becomes TF32: kSplit = 1 rounds it once (hi = tf32(x), cvt.rna: ~5e-4 relative per product,
// ~1e-3 on the outputs), the mode of MatmulPrecision::tf32; kSplit = 3 splits it as
// x ≈ hi + lo with lo = tf32(x − hi) (~2^-22 relative) and forms a·b ≈ lo_a·hi_b + hi_a·lo_b +
// hi_a·hi_b in three mma into one fp32 accumulator, small terms first (the 3xTF32 scheme of
// CUTLASS's FastF32, which PyTorch's fp32 attention uses): fp32-level accuracy (~1e-6 relative),
// the mode of MatmulPrecision::ieee. Operands are split in registers just before the mma that
// uses them; shared memory holds plain fp32. Softmax, rescaling and the epilogues stay in fp32.
//
// Fragments (g = lane / 4, t = lane % 4). m16n8k8.tf32: A a0 (row g, k t), a1 (row g+8, k t),
// a2 (row g, k t+4), a3 (row g+8, k t+4); B b0 (k t, col g), b1 (k t+4, col g); C c0, c1 (row g,
// cols 2t, 2t+1), c2, c3 (row g+8, same cols). A product only needs A's k index and B's k index
// to name the same element, so the kernels permute k freely:
//   - k = head dim (Q·Kᵀ and its backward forms): k step 2c+u takes d = 16c + 4t + 2u as k t and
//     d + 1 as k t+4, so one float4 at d = 16c + 4t feeds two k steps of both operands.
//   - k = keys or queries (P·V, Pᵀ·dO, dSᵀ·Q, dS·K): k step j takes key 8j + 2t as k t and
//     8j + 2t + 1 as k t+4, which is where the C fragment of the score tile already holds them
//     (c0/c1 are keys 8j+2t, 8j+2t+1): a score accumulator becomes an A fragment with no shuffles.
//   - The output columns (head dim) of those products are permuted too: column n of n-tile nn is
//     d = n·D/8 + nn, so a B row is read as float4 runs along nn, and each thread ends up holding
//     the contiguous run d ∈ [t·D/4, (t+1)·D/4) of its rows (float4 stores and atomics).
// Shared-memory tiles are fp32 [rows][D] with no padding; the 16-byte unit u of row r is stored
// at u ^ h(r) (low 3 bits; swz32 below). h is chosen so that both access patterns — float4 at
// rows 8j + g, d = 16c + 4t, and float4 at rows 8j + 2t + e, d = g·D/8 + 4q — touch 32 distinct
// banks in every quarter-warp. scripts/lab/flash_attention_tf32_check.py enumerates the lane
// addresses of every access ("banks") and runs these kernels lane by lane on the CPU ("emu").
//
// Forward: a CTA of 4 warps owns 64 query rows (16 per warp; the Q tile stays in shared memory
// and is re-read per key tile, which costs fewer registers than holding its fragments — 64 or 128
// of them at 3xTF32) and walks the K/V tiles (64 keys at D = 64, 32 at D = 128), double-buffered by
// cp.async. Per tile: S = Q·Kᵀ, mask (causal diagonal, sequence tail), online softmax in exp2
// with scale·log2e folded in, O = O·alpha + P·V. Writes O and the natural-log lse of the scaled
// scores. Causal: CTAs run heaviest first; a warp skips a tile that is entirely above its rows.
//
// Backward (P = exp(scale·S − lse), Dsum = rowsum(dO ∘ O), dS = P ∘ (dP − Dsum) · scale):
//   1. prep kernel, warp per row: Dsum into p.dsum, and the row of dq zeroed.
//   2. main kernel, FlashAttention-2 style: a CTA of 4 warps owns 64 keys (16 per warp; dK and dV
//      stay in registers for the whole walk) and walks the query tiles that see them (32 queries
//      at D = 64, 16 at D = 128; causal: from the diagonal on), Q, dO, lse and Dsum double-buffered
//      by cp.async. Per slice of 16 queries each warp forms Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for its keys,
//      then Pᵀ and dSᵀ in registers, dV += Pᵀ·dO and dK += dSᵀ·Q, and writes dSᵀ to shared memory.
//      After a barrier the 4 warps compute the tile's dQ = dS·K and add it into p.dq with float4
//      atomics (p.dq itself is the fp32 accumulator: no dq_accum scratch, no cast pass).
//   GQA: a CTA owns 64 keys of a key/value head and walks the query tiles of each of its group's
//   query heads in turn (Note [GQA backward]; the Gqa instantiation).
//   Why atomics rather than a separate dQ pass: a dQ pass recomputes S and dP (7 tile products per
//   (query, key) tile pair instead of 5), i.e. ~40% more tensor work at 3xTF32, where these kernels
//   are bound by the mma rate. The price is determinism: dK and dV are bitwise reproducible, dQ is
//   summed in an order that varies between runs (differences at fp32 rounding level, ~1e-7
//   relative).
//
// Resources (ptxas -v, sm_90, CUDA 13.0; kernel<D, kSplit>; no spills, no local memory unless noted):
//   fa_tf32_fwd_kernel<64, 1>   155 registers, 80 KB dynamic shared memory  → 2 CTAs / SM
//   fa_tf32_fwd_kernel<64, 3>   173 registers, 80 KB                        → 2 CTAs / SM
//   fa_tf32_fwd_kernel<128, 1>  180 registers, 96 KB                        → 2 CTAs / SM
//   fa_tf32_fwd_kernel<128, 3>  192 registers, 96 KB                        → 2 CTAs / SM
//   fa_tf32_bwd_kernel<64, 1>   165 registers, 73.5 KB (cap 168)            → 3 CTAs / SM
//   fa_tf32_bwd_kernel<64, 3>   164 registers, 73.5 KB (cap 168)            → 3 CTAs / SM
//   fa_tf32_bwd_kernel<128, 1>  246 registers, 101.25 KB                    → 2 CTAs / SM
//   fa_tf32_bwd_kernel<128, 3>  239 registers, 101.25 KB                    → 2 CTAs / SM
//   (the backwards above are the Gqa = false instantiations; with GQA, same shared memory:)
//   fa_tf32_bwd_kernel<64, 1, true>   165 registers                        → 3 CTAs / SM
//   fa_tf32_bwd_kernel<64, 3, true>   168 registers, 8 bytes spilled        → 3 CTAs / SM
//   fa_tf32_bwd_kernel<128, 1, true>  242 registers                        → 2 CTAs / SM
//   fa_tf32_bwd_kernel<128, 3, true>  243 registers                        → 2 CTAs / SM
//   fa_tf32_bwd_prep_kernel<D>   22 registers, no shared memory
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_f32.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/precision.h"

#include <atomic>

namespace blu::cuda::flash {

namespace {

constexpr int kThreads = 128;  // 4 warps
// Unroll factors of the loops whose bodies only change addresses (head-dim chunks, the key steps of
// dQ, tile-load chunks). Fully unrolled, the compiler hoists every loop-invariant address out of
// the tile walk and the kernels need 40-60 more registers (spilling at the occupancy targets).
constexpr int kUnrollD = 2, kUnrollDq = 2, kUnrollLoad = 1;

// --- TF32 operands ----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t tf32_rna(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// N fp32 values as TF32 operand registers: hi = tf32(x); with kSplit == 3 also lo = tf32(x − hi).
template <int kSplit, int N>
struct Tf32 {
  static_assert(kSplit == 1 || kSplit == 3, "1xTF32 or 3xTF32");
  uint32_t hi[N];
  uint32_t lo[kSplit == 3 ? N : 1];  // kSplit == 3 only
};
template <int kSplit, int N>
__device__ __forceinline__ Tf32<kSplit, N> to_tf32(const float (&x)[N]) {
  Tf32<kSplit, N> f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    f.hi[i] = tf32_rna(x[i]);
    if constexpr (kSplit == 3) f.lo[i] = tf32_rna(x[i] - __uint_as_float(f.hi[i]));
  }
  return f;
}

// D(16x8, f32) += A(16x8, tf32) · B(8x8, tf32); register order as in the header comment.
__device__ __forceinline__ void mma_1688(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a·b at the precision of kSplit; b is the pair (b0, b1) at index 2i, 2i+1 of `b`.
template <int kSplit, int NB>
__device__ __forceinline__ void mma_tf32(float (&c)[4], const Tf32<kSplit, 4>& a, const Tf32<kSplit, NB>& b,
                                         int i = 0) {
  if constexpr (kSplit == 3) {
    mma_1688(c, a.lo, b.hi[2 * i], b.hi[2 * i + 1]);
    mma_1688(c, a.hi, b.lo[2 * i], b.lo[2 * i + 1]);
  }
  mma_1688(c, a.hi, b.hi[2 * i], b.hi[2 * i + 1]);
}

// --- shared-memory tiles ----------------------------------------------------------------------
// Float index of (row, col) in a swizzled fp32 [rows][D] tile: 16-byte unit col/4 of row r sits
// at unit (col/4) ^ h(r) (h < 8). Conflict-free for the two fragment patterns (header comment):
//   rows 8j + g, d = 16c + 4t: rows 2i and 2i+1 share a quarter-warp, so h(2i) ^ h(2i+1) = 4;
//   rows 8j + 2t + e, d = g·D/8 + 4q: a quarter-warp has t = 0..3 and g = 0, 1, i.e. units
//   {x, x + D/32}, so h over the four rows must differ outside bit log2(D/32).
template <int D>
__device__ __forceinline__ int swz32(int r, int col) {
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  const int h = D == 64 ? (((r >> 1) & 1) | ((((r >> 2) ^ r) & 1) << 2)) : (((r >> 1) & 3) | ((r & 1) << 2));
  return r * D + (col ^ (h << 2));
}

template <int D>
__device__ __forceinline__ float4 lds4(const float* tile, int r, int col) {
  return *reinterpret_cast<const float4*>(tile + swz32<D>(r, col));
}

// Rows [r0, r0 + ROWS) of one (b, h) slice (row stride st) into a swizzled tile; rows >= T are
// zero-filled. Issues cp.async only: the caller commits and waits.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile_f32(float* tile, const float* base, int64_t st, int r0, int T, int tid) {
  constexpr int kChunks = D / 4;
  static_assert(ROWS * kChunks % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll(kUnrollLoad)
  for (int i = 0; i < ROWS * kChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r0 + r < T;
    const float* src = valid ? base + int64_t(r0 + r) * st + c * 4 : base;
    cp_async_16(tile + swz32<D>(r, c * 4), src, valid);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.
template <int D>
struct FwdCfg {
  static constexpr int BQ = 64;                 // query rows per CTA (16 per warp)
  static constexpr int BK = D == 64 ? 64 : 32;  // keys per tile
  static constexpr int kMinBlocks = 2;  // shared memory allows 2 CTAs per SM (80 / 96 KB)
  static constexpr int kSmemBytes = (BQ * D + 2 * 2 * BK * D) * 4;  // Q, 2 stages x (K, V)
};

template <int D, int kSplit>
__global__ void __launch_bounds__(kThreads, FwdCfg<D>::kMinBlocks) fa_tf32_fwd_kernel(FlashFwdParams p) {
  constexpr int BQ = FwdCfg<D>::BQ, BK = FwdCfg<D>::BK;
  extern __shared__ float4 smem4[];
  float* const sQ = reinterpret_cast<float*>(smem4);  // [BQ][D]
  float* const smem = sQ + BQ * D;                    // stage s: K at s·2·BK·D, V right after

  const int qt = int(gridDim.y) - 1 - int(blockIdx.y);  // heaviest (causal) first
  const int b = int(blockIdx.x) / p.H, h = int(blockIdx.x) % p.H;
  const int q0 = qt * BQ;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const float* Qg = slice<float>(p.q, b, h);
  const float* Kg = slice<float>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
  const float* Vg = slice<float>(p.v, b, h / p.group);
  const int kv_end = p.causal ? min(p.T, q0 + BQ) : p.T;
  const int num_kt = (kv_end + BK - 1) / BK;

  load_tile_f32<D, BQ>(sQ, Qg, p.q.st, q0, p.T, tid);
  load_tile_f32<D, BK>(smem, Kg, p.k.st, 0, p.T, tid);
  load_tile_f32<D, BK>(smem + BK * D, Vg, p.v.st, 0, p.T, tid);
  cp_async_commit();

  float o[D / 8][4];  // n-tile nn, column n holds d = n·D/8 + nn
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {kNegInf, kNegInf};  // running max of the raw scores, rows g and g+8
  float l[2] = {0.f, 0.f};          // running sum of exp, this thread's columns only
  const float sl2 = p.scale * kLog2e;
  const int row_lo = q0 + warp * 16 + g;  // rows row_lo and row_lo + 8

  for (int kt = 0; kt < num_kt; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < num_kt) {
      float* nxt = smem + (stage ^ 1) * 2 * BK * D;
      load_tile_f32<D, BK>(nxt, Kg, p.k.st, (kt + 1) * BK, p.T, tid);
      load_tile_f32<D, BK>(nxt + BK * D, Vg, p.v.st, (kt + 1) * BK, p.T, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const float* k_s = smem + stage * 2 * BK * D;
    const float* v_s = k_s + BK * D;
    const int k0 = kt * BK;

    // Causal: a tile whose first key is past this warp's last row adds nothing (P = 0, alpha = 1).
    if (!p.causal || k0 <= q0 + warp * 16 + 15) {
      // S = Q·Kᵀ (16 x BK). A = this warp's 16 rows of Q, B[k = d][n = key] = K[8j + g][d]: one
      // float4 per row and 16 d (k steps 2c, 2c+1).
      float s[BK / 8][4];
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll(kUnrollD)
      for (int c = 0; c < D / 16; ++c) {
        const float4 x = lds4<D>(sQ, warp * 16 + g, 16 * c + 4 * t);
        const float4 y = lds4<D>(sQ, warp * 16 + g + 8, 16 * c + 4 * t);
        const Tf32<kSplit, 4> a0 = to_tf32<kSplit, 4>({x.x, y.x, x.y, y.y});
        const Tf32<kSplit, 4> a1 = to_tf32<kSplit, 4>({x.z, y.z, x.w, y.w});
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
          const float4 z = lds4<D>(k_s, 8 * j + g, 16 * c + 4 * t);
          const Tf32<kSplit, 4> bz = to_tf32<kSplit, 4>({z.x, z.y, z.z, z.w});
          mma_tf32<kSplit>(s[j], a0, bz, 0);
          mma_tf32<kSplit>(s[j], a1, bz, 1);
        }
      }

      // Mask the causal diagonal and keys past the end. Element (j, e): key k0 + 8j + 2t + (e & 1),
      // row row_lo + 8·(e >> 1).
      if (k0 + BK > p.T || (p.causal && k0 + BK - 1 > q0 + warp * 16)) {
#pragma unroll
        for (int j = 0; j < BK / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + j * 8 + 2 * t + (e & 1);
            const int row = row_lo + (e >> 1) * 8;
            if (key >= p.T || (p.causal && key > row)) s[j][e] = kNegInf;
          }
      }

      // Online softmax; a row's BK columns are spread over the 4 threads of a quad.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float msub = mx == kNegInf ? 0.f : mx * sl2;  // a fully masked row so far stays at 0
        const float alpha = fast_exp2(m[r] * sl2 - msub);
        m[r] = mx;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
          s[j][2 * r] = fast_exp2(fmaf(s[j][2 * r], sl2, -msub));
          s[j][2 * r + 1] = fast_exp2(fmaf(s[j][2 * r + 1], sl2, -msub));
          rs += s[j][2 * r] + s[j][2 * r + 1];
        }
        l[r] = l[r] * alpha + rs;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          o[j][2 * r] *= alpha;
          o[j][2 * r + 1] *= alpha;
        }
      }

      // O += P·V. k step j = keys 8j + 2t (k t), 8j + 2t + 1 (k t+4): A straight from s[j].
      // B[k = key][n] = V[key][n·D/8 + nn]: float4 runs along nn, rows 8j + 2t and 8j + 2t + 1.
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
        const Tf32<kSplit, 4> a = to_tf32<kSplit, 4>({s[j][0], s[j][2], s[j][1], s[j][3]});
#pragma unroll
        for (int q = 0; q < D / 32; ++q) {
          const float4 v0 = lds4<D>(v_s, 8 * j + 2 * t, g * (D / 8) + 4 * q);
          const float4 v1 = lds4<D>(v_s, 8 * j + 2 * t + 1, g * (D / 8) + 4 * q);
          const Tf32<kSplit, 8> bv = to_tf32<kSplit, 8>({v0.x, v1.x, v0.y, v1.y, v0.z, v1.z, v0.w, v1.w});
#pragma unroll
          for (int i = 0; i < 4; ++i) mma_tf32<kSplit>(o[4 * q + i], a, bv, i);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before the next prefetch overwrites it
  }

  // Epilogue: complete the row sums across the quad, normalise, store O and the logsumexp. Row
  // element 2r + e of n-tile nn is d = (2t + e)·D/8 + nn: runs of D/8 along nn.
  float* Og = slice_mut<float>(p.o, b, h);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    const int row = row_lo + r * 8;
    if (row >= p.T) continue;
    const float inv = lr > 0.f ? 1.f / lr : 0.f;
    float* orow = Og + int64_t(row) * p.o.st;
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int q = 0; q < D / 32; ++q)
        *reinterpret_cast<float4*>(orow + (2 * t + e) * (D / 8) + 4 * q) =
            make_float4(o[4 * q][2 * r + e] * inv, o[4 * q + 1][2 * r + e] * inv, o[4 * q + 2][2 * r + e] * inv,
                        o[4 * q + 3][2 * r + e] * inv);
    if (t == 0) p.lse[(int64_t(b) * p.H + h) * p.T + row] = lr > 0.f ? m[r] * p.scale + logf(lr) : kNegInf;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 1: Dsum[row] = Σ_d dO[row, d]·O[row, d], and dq[row] = 0; warp per row.
template <int D>
__global__ void __launch_bounds__(128) fa_tf32_bwd_prep_kernel(FlashBwdParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= int64_t(p.B) * p.H * p.T) return;
  const int i = int(row % p.T);
  const int bh = int(row / p.T), b = bh / p.H, h = bh % p.H;
  const float* orow = slice<float>(p.o, b, h) + int64_t(i) * p.o.st;
  const float* dorow = slice<float>(p.dout, b, h) + int64_t(i) * p.dout.st;
  float* dqrow = slice_mut<float>(p.dq, b, h) + int64_t(i) * p.dq.st;
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) {
    acc += orow[lane + 32 * e] * dorow[lane + 32 * e];
    dqrow[lane + 32 * e] = 0.f;
  }
  acc = warp_sum(acc);
  if (lane == 0) p.dsum[row] = acc;
}

template <int D>
struct BwdCfg {
  static constexpr int BK = 64;                 // keys per CTA (16 per warp)
  static constexpr int BQ = D == 64 ? 32 : 16;  // queries per tile (slices of 16)
  static constexpr int kMinBlocks = D == 64 ? 3 : 2;  // registers: <= 168 at D = 64
  static constexpr int kLdS = BQ + 4;           // row stride of the dSᵀ tile (conflict-free loads)
  // dQ = dS·K: (BQ / 16) m-tiles, the D/8 n-tiles of one split over kWarpsPerM warps.
  static constexpr int kWarpsPerM = 4 * 16 / BQ;
  static constexpr int kNT = D / 8 / kWarpsPerM;
  static_assert(kNT == 4, "a warp's dQ n-tiles are one float4 run");
  // Floats: K, V [BK][D]; Q, dO [2][BQ][D]; dSᵀ [BK][kLdS]; lse, Dsum [2][BQ].
  static constexpr int kSmemBytes = (2 * BK * D + 4 * BQ * D + BK * kLdS + 4 * BQ) * 4;
};

__device__ __forceinline__ void atomic_add4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a, b, c, d));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

// Gqa: the CTA's query tiles are those of its key/value head's `group` query heads (Note [GQA
// backward]); false: of the one head, its query tiles in order.
template <int D, int kSplit, bool Gqa>
__global__ void __launch_bounds__(kThreads, BwdCfg<D>::kMinBlocks) fa_tf32_bwd_kernel(FlashBwdParams p) {
  using Cfg = BwdCfg<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK, kLdS = Cfg::kLdS;
  extern __shared__ float4 smem4[];
  float* const sK = reinterpret_cast<float*>(smem4);  // [BK][D]
  float* const sV = sK + BK * D;                      // [BK][D]
  float* const sQ = sV + BK * D;                      // [2][BQ][D]
  float* const sdO = sQ + 2 * BQ * D;                 // [2][BQ][D]
  float* const sdS = sdO + 2 * BQ * D;                // [BK][kLdS]: dSᵀ, keys as rows (plain layout)
  float* const sL = sdS + BK * kLdS;                  // [2][BQ] lse
  float* const sDs = sL + 2 * BQ;                     // [2][BQ] Dsum

  // Key tile in the slowest grid dimension: causal, the heavy tiles (small k0) launch first. The
  // grid's x is (batch, key/value head).
  const int kt = int(blockIdx.y);
  const int Hkv = Gqa ? p.H / p.group : p.H;
  const int b = int(blockIdx.x) / Hkv, hk = int(blockIdx.x) % Hkv;
  const int k0 = kt * BK;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int T = p.T;

  const int qt_begin = p.causal ? k0 / BQ : 0;
  const int num_qt = (T + BQ - 1) / BQ;
  const int G = Gqa ? p.group : 1, n_tiles = G * (num_qt - qt_begin);  // GQA: the walk's length
  // Without GQA the one query head's operands (with GQA those of head hk·G, the first).
  const int64_t bh = int64_t(b) * p.H + hk * G;
  const float* Qg = slice<float>(p.q, b, hk * G);
  const float* dOg = slice<float>(p.dout, b, hk * G);
  const float* lse_g = p.lse + bh * T;
  const float* dsum_g = p.dsum + bh * T;
  float* dQg0 = slice_mut<float>(p.dq, b, hk * G);

  load_tile_f32<D, BK>(sK, slice<float>(p.k, b, hk), p.k.st, k0, T, tid);
  load_tile_f32<D, BK>(sV, slice<float>(p.v, b, hk), p.v.st, k0, T, tid);
  // Q, dO, lse, Dsum of query tile qt of query head h (hk·G without GQA) into `stage`.
  auto load_q_tile = [&](int h, int qt, int stage) {
    const int64_t bhq = int64_t(b) * p.H + h;
    const float* Qh = Gqa ? slice<float>(p.q, b, h) : Qg;
    const float* dOh = Gqa ? slice<float>(p.dout, b, h) : dOg;
    const float* lse_h = Gqa ? p.lse + bhq * T : lse_g;
    const float* dsum_h = Gqa ? p.dsum + bhq * T : dsum_g;
    load_tile_f32<D, BQ>(sQ + stage * BQ * D, Qh, p.q.st, qt * BQ, T, tid);
    load_tile_f32<D, BQ>(sdO + stage * BQ * D, dOh, p.dout.st, qt * BQ, T, tid);
    if (tid < BQ) {
      const int q = qt * BQ + tid;
      cp_async_4(sL + stage * BQ + tid, lse_h + (q < T ? q : 0), q < T);
      cp_async_4(sDs + stage * BQ + tid, dsum_h + (q < T ? q : 0), q < T);
    }
  };
  load_q_tile(hk * G, qt_begin, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];  // this warp's 16 keys; n-tile nn, column n holds d = n·D/8 + nn
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  const float sl2 = p.scale * kLog2e;
  const int kw = warp * 16;          // this warp's first key within the tile
  const int key_lo = k0 + kw + g;    // this thread's keys: key_lo and key_lo + 8

  // The walk (Note [GQA backward]): query tiles qt_begin.. of head h, then (GQA) of head h + 1.
  int h = hk * G;
  for (int qt = qt_begin, it = 0; Gqa ? it < n_tiles : qt < num_qt; ++qt, ++it) {
    if (Gqa && qt == num_qt) qt = qt_begin, ++h;
    const int stage = it & 1;
    if (Gqa ? it + 1 < n_tiles : qt + 1 < num_qt) {
      if (!Gqa || qt + 1 < num_qt) load_q_tile(h, qt + 1, stage ^ 1);
      else load_q_tile(h + 1, qt_begin, stage ^ 1);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const float* q_s = sQ + stage * BQ * D;
    const float* do_s = sdO + stage * BQ * D;
    const float* l_s = sL + stage * BQ;
    const float* ds_s = sDs + stage * BQ;
    const int q0 = qt * BQ;
    float* dQg = Gqa ? slice_mut<float>(p.dq, b, h) : dQg0;
    const bool need_mask = q0 + BQ > T || k0 + BK > T || (p.causal && q0 < k0 + BK - 1);

#pragma unroll
    for (int qs = 0; qs < BQ; qs += 16) {
      // Causal: keys k0 + kw .. +15 against queries q0 + qs .. +15; nothing visible when the first
      // key is past the last query (P = dS = 0: only the zeros of dSᵀ are written).
      const bool live = !p.causal || k0 + kw <= q0 + qs + 15;
      // Sᵀ, dPᵀ (then Pᵀ, dSᵀ); element (j, e): key key_lo + 8(e >> 1), query qs + 8j + 2t + (e & 1).
      float st[2][4], dpt[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
      if (live) {
        // Sᵀ = K_w·Qᵀ and dPᵀ = V_w·dOᵀ: A = this warp's 16 rows of K (V), B[k = d][n = query] =
        // Q[qs + 8j + g][d] (dO): one float4 of each per 16 d.
#pragma unroll(kUnrollD)
        for (int c = 0; c < D / 16; ++c) {
          const float4 kx = lds4<D>(sK, kw + g, 16 * c + 4 * t), ky = lds4<D>(sK, kw + g + 8, 16 * c + 4 * t);
          const float4 vx = lds4<D>(sV, kw + g, 16 * c + 4 * t), vy = lds4<D>(sV, kw + g + 8, 16 * c + 4 * t);
          const Tf32<kSplit, 4> ka0 = to_tf32<kSplit, 4>({kx.x, ky.x, kx.y, ky.y});
          const Tf32<kSplit, 4> ka1 = to_tf32<kSplit, 4>({kx.z, ky.z, kx.w, ky.w});
          const Tf32<kSplit, 4> va0 = to_tf32<kSplit, 4>({vx.x, vy.x, vx.y, vy.y});
          const Tf32<kSplit, 4> va1 = to_tf32<kSplit, 4>({vx.z, vy.z, vx.w, vy.w});
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float4 qz = lds4<D>(q_s, qs + 8 * j + g, 16 * c + 4 * t);
            const float4 dz = lds4<D>(do_s, qs + 8 * j + g, 16 * c + 4 * t);
            const Tf32<kSplit, 4> bq = to_tf32<kSplit, 4>({qz.x, qz.y, qz.z, qz.w});
            const Tf32<kSplit, 4> bd = to_tf32<kSplit, 4>({dz.x, dz.y, dz.z, dz.w});
            mma_tf32<kSplit>(st[j], ka0, bq, 0);
            mma_tf32<kSplit>(st[j], ka1, bq, 1);
            mma_tf32<kSplit>(dpt[j], va0, bd, 0);
            mma_tf32<kSplit>(dpt[j], va1, bd, 1);
          }
        }

        // Pᵀ and dSᵀ.
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = qs + 8 * j + 2 * t + (e & 1);
            float pv = fast_exp2(fmaf(st[j][e], sl2, -l_s[qi] * kLog2e));
            if (need_mask) {
              const int key = key_lo + (e >> 1) * 8, q = q0 + qi;
              if (q >= T || key >= T || (p.causal && key > q)) pv = 0.f;
            }
            st[j][e] = pv;
            dpt[j][e] = pv * (dpt[j][e] - ds_s[qi]) * p.scale;
          }
      }

      // dSᵀ to shared memory for the dQ product: rows kw + g (+8), columns qs + 8j + 2t (+1).
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int x = 0; x < 2; ++x)
          *reinterpret_cast<float2*>(sdS + (kw + g + 8 * x) * kLdS + qs + 8 * j + 2 * t) =
              make_float2(dpt[j][2 * x], dpt[j][2 * x + 1]);

      if (live) {
        // dV += Pᵀ·dO and dK += dSᵀ·Q. k step j = queries qs + 8j + 2t (k t), +1 (k t+4): A
        // straight from st[j] / dpt[j]; B[k = query][n] = dO[query][n·D/8 + nn] (Q): float4 runs.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const Tf32<kSplit, 4> pa = to_tf32<kSplit, 4>({st[j][0], st[j][2], st[j][1], st[j][3]});
          const Tf32<kSplit, 4> sa = to_tf32<kSplit, 4>({dpt[j][0], dpt[j][2], dpt[j][1], dpt[j][3]});
          const int r0 = qs + 8 * j + 2 * t;
#pragma unroll
          for (int q = 0; q < D / 32; ++q) {
            const float4 d0 = lds4<D>(do_s, r0, g * (D / 8) + 4 * q), d1 = lds4<D>(do_s, r0 + 1, g * (D / 8) + 4 * q);
            const Tf32<kSplit, 8> bd = to_tf32<kSplit, 8>({d0.x, d1.x, d0.y, d1.y, d0.z, d1.z, d0.w, d1.w});
#pragma unroll
            for (int i = 0; i < 4; ++i) mma_tf32<kSplit>(dv[4 * q + i], pa, bd, i);
            const float4 x0 = lds4<D>(q_s, r0, g * (D / 8) + 4 * q), x1 = lds4<D>(q_s, r0 + 1, g * (D / 8) + 4 * q);
            const Tf32<kSplit, 8> bx = to_tf32<kSplit, 8>({x0.x, x1.x, x0.y, x1.y, x0.z, x1.z, x0.w, x1.w});
#pragma unroll
            for (int i = 0; i < 4; ++i) mma_tf32<kSplit>(dk[4 * q + i], sa, bx, i);
          }
        }
      }
    }
    __syncthreads();

    // dQ_tile = dS·K: warp → m-tile mt (queries q0 + 16mt ..), n-tiles part·4 .. part·4 + 3.
    // k step j = keys 8j + 2t (k t), +1 (k t+4). A[q][key] = dSᵀ[key][q] (scalar loads, padded
    // rows: conflict-free); B[k = key][n] = K[key][n·D/8 + part·4 + i]: one float4 per row.
    {
      const int mt = warp / Cfg::kWarpsPerM, part = warp % Cfg::kWarpsPerM;
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll(kUnrollDq)
      for (int j = 0; j < BK / 8; ++j) {
        const float* d0 = sdS + (8 * j + 2 * t) * kLdS + 16 * mt + g;
        const Tf32<kSplit, 4> a = to_tf32<kSplit, 4>({d0[0], d0[8], d0[kLdS], d0[kLdS + 8]});
        const float4 k0v = lds4<D>(sK, 8 * j + 2 * t, g * (D / 8) + 4 * part);
        const float4 k1v = lds4<D>(sK, 8 * j + 2 * t + 1, g * (D / 8) + 4 * part);
        const Tf32<kSplit, 8> bk = to_tf32<kSplit, 8>({k0v.x, k1v.x, k0v.y, k1v.y, k0v.z, k1v.z, k0v.w, k1v.w});
#pragma unroll
        for (int i = 0; i < 4; ++i) mma_tf32<kSplit>(acc[i], a, bk, i);
      }
      // Element (i, 2r + e): query q0 + 16mt + g + 8r, d = (2t + e)·D/8 + 4·part + i.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = q0 + 16 * mt + g + 8 * r;
        if (q >= T) continue;
        float* dqrow = dQg + int64_t(q) * p.dq.st + 4 * part;
#pragma unroll
        for (int e = 0; e < 2; ++e)
          atomic_add4(dqrow + (2 * t + e) * (D / 8), acc[0][2 * r + e], acc[1][2 * r + e], acc[2][2 * r + e],
                      acc[3][2 * r + e]);
      }
    }
    // The next iteration's first __syncthreads() orders these sdS reads before its sdS writes;
    // its prefetch writes the stage this iteration read before the __syncthreads() above.
  }

  // Epilogue: dK, dV rows of this warp; element 2r + e of n-tile nn is d = (2t + e)·D/8 + nn.
  float* dKg = slice_mut<float>(p.dk, b, hk);
  float* dVg = slice_mut<float>(p.dv, b, hk);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + r * 8;
    if (key >= T) continue;
    float* dkr = dKg + int64_t(key) * p.dk.st;
    float* dvr = dVg + int64_t(key) * p.dv.st;
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int q = 0; q < D / 32; ++q) {
        const int d = (2 * t + e) * (D / 8) + 4 * q;
        *reinterpret_cast<float4*>(dkr + d) = make_float4(dk[4 * q][2 * r + e], dk[4 * q + 1][2 * r + e],
                                                          dk[4 * q + 2][2 * r + e], dk[4 * q + 3][2 * r + e]);
        *reinterpret_cast<float4*>(dvr + d) = make_float4(dv[4 * q][2 * r + e], dv[4 * q + 1][2 * r + e],
                                                          dv[4 * q + 2][2 * r + e], dv[4 * q + 3][2 * r + e]);
      }
  }
}

// ---------------------------------------------------------------------------------------------
template <int D, int kSplit>
void launch_fwd(const FlashFwdParams& p, cudaStream_t stream) {
  launch_tiles<fa_tf32_fwd_kernel<D, kSplit>>(p, FwdCfg<D>::BQ, kThreads, FwdCfg<D>::kSmemBytes, "flash_attention",
                                              stream);
}

template <int D, int kSplit>
void launch_bwd(const FlashBwdParams& p, cudaStream_t stream) {
  BLU_ASSERT(p.dsum, "flash_attention_backward: the TF32 path needs the dsum scratch");
  const int64_t rows = int64_t(p.B) * p.H * p.T;
  const int64_t prep_blocks = (rows + 3) / 4;
  BLU_CHECK(prep_blocks <= 0x7fffffff, "flash_attention_backward: too many rows (", rows, ")");
  fa_tf32_bwd_prep_kernel<D><<<unsigned(prep_blocks), 128, 0, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
  if (p.group > 1)
    launch_tiles<fa_tf32_bwd_kernel<D, kSplit, true>>(p, BwdCfg<D>::BK, kThreads, BwdCfg<D>::kSmemBytes,
                                                      "flash_attention_backward", stream, p.H / p.group);
  else
    launch_tiles<fa_tf32_bwd_kernel<D, kSplit, false>>(p, BwdCfg<D>::BK, kThreads, BwdCfg<D>::kSmemBytes,
                                                       "flash_attention_backward", stream);
}

}  // namespace

// 1xTF32 under "tf32", 3xTF32 (fp32-level accuracy) under "ieee", read at each launch.
static int tf32_split() { return matmul_precision() == MatmulPrecision::tf32 ? 1 : 3; }

void flash_attention_forward_f32(const FlashFwdParams& p, cudaStream_t stream) {
  flash_attention_forward_tf32(p, tf32_split(), stream);
}
void flash_attention_backward_f32(const FlashBwdParams& p, cudaStream_t stream) {
  flash_attention_backward_tf32(p, tf32_split(), stream);
}

void flash_attention_forward_tf32(const FlashFwdParams& p, int split, cudaStream_t stream) {
  BLU_ASSERT((p.D == 64 || p.D == 128) && (split == 1 || split == 3), "flash_attention_forward_tf32: D=", p.D,
             " split=", split);
  if (p.D == 64) split == 3 ? launch_fwd<64, 3>(p, stream) : launch_fwd<64, 1>(p, stream);
  else split == 3 ? launch_fwd<128, 3>(p, stream) : launch_fwd<128, 1>(p, stream);
}

void flash_attention_backward_tf32(const FlashBwdParams& p, int split, cudaStream_t stream) {
  BLU_ASSERT((p.D == 64 || p.D == 128) && (split == 1 || split == 3), "flash_attention_backward_tf32: D=", p.D,
             " split=", split);
  if (p.D == 64) split == 3 ? launch_bwd<64, 3>(p, stream) : launch_bwd<64, 1>(p, stream);
  else split == 3 ? launch_bwd<128, 3>(p, stream) : launch_bwd<128, 1>(p, stream);
}

}  // namespace blu::cuda::flash
