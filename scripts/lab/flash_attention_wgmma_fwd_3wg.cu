// Lab variant (not built): the FlashAttention-3-style forward for Hopper — one producer warpgroup
// and two consumer warpgroups per CTA. It lost to the one-warpgroup kernel that ships in
// src/blu/backend/cuda/flash_attention_wgmma.cu (Note [wgmma solo forward] there; H200, B16 H12
// T1024 D64 causal bf16, ncu: this kernel 116 µs, the shipping one 99 µs; D128: 0.1621 ms against
// 0.1428). To measure it again: paste the constants and the kernel below into
// flash_attention_wgmma.cu's anonymous namespace (they use its helpers wg_softmax, wg_p_frags,
// wg_rescale, wg_store_o and flash_attention_wgmma.cuh), launch it from launch_fwd_wgmma with
//   launch_tiles<flash_fwd_wgmma_kernel<T, D>>(p, kWgBQ, kWgThreads, wg_smem_bytes<D>(), "flash_attention", stream);
// and time it with tests/cuda/flash_attention_perf_test.cpp (build-cuda/tests/test_cuda
// --gtest_filter='FlashAttentionPerf*') on an H100/H200.
//
// A CTA owns 128 query rows of one (batch, head) and has three warpgroups (384 threads):
//   warpgroup 0, the producer: loads the K and V tiles of 128 keys with cp.async into a two-stage
//     ring in shared memory, then lowers its register budget (setmaxnreg) to hand registers to
//   warpgroups 1 and 2, the consumers: each owns 64 query rows (wgmma's M), loads its Q rows once
//     and walks the key tiles: S = Q·Kᵀ (wgmma m64n128k16, Q and K from shared memory), the online
//     softmax on the fp32 accumulators, and O += P·V (wgmma m64nDk16, P from registers — the
//     accumulator layout converted to 16-bit in place — and V from shared memory, N-major).
// Pipeline per consumer (Note [wgmma forward pipeline]): tile n's S = Q·Kₙᵀ is issued together
// with the previous tile's O += Pₙ₋₁·Vₙ₋₁, so that the softmax of tile n runs while the tensor
// cores do Pₙ₋₁·Vₙ₋₁. K and V have separate full/empty barriers: Kₙ's stage is released as soon as
// S is done, Vₙ's when P·V is done, and the producer refills each as soon as it is released.
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
//
// Note [wgmma forward pipeline]
// Named barriers (bar.sync/bar.arrive with a thread count; id 0 is __syncthreads) carry the
// hand-offs: FULL_K[s], FULL_V[s] (producer arrives, 128 threads; consumers sync, 256) and
// EMPTY_K[s], EMPTY_V[s] (consumers arrive; producer syncs), 384 threads each. Producer, tile n,
// stage s = n % 2:
//   n >= 2: sync EMPTY_K[s] (both consumers have S of tile n-2) · cp.async Kₙ · wait for all its
//   copies (Kₙ, Vₙ₋₁) · fence.proxy.async (cp.async writes are generic-proxy, wgmma reads are
//   async-proxy) · arrive FULL_V[s^1] (Vₙ₋₁; n >= 1), FULL_K[s] · n >= 2: sync EMPTY_V[s] (P·V of
//   tile n-2 done) · cp.async Vₙ. After the last tile: wait, fence, arrive FULL_V of the last.
// Consumer: tile 0: sync FULL_K[0], S₀, softmax, P₀. Tile n >= 1: sync FULL_K[s] · issue Sₙ ·
//   sync FULL_V[s^1] · issue O += Pₙ₋₁·Vₙ₋₁ · wait for Sₙ · arrive EMPTY_K[s] · mask, max, exp ·
//   wait for P·V · arrive EMPTY_V[s^1] · rescale O, l · Pₙ. Last: sync FULL_V, O += P·V.
// The consumers arrive on an EMPTY barrier only for tiles the producer will refill (tile + 2 <
// number of tiles), so that no barrier is left half-arrived when the CTA exits. Every wait is
// matched: no side can run two phases ahead on one barrier, because each phase of FULL needs the
// previous phase of EMPTY on the same stage and vice versa.
namespace blu::cuda::flash {

constexpr int kWgBQ = 128;       // query rows per CTA: two consumer warpgroups of 64
constexpr int kWgBK = 128;       // keys per K/V tile
constexpr int kWgThreads = 384;  // producer + 2 consumers
template <int D>
constexpr int wg_smem_bytes() {
  // Q, two stages of K and of V, 16-bit elements; + 1024 to align the base to a swizzle atom.
  return (kWgBQ * D + 4 * kWgBK * D) * 2 + 1024;
}

// --- sm_90a instructions -------------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// setmaxnreg budgets: 128·40 + 256·232 = 384·168, the registers the CTA starts with under
// __launch_bounds__(384, 1) (65536 / 384, rounded down to a multiple of 8). The producer spills
// below 40 (ptxas -v).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;

// Named barrier ids (+ stage or + consumer index).
constexpr int kBarFullK = 1, kBarFullV = 3, kBarEmptyK = 5, kBarEmptyV = 7, kBarWg = 9;

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// --- the kernel ----------------------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(kWgThreads, 1) flash_fwd_wgmma_kernel(FlashFwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BQ = kWgBQ, BK = kWgBK;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Align to a 128-byte-swizzle atom (the swizzle is a function of the address bits).
  const uint32_t raw = smem_u32(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // 2 x [64][D]
  T* sK = sQ + BQ * D;                                                        // [2][BK][D]
  T* sV = sK + 2 * BK * D;                                                    // [2][BK][D]

  const auto [b, h, q0] = fwd_tile<BQ>(p);
  const int kv_end = p.causal ? min(p.T, q0 + BQ) : p.T;
  const int num_kt = (kv_end + BK - 1) / BK;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;

  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<kProducerRegs>();
    const T* Kg = slice<T>(p.k, b, h / p.group);  // the query head's key/value head (GQA)
    const T* Vg = slice<T>(p.v, b, h / p.group);
    for (int n = 0; n < num_kt; ++n) {
      const int s = n & 1;
      if (n >= 2) bar_sync(kBarEmptyK + s, kWgThreads);
      load_wg_tile<T, D, BK>(sK + s * BK * D, Kg, p.k.st, n * BK, p.T, tid);
      cp_async_commit();
      cp_async_wait<0>();  // Kₙ and Vₙ₋₁
      fence_proxy_async();
      if (n >= 1) bar_arrive(kBarFullV + (s ^ 1), kWgThreads);
      bar_arrive(kBarFullK + s, kWgThreads);
      if (n >= 2) bar_sync(kBarEmptyV + s, kWgThreads);
      load_wg_tile<T, D, BK>(sV + s * BK * D, Vg, p.v.st, n * BK, p.T, tid);
      cp_async_commit();
    }
    cp_async_wait<0>();
    fence_proxy_async();
    bar_arrive(kBarFullV + ((num_kt - 1) & 1), kWgThreads);
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;  // consumer index: rows q0 + 64c .. q0 + 64c + 63
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int r_wg = q0 + 64 * c;
  const int row_lo = r_wg + 16 * warp + g;  // this thread's rows: row_lo and row_lo + 8
  T* sQc = sQ + c * 64 * D;

  load_wg_tile<T, D, 64>(sQc, slice<T>(p.q, b, h), p.q.st, r_wg, p.T, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  bar_sync(kBarWg + c, 128);

  // Descriptors. Q, K: K-major, a 16-column k step is +32 bytes within a 64-column block, the next
  // block is ROWS·128 bytes on. V: N-major, a 16-key k step is +16 rows = 2048 bytes.
  const uint64_t dQ = make_desc(smem_u32(sQc), 16, 1024);
  const uint64_t dK0 = make_desc(smem_u32(sK), 16, 1024);
  const uint64_t dV0 = make_desc(smem_u32(sV), BK * 128, 1024);
  constexpr uint32_t kStageBytes = BK * D * 2;

  float o[D / 2];  // O accumulator (64 x D per warpgroup)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[BK / 2];          // S accumulator (64 x BK)
  uint32_t pf[BK / 16][4];  // P as A fragments, one per 16-key k step
  float m[2] = {kNegInf, kNegInf};  // running max of the raw scores, rows row_lo and row_lo + 8
  float l[2] = {0.f, 0.f};          // running sum of exp, this thread's columns only
  const float sl2 = p.scale * kLog2e;

  // S = Q·Kₙᵀ into s, issued (not waited for).
  auto issue_s = [&](int n) {
    const uint64_t dK = desc_add(dK0, uint32_t(n & 1) * kStageBytes);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss_n128<T>(s, desc_add(dQ, (kk / 4) * 64 * 128 + (kk % 4) * 32),
                       desc_add(dK, (kk / 4) * BK * 128 + (kk % 4) * 32), kk > 0);
    wgmma_commit();
  };
  // O += Pₙ·Vₙ, issued.
  auto issue_pv = [&](int n) {
    const uint64_t dV = desc_add(dV0, uint32_t(n & 1) * kStageBytes);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) wgmma_rs<T, D>(o, pf[kk], desc_add(dV, kk * 2048));
    wgmma_commit();
  };
  float alpha[2], rs[2];
  // Tile 0.
  bar_sync(kBarFullK + 0, kWgThreads);
  wgmma_fence();
  issue_s(0);
  wgmma_wait<0>();
  pin(s);
  if (2 < num_kt) bar_arrive(kBarEmptyK + 0, kWgThreads);
  wg_softmax<BK>(s, 0, r_wg, row_lo, t, p, sl2, m, alpha, rs);
  l[0] = rs[0], l[1] = rs[1];
  wg_p_frags<T, BK>(s, pf);

  for (int n = 1; n < num_kt; ++n) {
    const int st = n & 1;
    bar_sync(kBarFullK + st, kWgThreads);
    wgmma_fence();  // s, o and pf were written since the last wgmma
    issue_s(n);
    bar_sync(kBarFullV + (st ^ 1), kWgThreads);
    issue_pv(n - 1);
    wgmma_wait<1>();  // S of tile n
    pin(s);
    if (n + 2 < num_kt) bar_arrive(kBarEmptyK + st, kWgThreads);
    wg_softmax<BK>(s, n * BK, r_wg, row_lo, t, p, sl2, m, alpha, rs);
    wgmma_wait<0>();  // P·V of tile n-1
    pin(o);
    pin(s);
    if (n + 1 < num_kt) bar_arrive(kBarEmptyV + (st ^ 1), kWgThreads);
    wg_rescale<D>(o, l, alpha, rs);
    wg_p_frags<T, BK>(s, pf);
  }
  bar_sync(kBarFullV + ((num_kt - 1) & 1), kWgThreads);
  wgmma_fence();
  issue_pv(num_kt - 1);
  wgmma_wait<0>();
  pin(o);

  // Epilogue: O staged through this warpgroup's Q tile (its last reader, S of the last tile, is done).
  wg_store_o<T, D>(o, m, l, sQc, r_wg, b, h, tid, p, [c] { bar_sync(kBarWg + c, 128); });
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

}  // namespace blu::cuda::flash
