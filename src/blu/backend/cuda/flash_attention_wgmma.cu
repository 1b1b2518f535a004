// Flash-attention forward for Hopper (sm_90a): warpgroup MMA (wgmma). A CTA of one warpgroup owns
// 64 query rows of one (batch, head) and walks the key tiles: S = Q·Kᵀ (wgmma, Q and K from shared
// memory), the online softmax on the fp32 accumulators, and O += P·V (P from registers — the
// accumulator layout converted to 16-bit in place — and V from shared memory, N-major); Note
// [wgmma solo forward] below. (A FlashAttention-3-style producer/two-consumer kernel measured
// slower at GPT-2 shapes and lives in scripts/lab/flash_attention_wgmma_fwd_3wg.cu.)
//
// Shared-memory tiles are [rows][D] of 16-bit elements stored as D/64 blocks of [rows][64]: one
// 128-byte row per row, the 16-byte chunks of each 8-row x 128-byte atom permuted by the hardware's
// 128-byte swizzle (chunk c of row r at chunk c ^ r%8 — swz<64> of flash_attention.cuh), every block
// 1024-byte aligned (wg_off, load_wg_tile; these and the wgmma, descriptor and barrier wrappers are
// in flash_attention_wgmma.cuh, shared with the backward). wgmma reads them through matrix
// descriptors (make_desc): Q and K K-major (stride byte offset 1024 = one 8-row atom; leading
// offset unused), V N-major (the key dimension is wgmma's K; stride byte offset 1024 = 8 keys,
// leading byte offset = one [128][64] block, the distance between the two 64-column halves at
// D = 128).
//
// Masking, rows and keys past T (zero-filled tiles, masked scores) and causal work (tiles past the
// diagonal skipped, heaviest CTAs launched first) as in the mma.sync kernel of flash_attention.cu.
// The kernel body exists only in the sm_90a compilation (__CUDA_ARCH_FEAT_SM90_ALL); the dispatch
// asks flash_attention_wgmma_available() before launching it.
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_wgmma.cuh"
#include "blu/backend/cuda/flash_attention_wgmma.h"
#include "blu/backend/cuda/runtime.h"

#include <atomic>

namespace blu::cuda {

namespace flash {
namespace {

// --- the warpgroup's softmax and epilogue ------------------------------------------------------
// A thread holds rows row_lo and row_lo + 8 of its warpgroup's 64 (row_lo = first + 16·warp + g)
// and, of a 64 x BK score tile in the wgmma accumulator layout, columns 8j + 2t (+1).

// Masks score tile s of keys k0.. (keys past T; causal: keys after the row; `first` is the
// warpgroup's first row), then the online-softmax update: s becomes exp2(s·sl2 − m·sl2), alpha the
// factor for the old O and l, rs the row sums of this thread's columns, m the new running max.
template <int BK>
__device__ __forceinline__ void wg_softmax(float (&s)[BK / 2], int k0, int first, int row_lo, int t,
                                           const FlashFwdParams& p, float sl2, float (&m)[2], float (&alpha)[2],
                                           float (&rs)[2]) {
  constexpr int NS = BK / 8;  // 8-column groups
  if (k0 + BK > p.T || (p.causal && k0 + BK - 1 > first)) {
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * j + 2 * t + (e & 1);
        const int row = row_lo + (e >> 1) * 8;
        if (key >= p.T || (p.causal && key > row)) s[4 * j + e] = kNegInf;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float msub = mx == kNegInf ? 0.f : mx * sl2;  // a fully masked row so far stays at 0
    alpha[r] = fast_exp2(m[r] * sl2 - msub);
    m[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      s[4 * j + 2 * r] = fast_exp2(s[4 * j + 2 * r] * sl2 - msub);
      s[4 * j + 2 * r + 1] = fast_exp2(s[4 * j + 2 * r + 1] * sl2 - msub);
      sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
    }
    rs[r] = sum;
  }
}

// P from s as A fragments: k step kk covers keys 16kk..16kk+15 = column groups 2kk (a[0], a[1])
// and 2kk+1.
template <typename T, int BK>
__device__ __forceinline__ void wg_p_frags(const float (&s)[BK / 2], uint32_t (&pf)[BK / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    pf[kk][0] = Elem<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
    pf[kk][1] = Elem<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
    pf[kk][2] = Elem<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
    pf[kk][3] = Elem<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// l = l·alpha + rs and O scaled by alpha, per row.
template <int D>
__device__ __forceinline__ void wg_rescale(float (&o)[D / 2], float (&l)[2], const float (&alpha)[2],
                                           const float (&rs)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = l[r] * alpha[r] + rs[r];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[4 * j + 2 * r] *= alpha[r];
      o[4 * j + 2 * r + 1] *= alpha[r];
    }
  }
}

// Epilogue: completes the row sums across the quad, writes the logsumexp, normalises O and stores
// it — staged through `stage` (the warpgroup's Q tile, [64][D] in the wgmma layout, whose last
// reader is done once every warp passes the first `wg_sync`) and written with 16-byte coalesced
// stores. `first` is the warpgroup's first row; tid its thread index (0..127).
template <typename T, int D, typename Sync>
__device__ __forceinline__ void wg_store_o(const float (&o)[D / 2], const float (&m)[2], const float (&l)[2], T* stage,
                                           int first, int b, int h, int tid, const FlashFwdParams& p, Sync wg_sync) {
  const int warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  const int row_lo = first + 16 * warp + g;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    inv[r] = lr > 0.f ? 1.f / lr : 0.f;
    const int row = row_lo + 8 * r;
    if (t == 0 && row < p.T) p.lse[(int64_t(b) * p.H + h) * p.T + row] = lr > 0.f ? m[r] * p.scale + logf(lr) : kNegInf;
  }
  wg_sync();  // every warp of this warpgroup is past its last wgmma
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<uint32_t*>(stage + wg_off<64>(16 * warp + g + 8 * r, 8 * j + 2 * t)) =
          Elem<T>::pack(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
  wg_sync();
  T* Og = slice_mut<T>(p.o, b, h);
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int idx = tid + i * 128;
    const int r = idx / kChunks, ch = idx % kChunks;
    if (first + r < p.T)
      *reinterpret_cast<uint4*>(Og + int64_t(first + r) * p.o.st + ch * 8) =
          *reinterpret_cast<const uint4*>(stage + wg_off<64>(r, ch * 8));
  }
}

// --- the kernel ----------------------------------------------------------------------------------
// Note [wgmma solo forward]
// A CTA of one warpgroup (128 threads) owns 64 query rows and loads its own tiles of 64 keys: no
// producer, no named barriers, and small enough (41 KB of shared memory, 117 registers) that four
// CTAs share a multiprocessor. A three-warpgroup producer/consumer kernel (FlashAttention-3's
// scheme; scripts/lab/flash_attention_wgmma_fwd_3wg.cu) holds a whole multiprocessor per
// CTA, so each CTA's start (Q and the first K tile from memory) and end (O's store) leave the
// tensor cores idle — at GPT-2 shapes 11.6 CTAs a multiprocessor, each of 1 to 8 key tiles; here
// the warp schedulers interleave four CTAs, one's softmax and loads under another's products.
// Measured on an H200 (B16 H12 T1024 D64 causal bf16, ncu): three warpgroups 116 µs; this kernel
// with 128-key tiles (three CTAs a multiprocessor) 104 µs, with 64-key tiles 99 µs. A deeper K/V
// ring does not pay for the CTAs it evicts: three stages of 128 keys (two CTAs) 117 µs, four (one)
// 183 µs. Its tile loads are unrolled (load_wg_tile's Unroll: fwd 0.0833 ms by events, 0.0945
// rolled). It runs at D = 128 too, with 32-key tiles (B16 H12 T1024 D128: three warpgroups
// 0.1621 ms; this kernel with 64-key tiles, two CTAs a multiprocessor, 0.1466; with 32-key tiles,
// four, 0.1428; cuDNN 0.1168).
// Per tile n, with K and V each in a two-stage ring and one cp.async group per tile:
//   wait for group n-1 (Kₙ, Vₙ₋₁) · fence.proxy.async · __syncthreads (every warp is past Sₙ₋₁
//   and Pₙ₋₂·Vₙ₋₂, the last readers of the stages refilled next) · issue group n: Kₙ₊₁ into
//   stage (n+1)%2, Vₙ into stage n%2 · issue Sₙ = Q·Kₙᵀ and O += Pₙ₋₁·Vₙ₋₁ · wait Sₙ · softmax ·
//   wait P·V · rescale · Pₙ.
// Before tile 0: Q and K₀ (one group). After the last: wait, fence, sync, O += P·V.
// Keys a tile: 64, or 32 at D = 128 so that four CTAs (50 KB each, 128 registers) still share a
// multiprocessor.
constexpr int kSoloBQ = 64, kSoloThreads = 128;
template <int D>
constexpr int solo_bk() { return D == 64 ? 64 : 32; }
template <int D>
constexpr int solo_smem_bytes() {
  return (kSoloBQ * D + 4 * solo_bk<D>() * D) * 2 + 1024;
}

template <typename T, int D>
__global__ void __launch_bounds__(kSoloThreads, 4) flash_fwd_wgmma_solo_kernel(FlashFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BQ = kSoloBQ, BK = solo_bk<D>();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // [64][D]
  T* sK = sQ + BQ * D;                                                        // [2][BK][D]
  T* sV = sK + 2 * BK * D;                                                    // [2][BK][D]

  const auto [b, h, q0] = fwd_tile<BQ>(p);
  const int kv_end = p.causal ? min(p.T, q0 + BQ) : p.T;
  const int num_kt = (kv_end + BK - 1) / BK;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row_lo = q0 + 16 * warp + g;  // this thread's rows: row_lo and row_lo + 8
  const T* Kg = slice<T>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
  const T* Vg = slice<T>(p.v, b, h / p.group);
  constexpr uint32_t kStageBytes = BK * D * 2;

  load_wg_tile<T, D, BQ, true>(sQ, slice<T>(p.q, b, h), p.q.st, q0, p.T, tid);
  load_wg_tile<T, D, BK, true>(sK, Kg, p.k.st, 0, p.T, tid);
  cp_async_commit();

  const uint64_t dQ = make_desc(smem_u32(sQ), 16, 1024);
  const uint64_t dK0 = make_desc(smem_u32(sK), 16, 1024);
  const uint64_t dV0 = make_desc(smem_u32(sV), BK * 128, 1024);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[BK / 2];
  uint32_t pf[BK / 16][4];
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.f, 0.f};
  const float sl2 = p.scale * kLog2e;

  // Waits for this thread's copies (Kₙ, Vₙ₋₁), makes everyone's visible to wgmma, then queues
  // Kₙ₊₁ and Vₙ.
  auto next_tiles = [&](int n) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (n + 1 < num_kt) load_wg_tile<T, D, BK, true>(sK + ((n + 1) & 1) * BK * D, Kg, p.k.st, (n + 1) * BK, p.T, tid);
    if (n < num_kt) load_wg_tile<T, D, BK, true>(sV + (n & 1) * BK * D, Vg, p.v.st, n * BK, p.T, tid);
    cp_async_commit();
  };
  auto issue_s = [&](int n) {
    const uint64_t dK = desc_add(dK0, uint32_t(n & 1) * kStageBytes);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BK, 0, 0>(s, desc_add(dQ, (kk / 4) * BQ * 128 + (kk % 4) * 32),
                            desc_add(dK, (kk / 4) * BK * 128 + (kk % 4) * 32), kk > 0);
    wgmma_commit();
  };
  auto issue_pv = [&](int n) {
    const uint64_t dV = desc_add(dV0, uint32_t(n & 1) * kStageBytes);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_rs<T, D>(o, pf[kk], desc_add(dV, kk * 2048));
    wgmma_commit();
  };
  float alpha[2], rs[2];
  next_tiles(0);
  wgmma_fence();
  issue_s(0);
  wgmma_wait<0>();
  pin(s);
  wg_softmax<BK>(s, 0, q0, row_lo, t, p, sl2, m, alpha, rs);
  l[0] = rs[0], l[1] = rs[1];
  wg_p_frags<T, BK>(s, pf);
  for (int n = 1; n < num_kt; ++n) {
    next_tiles(n);
    wgmma_fence();
    issue_s(n);
    issue_pv(n - 1);
    wgmma_wait<1>();
    pin(s);
    wg_softmax<BK>(s, n * BK, q0, row_lo, t, p, sl2, m, alpha, rs);
    wgmma_wait<0>();
    pin(o);
    pin(s);
    wg_rescale<D>(o, l, alpha, rs);
    wg_p_frags<T, BK>(s, pf);
  }
  next_tiles(num_kt);  // V of the last tile
  wgmma_fence();
  issue_pv(num_kt - 1);
  wgmma_wait<0>();
  pin(o);

  // Epilogue: O staged through the Q tile.
  wg_store_o<T, D>(o, m, l, sQ, q0, b, h, tid, p, [] { __syncthreads(); });
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, int D>
void launch_fwd_wgmma(const FlashFwdParams& p, cudaStream_t stream) {
  launch_tiles<flash_fwd_wgmma_solo_kernel<T, D>>(p, kSoloBQ, kSoloThreads, solo_smem_bytes<D>(), "flash_attention",
                                                  stream);
}

}  // namespace

void flash_attention_forward_wgmma(const FlashFwdParams& p, DType dtype, cudaStream_t stream) {
  BLU_ASSERT(p.D == 64 || p.D == 128, "flash_attention_forward_wgmma: D = ", p.D);
  switch (dtype) {
    case DType::bf16:
      return p.D == 64 ? launch_fwd_wgmma<__nv_bfloat16, 64>(p, stream) : launch_fwd_wgmma<__nv_bfloat16, 128>(p, stream);
    case DType::f16: return p.D == 64 ? launch_fwd_wgmma<__half, 64>(p, stream) : launch_fwd_wgmma<__half, 128>(p, stream);
    default: BLU_ASSERT(false, "flash_attention_forward_wgmma: unsupported dtype ", dtype);
  }
}

}  // namespace flash

bool flash_attention_wgmma_available() {
#if defined(BLU_CUDA_SM90A)
  // Compute capability per device, looked up once (0: not yet known).
  static std::atomic<int> cc[64];
  const int dev = current_device();
  int v = dev < 64 ? cc[dev].load() : 0;
  if (v == 0) {
    int major = 0, minor = 0;
    BLU_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    BLU_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    v = major * 10 + minor;
    if (dev < 64) cc[dev].store(v);
  }
  return v == 90;  // sm_90a code runs on compute capability 9.0 only
#else
  return false;
#endif
}

}  // namespace blu::cuda
