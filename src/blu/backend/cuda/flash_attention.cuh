// backend/cuda/flash_attention.cuh: device pieces shared by the flash-attention forward and
// backward kernels — 16-bit element traits, the mma.sync/ldmatrix/cp.async wrappers, the swizzled
// shared-memory tile layout and the tile loader.
// Depends on flash_attention.h and the CUDA headers. Keep: fragment layouts are those of PTX
// mma.m16n8k16 (documented at each use); g = lane / 4 and t = lane % 4 throughout.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/backend/cuda/runtime.h"

namespace blu::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// --- element traits --------------------------------------------------------------------------
template <typename T> struct Elem;
template <> struct Elem<float> {
  static __device__ float load(const float* p) { return *p; }
  static __device__ void store(float* p, float v) { *p = v; }
};
template <> struct Elem<__nv_bfloat16> {
  static __device__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
  // Two floats as one 32-bit register: `lo` (the lower column/k index) in the low half.
  static __device__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct Elem<__half> {
  static __device__ float load(const __half* p) { return __half2float(*p); }
  static __device__ void store(__half* p, float v) { *p = __float2half_rn(v); }
  static __device__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// --- PTX wrappers ----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, bypassing L1; zero-fills the destination when !valid (src unread).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 4 bytes global → shared (cp.async, through L1); zero-fills the destination when !valid.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i holds,
// in lane l, row l/4, columns 2(l%4), 2(l%4)+1 of matrix i (of its transpose with .trans).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}

// D(16x8, f32) += A(16x16) · B(16x8).
//   A regs: a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..)
//   B regs: b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g)
//   C/D:    c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, cols 2t, 2t+1)
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// --- shared-memory tiles ---------------------------------------------------------------------
// A [rows][W] tile of 16-bit elements (W = 64 or 128: 8 or 16 chunks of 16 bytes per row). Chunk c
// of row r is stored at chunk c ^ (r % 8), so the 8 row addresses of an ldmatrix (same logical
// chunk, 8 consecutive rows) fall in 8 different 16-byte bank groups: conflict-free.
template <int W>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(W % 64 == 0, "swizzled rows hold a multiple of 8 chunks");
  return row * W + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

// Rows [r0, r0 + ROWS) of one (b, h) slice of an operand into a swizzled tile; rows >= T are
// zero-filled. Issues cp.async only: the caller commits and waits.
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(T* tile, const T* base, int64_t row_stride, int r0, int T_len,
                                                int tid) {
  constexpr int kChunks = D / 8;
  static_assert(ROWS * kChunks % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / THREADS; ++i) {
    const int idx = tid + i * THREADS;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = r0 + r < T_len;
    const T* src = valid ? base + int64_t(r0 + r) * row_stride + c * 8 : base;
    cp_async_16(tile + swz<D>(r, c * 8), src, valid);
  }
}

// dst[0] += a, dst[1] += b (fp32 atomics; one 8-byte vector atomic on sm_90).
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// 2^x by the SFU (ex2.approx: ~2 ulp; 2^-inf = +0, which the masking relies on).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Raises a kernel's dynamic shared-memory limit once per device (the attribute is per device).
template <typename Kernel>
void ensure_smem_limit(Kernel kernel, int bytes, std::atomic<uint64_t>& done_mask) {
  const int dev = current_device();
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (done_mask.load() & bit) return;
  BLU_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done_mask.fetch_or(bit);
}

// Launches Kernel over a (B·heads, ⌈T / tile⌉) grid of `threads`-thread CTAs with `smem` bytes of
// dynamic shared memory, raising the kernel's shared-memory limit once per device; heads is H, or
// H / group for the dK/dV kernels (one CTA column per key/value head: Note [GQA backward]). `op`
// names the op in the error for a sequence whose tiles do not fit the grid's second dimension.
template <auto Kernel, typename Params>
void launch_tiles(const Params& p, int tile, int threads, int smem, const char* op, cudaStream_t stream,
                  int heads = 0) {
  static std::atomic<uint64_t> configured{0};  // one bit per device, per kernel
  ensure_smem_limit(Kernel, smem, configured);
  const int tiles = (p.T + tile - 1) / tile;
  BLU_CHECK(tiles <= 65535, op, ": sequence too long (T = ", p.T, ")");
  Kernel<<<dim3(unsigned(p.B) * unsigned(heads > 0 ? heads : p.H), unsigned(tiles)), threads, smem, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
}

// Note [GQA backward]
// With grouped-query attention, dK and dV of key/value head hk sum over the group's query heads
// hk·G .. hk·G + G − 1 (G = group). Every backward family computes them by one CTA per key
// tile of hk that walks the query tiles of those G heads in turn — head by head, each
// head's tiles in the order of the single-head walk — accumulating in the registers that already
// hold dK and dV; dQ and the rowwise Dsum stay per query head, as without GQA. Why this rather than
// per-query-head dK, dV in scratch followed by a group sum:
//   - the sums stay in registers and in a fixed order: dK, dV are bitwise reproducible wherever
//     they were (every family), with no atomics and no second pass;
//   - no scratch (per-head fp32 dK, dV would be 2·B·H·T·D floats: 128 MiB at B8 H32 T1024 D64)
//     and none of its DRAM traffic (written, read back, summed: ~2·128 MiB, ~50 µs at an H200's
//     4.8 TB/s — an estimate, not measured); K and V are loaded once per CTA instead of G times;
//   - the price: G times fewer CTAs, each G times longer — B·Hkv·⌈T/BK⌉ of them (wgmma, 128-key
//     tiles: 24·B, 32·B, 64·B at the Llama shapes Hkv 3, 4, 8, T 1024, on 132 multiprocessors),
//     which fills the GPU at the batch sizes trained but idles multiprocessors when B·Hkv is small.
// The walk: CTA-local tile it of G·n_per (n_per query tiles per head, from the first the key tile
// sees) is tile it % n_per of query head hk·G + it / n_per. The tensor-core backwards (wgmma,
// mma.sync, TF32) take it as a template flag (Gqa): without GQA (G = 1) they are instantiated with
// Gqa = false: the single-head code (the one head's pointers hoisted, the plain query-tile loop) —
// no scratch, no sum, no division on that path. (Its sm_90a cubins compared with those of a build
// without GQA support: the mma.sync, TF32 and D = 64 wgmma backwards byte-identical; the D = 128
// wgmma backward from identical PTX, 33 of 2016 instructions with swapped compare operands.)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ const T* slice(const AttnOperand& a, int b, int h) {
  return static_cast<const T*>(a.ptr) + int64_t(b) * a.sb + int64_t(h) * a.sh;
}
template <typename T>
__device__ __forceinline__ T* slice_mut(const AttnOperand& a, int b, int h) {
  return static_cast<T*>(a.ptr) + int64_t(b) * a.sb + int64_t(h) * a.sh;
}

// Note [head groups]
// A kernel over a (B·H, tiles) grid gives each CTA one (batch, head) pair and one tile rank; the
// hardware starts CTAs in linear order (x fastest). Read plainly — rank = blockIdx.y — the CTAs
// running at once share a rank and each touches a different head, so a wave streams the K, V (the
// forward) or Q, dO and the fp32 dQ accumulator (the backward) of ~130 heads: ~50 MB at GPT-2's
// shape, the size of the L2, and every head's data comes from DRAM again for each of its tiles
// (ncu, H200, plain order: the backward moves 643 MB where cuDNN's moves 232 MB). Instead the
// linear index is dealt out in groups of G heads: group g takes heads gG .. gG+G-1 (fewer in the
// last group), all ranks of those heads, rank-major within the group — so the heaviest ranks of a
// group still start first, and a group's working set (G heads) stays in the L2 while its CTAs run.
// G = 0 (or ≥ B·H) is the plain order. The map itself is tile_slot_of (flash_attention.h,
// host-tested). Used by the tensor-core forwards (fwd_tile) and the wgmma backward. The default G
// is 48 for both (kDefault{Fwd,Bwd}HeadGroup in flash_attention.h), the fastest of the
// FlashAttentionPerf.Gpt2Bf16CausalHeadGroups sweep on an H200 (docs/performance.md).
//
// Note [GQA head groups]
// With GQA a backward CTA walks G query heads, so its working set is G heads' Q, dO and dQ, and
// the L2's head group in key/value heads is head_group / G. But a causal GQA backward is made of few,
// long, unequal CTAs — at llama-250m's B8 H16 Hkv4 T1024, 256 CTAs of 8 to 64 query tiles on 132
// multiprocessors, under two waves — and head groups reorder them: the heaviest CTAs of a later
// group start after the light ones of the first, and the last of them ends late. Groups of 12
// key/value heads (48 / 4) took the backward from 0.1611 to 0.2227 ms there (H200, the
// FlashAttentionPerf.LlamaBf16CausalGqaHeadGroups sweep). So the launcher simulates the
// order (gqa_backward_head_group, flash_attention.cu: each multiprocessor takes the next CTA as it
// frees, a CTA costs its query tiles plus one) for head_group / G, its doublings and the plain
// order, and takes the smallest group within 2% of the best makespan. The simulation ranks the
// sweep's groups at both swept shapes as measured (llama-250m's: 4, 8, 12, 24 slow, 16 and 32
// fast; B8 H32 Hkv8: 12 and 24 slow, 16, 32, 64 fast). Past 8 waves of CTAs it is skipped: the
// order then moves the end little and head_group / G stands.
__device__ __forceinline__ TileSlot tile_slot(int head_group) {
  const int bh_count = int(gridDim.x);
  return tile_slot_of(int(blockIdx.x) + bh_count * int(blockIdx.y), bh_count, int(gridDim.y), head_group);
}

// The (batch, head) and first query row of this CTA of a forward kernel launched over a
// (B·H, ⌈T/BQ⌉) grid, in head groups. Under causal the ranks run from the last query tile (the most
// key tiles) down, so the heaviest CTAs launch first.
struct FwdTile {
  int b, h, q0;
};
template <int BQ>
__device__ __forceinline__ FwdTile fwd_tile(const FlashFwdParams& p) {
  const TileSlot s = tile_slot(p.head_group);
  const int qt = p.causal ? int(gridDim.y) - 1 - s.rank : s.rank;
  return {s.bh / p.H, s.bh % p.H, qt * BQ};
}

}  // namespace blu::cuda::flash
