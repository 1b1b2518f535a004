// backend/cuda/flash_attention_wgmma.cuh: device pieces shared by the Hopper (sm_90a) flash-attention
// kernels, forward (flash_attention_wgmma.cu) and backward (flash_attention_wgmma_backward.cu): the
// wgmma tile layout and its loader, named barriers, the async-proxy fence, wgmma matrix descriptors
// and the wgmma wrappers (fence/commit/wait, SS and RS variants), setmaxnreg.
// Depends on flash_attention.cuh. Keep: the layouts are those the wgmma descriptors describe (see
// the forward's header comment and scripts/lab/flash_attention_wgmma_check.py); the instruction
// wrappers exist only in the sm_90a compilation (__CUDA_ARCH_FEAT_SM90_ALL).
#pragma once
#include <cstdint>
#include <type_traits>

#include "blu/backend/cuda/flash_attention.cuh"

namespace blu::cuda::flash {

// Element (r, c) of a [ROWS][D] tile in the wgmma layout: column block c / 64, then swz<64>.
template <int ROWS>
__device__ __forceinline__ int wg_off(int r, int c) {
  return (c >> 6) * ROWS * 64 + swz<64>(r, c & 63);
}

// Rows [r0, r0 + ROWS) of one (b, h) slice into a wgmma-layout tile by the 128 threads of a
// warpgroup (tid 0..127); rows >= T_len are zero-filled. Issues cp.async only. Thread tid copies
// chunk tid % (D/8) of rows tid / (D/8) + i·(1024/D): a step of 1024/D rows (a multiple of 8)
// keeps the row's swizzle, so the destination moves by whole rows. A tile with every row below
// T_len (all but a last partial one) skips the row tests. Unroll: unrolled, ~6 instructions a
// chunk instead of ~20 (ncu, H200); not for the backward's producer warpgroup, whose small
// register budget cannot hold every chunk's address.
template <typename T, int D, int ROWS, bool Unroll = false>
__device__ __forceinline__ void load_wg_tile(T* tile, const T* base, int64_t row_stride, int r0, int T_len,
                                             int tid) {
  constexpr int kChunks = D / 8, kRowStep = 128 / kChunks, kIters = ROWS / kRowStep;
  static_assert(ROWS % kRowStep == 0 && kRowStep % 8 == 0, "every thread copies whole-swizzle row steps");
  const int r = tid / kChunks, c = tid % kChunks;
  const T* src = base + int64_t(r0 + r) * row_stride + c * 8;
  const int64_t src_step = int64_t(kRowStep) * row_stride;
  T* dst = tile + wg_off<ROWS>(r, c * 8);
  if (r0 + ROWS <= T_len) {
#pragma unroll(Unroll ? kIters : 1)
    for (int i = 0; i < kIters; ++i) cp_async_16(dst + i * kRowStep * 64, src + i * src_step, true);
  } else {
#pragma unroll 1
    for (int i = 0; i < kIters; ++i) {
      const bool valid = r0 + r + i * kRowStep < T_len;
      cp_async_16(dst + i * kRowStep * 64, valid ? src + i * src_step : base, valid);
    }
  }
}

// --- sm_90a instructions -------------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma) once a barrier has passed.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// wgmma matrix descriptor: start address, leading and stride byte offsets (each >> 4, 14 bits),
// base offset 0 (blocks are 1024-byte aligned), layout 1 = 128-byte swizzle (bits 62-63).
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lead_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((stride_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// The descriptor of the same layout `bytes` further on (bytes % 16 == 0; stays in the address field).
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins registers at this point of the program (no instruction): a use after wgmma_wait cannot be
// hoisted above it, a definition before a wgmma cannot sink below it.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The inverse of ldmatrix_x4 (flash_attention.cuh): four 8x8 b16 matrices from registers, lanes
// 8i..8i+7 giving the shared-memory row addresses of matrix i (16 bytes a row). With the registers
// of an accumulator's A fragment, matrix 0..3 are rows g / g+8 x columns 0..7 / 8..15 of it.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Bulk reduction (the TMA unit, async proxy): dst[0, bytes/4) += src[0, bytes/4) in fp32, global
// from shared memory; 16-byte aligned, bytes a multiple of 16. Grouped per thread like cp.async:
// bulk_commit closes a group; bulk_wait_read<N> waits until at most N groups still read their
// source, bulk_wait<N> until at most N are incomplete.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// The warpgroup of this thread as a value the compiler knows to be warp-uniform (a shuffle from
// lane 0): what derives from it (shared-memory tiles, wgmma descriptors) then stays in uniform
// registers instead of being moved into them before every wgmma.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0); }

template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

// Accumulator fragments of wgmma m64nNk16 with f32 D (N/2 registers per thread): warp w of the
// warpgroup holds rows 16w..16w+15; d[4j + e] is row 16w + g + 8·(e / 2), column 8j + 2t + e % 2
// (g = lane / 4, t = lane % 4): per 8 columns, the C layout of mma.sync m16n8k16.
// A fragments (register A, 16-bit): a[0] row g, k 2t..2t+1; a[1] row g+8; a[2] row g, k 2t+8..;
// a[3] row g+8, k 2t+8.. (the A layout of mma.sync m16n8k16).
#define BLU_D8(d, i)                                                                                    \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define BLU_D32(d) BLU_D8(d, 0), BLU_D8(d, 8), BLU_D8(d, 16), BLU_D8(d, 24)
#define BLU_D64(d) BLU_D32(d), BLU_D8(d, 32), BLU_D8(d, 40), BLU_D8(d, 48), BLU_D8(d, 56)
#define BLU_R32                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define BLU_R64                                                                                       \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "   \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "   \
  "%59, %60, %61, %62, %63}"

// S(64x128, f32) (+)= A(64x16, smem, K-major) · B(16x128, smem, K-major): acc = 0 overwrites.
template <typename T>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t a, uint64_t b, int acc);
// O(64xN, f32) += A(64x16, registers) · B(16xN, smem, N-major), N = 64 or 128; acc = 0 overwrites
// (the way to start an accumulator whose registers a wgmma may still hold across a loop: zeroing
// them with moves before the loop makes ptxas serialise the loop's wgmmas).
template <typename T>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int acc = 1);
template <typename T>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int acc = 1);

#define BLU_DEFINE_WGMMA(ELEM, PTX)                                                                     \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_ss_n128<ELEM>(float (&d)[64], uint64_t a, uint64_t b, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " BLU_R64                 \
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                      \
                 : BLU_D64(d)                                                                           \
                 : "l"(a), "l"(b), "r"(acc));                                                           \
  }                                                                                                    \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_rs_n64<ELEM>(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " BLU_R32                  \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                        \
                 : BLU_D32(d)                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));                         \
  }                                                                                                    \
  template <>                                                                                          \
  __device__ __forceinline__ void wgmma_rs_n128<ELEM>(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " BLU_R64                 \
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                        \
                 : BLU_D64(d)                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));                         \
  }
BLU_DEFINE_WGMMA(__nv_bfloat16, "bf16")
BLU_DEFINE_WGMMA(__half, "f16")
#undef BLU_DEFINE_WGMMA
// D(64xN, f32) (+)= A(64x16) · B(16xN), both from shared memory, N = 32 or 64; acc = 0 overwrites.
// TA = 0: A K-major (as Q in the forward); 1: A M-major (transposed: the 64 rows contiguous, the
// canonical layout of an N-major B). TB = 0: B K-major (as K in the forward); 1: N-major (as V).
// wgmma_ss_first is the first k step of a product (overwrites d): d is an output only, so the old
// values are dead before it and the registers are free in between (wgmma_ss with acc = 0 reads
// them as far as the compiler knows).
#define BLU_D16(d) BLU_D8(d, 0), BLU_D8(d, 8)
#define BLU_W8(d, i)                                                                                   \
  "=f"(d[i + 0]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), \
      "=f"(d[i + 6]), "=f"(d[i + 7])
#define BLU_W16(d) BLU_W8(d, 0), BLU_W8(d, 8)
#define BLU_W32(d) BLU_W8(d, 0), BLU_W8(d, 8), BLU_W8(d, 16), BLU_W8(d, 24)
#define BLU_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define BLU_WGMMA_SS(SHAPE, PTX, RLIST, DOPS, IA, IB, IACC, ITA, ITB)                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IACC ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " " RLIST ", %" IA ", %" IB    \
               ", p, 1, 1, %" ITA ", %" ITB ";\n}\n"                                                    \
               : DOPS                                                                                  \
               : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB))
#define BLU_WGMMA_SS_ALL(D16, D32)                                                                     \
  static_assert(N == 32 || N == 64, "wgmma_ss: N = 32 or 64");                                         \
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "wgmma_ss: 16-bit types"); \
  if constexpr (N == 64) {                                                                             \
    if constexpr (std::is_same_v<T, __half>) BLU_WGMMA_SS("m64n64k16", "f16", BLU_R32, D32(d), "32", "33", "34", "35", "36"); \
    else BLU_WGMMA_SS("m64n64k16", "bf16", BLU_R32, D32(d), "32", "33", "34", "35", "36");           \
  } else {                                                                                             \
    if constexpr (std::is_same_v<T, __half>) BLU_WGMMA_SS("m64n32k16", "f16", BLU_R16, D16(d), "16", "17", "18", "19", "20"); \
    else BLU_WGMMA_SS("m64n32k16", "bf16", BLU_R16, D16(d), "16", "17", "18", "19", "20");           \
  }
template <typename T, int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
  BLU_WGMMA_SS_ALL(BLU_D16, BLU_D32)
}
template <typename T, int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss_first(float (&d)[N / 2], uint64_t a, uint64_t b) {
  const int acc = 0;
  BLU_WGMMA_SS_ALL(BLU_W16, BLU_W32)
}
#undef BLU_WGMMA_SS_ALL
#undef BLU_WGMMA_SS
#undef BLU_D16
#undef BLU_W8
#undef BLU_W16
#undef BLU_W32
#undef BLU_R16
#undef BLU_D8
#undef BLU_D32
#undef BLU_D64
#undef BLU_R32
#undef BLU_R64

template <typename T, int D>
__device__ __forceinline__ void wgmma_rs(float (&o)[D / 2], const uint32_t (&a)[4], uint64_t b, int acc = 1) {
  if constexpr (D == 64) wgmma_rs_n64<T>(o, a, b, acc);
  else wgmma_rs_n128<T>(o, a, b, acc);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace blu::cuda::flash
