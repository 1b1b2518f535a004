// Flash-attention backward for Hopper (sm_90a): warpgroup MMA (wgmma), the FlashAttention-3 scheme.
// The main kernel of the bf16/f16 backward; the Dsum precompute, the zeroing of the fp32 dQ
// accumulator and the final dQ cast are those of the mma.sync backward (flash_attention_backward.cu,
// which dispatches here). With P = exp(S·scale − lse) and Dsum = rowsum(dO ∘ O):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − Dsum) · scale,  dQ = dS·K,  dK = dSᵀ·Q.
//
// A CTA owns 128 keys of one (batch, head) and has three warpgroups (384 threads):
//   warpgroup 0, the producer: walks the query tiles of 64 rows that see these keys (causal: from
//     the diagonal on) and loads Q, dO (cp.async, wgmma layout) and lse, Dsum of each into a
//     two-stage ring, then lowers its register budget (setmaxnreg) for
//   warpgroups 1 and 2, the consumers: consumer c owns keys 64c..64c+63 of the CTA (wgmma's M), loads
//     its K and V rows once, keeps its dK and dV (64 x D, fp32) in registers, and per query tile:
//       Sᵀ = K_c·Qᵀ and dPᵀ = V_c·dOᵀ   wgmma m64n64k16 SS (K, V and Q, dO K-major)
//       Pᵀ = exp(Sᵀ·scale − lse)         masked: keys or queries past T, causal keys after the query
//       dV += Pᵀ·dO                      wgmma m64nDk16 RS: Pᵀ from the accumulator registers
//                                        converted to 16-bit in place (as P in the forward), dO N-major
//       dSᵀ = Pᵀ ∘ (dPᵀ − Dsum)·scale   to registers (16-bit A fragments) and to shared memory
//                                        (stmatrix at D = 64)
//       dK += dSᵀ·Q                      wgmma RS, Q N-major
//       dQ_tile[:, c·D/2 + (0..D/2)) = dS·K over all 128 keys: wgmma m64n(D/2)k16 SS with dS as an
//                                        M-major (transposed) A — the dSᵀ tile of both consumers —
//                                        and K N-major; added to the fp32 dQ tile in global memory
//                                        by a bulk reduction (Note [dQ tiles]; dQ is the only output
//                                        that several CTAs add to).
//     Working with keys as wgmma's M is what lets Pᵀ and dSᵀ feed the dV, dK products straight
//     from the accumulator registers. At the end dK, dV are cast and stored through the consumer's
//     V tile (no atomics: each key belongs to one CTA).
//
// Shared memory (16-bit tiles in the wgmma layout of flash_attention_wgmma.cuh: 64-column blocks of
// 128-byte rows under the 128-byte swizzle, every block 1024-byte aligned):
//   K, V     2 x [64][D] each, consumer c's rows at + c·64·D
//   Q, dO    [2 stages][64][D]
//   dSᵀ      [2 buffers][128 keys][64 queries], consumer c writes rows 64c..64c+63
//   lse, Dsum [2 stages][64] fp32
//   dQ       [2 consumers][32·D] fp32, in fragment order (Note [dQ tiles])
// Descriptors: K-major operands (K, V as A of Sᵀ, dPᵀ; Q, dO as B) with stride byte offset 1024 (an
// 8-row atom), a 16-column k step +32 bytes within a 64-column block, the next block 64·128 bytes on.
// N-major B (Q, dO of dK, dV; K of dQ) and M-major A (dSᵀ of dQ): stride byte offset 1024 (8 rows of
// the k dimension), leading byte offset 64·128 (the next 64-column block; unused where N or M is
// 64 or less), a 16-row k step +2048 bytes. dQ's B starts at column c·D/2 of K: + 64c bytes within
// the block at D = 64, block c at D = 128. scripts/lab/flash_attention_wgmma_bwd_check.py models
// this layout and the fragment math on the CPU.
//
// Causal: key block kb visits query tiles from 2kb on (the first one contains its diagonal and is
// masked; for consumer 1 that tile is entirely masked and yields zeros); the grid's ranks are the
// key blocks, dealt out in head groups (Note [head groups]), so within a group the heaviest CTAs
// (small kb) launch first. The kernel body exists only in the sm_90a compilation
// (__CUDA_ARCH_FEAT_SM90_ALL).
//
// GQA (p.group > 1, the Gqa instantiation; Note [GQA backward]): the grid's x runs over (batch,
// key/value head hk), and a CTA walks the query tiles of hk's query heads one head after the other:
// its tile i — the count that the stages, the dSᵀ buffers and the barriers follow, so the protocol
// below is unchanged — is tile l of query head hk·group + j, i = j·n_per + l (n_per query tiles a
// head). The producer loads that head's Q, dO, lse, Dsum; the consumers mask by l, add dQ to that
// head's tiles, and keep summing dK, dV in registers across the heads. Head groups count key/value
// heads, head_group / group of them (a CTA's working set is its group's query heads).
//
// Note [wgmma backward pipeline]
// Named barriers (bar.sync / bar.arrive with a thread count; id 0 is __syncthreads):
//   FULL[s]  (s = stage): producer arrives (128), consumers sync (256); 384 threads.
//   EMPTY[s]: consumers arrive, producer syncs; 384 threads.
//   DS: both consumers sync; 256 threads. WG[c]: consumer c alone; 128 threads.
// Producer, tile i (of this CTA's n tiles), stage s = i % 2:
//   i >= 1: wait for all its copies (tile i-1) · fence.proxy.async (cp.async writes are
//   generic-proxy, wgmma reads async-proxy) · arrive FULL[s^1]. i >= 2: sync EMPTY[s] (tile i-2
//   consumed). cp.async Q, dO, lse, Dsum of tile i into stage s. After the loop: wait, fence,
//   arrive FULL of the last tile. Tile i's copies are in flight while the consumers work on i-1.
// Consumer, tile i: sync FULL[s] · issue Sᵀ, dPᵀ (two commit groups) · wait Sᵀ · Pᵀ · issue dV
//   (RS) · wait dPᵀ · dSᵀ to registers and to dSᵀ buffer i % 2 · fence.proxy.async · issue dK (RS) ·
//   sync DS (both halves of dSᵀ written) · issue dQ (SS) · wait all · arrive EMPTY[s] if i + 2 < n
//   (only for tiles the producer refills, so no barrier is left half-arrived at exit) · dQ to
//   shared memory, added from there after the next tile's Sᵀ, dPᵀ issue (Note [dQ tiles]).
// Every wait is matched: FULL[s] and EMPTY[s] alternate (a phase of one needs the previous phase of
// the other), so no side runs two phases ahead. DS needs no partner barrier: a consumer writes
// dSᵀ buffer i % 2 after it passed DS of tile i-1, which the other consumer reached only after its
// dQ of tile i-2 — the last reader of that buffer — completed. K is read by both consumers' dQ:
// each consumer's K rows are fenced before its first DS, so they are visible to the other's first
// dQ; nothing writes K afterwards. V is read only by its own consumer, so the epilogue stages dK
// and dV through it (WG barriers).
// A pipelined variant (dK left in flight into the next tile, three stages) measured slower with
// dQ added by bulk reductions; it is kept in scripts/lab/flash_attention_wgmma_bwd_pipe.patch.
//
// Note [dQ tiles]
// Every key block adds to the dQ of the query tiles it sees. Per-element float2 atomics (red.global)
// from the registers cost 8 (D = 64) to 16 instructions a thread and tile, and their queue and their
// source registers' release stall the consumers (ncu, H200). So dq_accum is laid out for
// one bulk reduction per consumer and tile: per (b, h) ceil(T/64) tiles of 64·D floats; in a tile,
// consumer c's half at c·32·D, and within it float4 number j·128 + tid holds registers 4j..4j+3 of
// thread tid — rows 16w + g and 16w + g + 8, columns c·D/2 + 8j + 2t, +1 (w = tid / 32, g = tid %
// 32 / 4, t = tid % 4; the accumulator layout of flash_attention_wgmma.cuh). A consumer stores its
// registers there in shared memory at the end of a tile (one 16-byte store per group, consecutive
// threads consecutive: no bank conflicts); at the start of the next, once its Sᵀ and dPᵀ products
// are issued, it fences, syncs its warpgroup, and its thread 0 adds the 32·D floats with one
// cp.reduce.async.bulk .add.f32 (so the stores' latency and the barrier hide under the products).
// That tile's dQ may overwrite the buffer once the read is done: thread 0 waits for it before the
// tile's dSᵀ barrier (DS), so every consumer thread passes DS only after it. After the last tile
// the consumer flushes its dQ and waits for the addition to complete. Rows
// past T (a last partial tile) add zeros: their dSᵀ is 0 (Note [wgmma backward math]).
// flash_bwd_dq_tiles_convert_kernel puts a tile back in row order and casts it; the buffer has
// flash_dq_accum_floats floats (T rounded up to 64), of which the Dsum kernel zeroes the first
// B·H·T·D and flash_attention_backward_wgmma the rest. (One bulk reduction per 128-byte row,
// staged through shared memory, is ~80 µs slower than the atomics on an H200: such rows are too
// small for the bulk engine.)
//
// Note [wgmma backward math]
// The consumers issue every instruction of a tile's elementwise work, so it is kept to what the math
// needs (ncu's per-instruction counts on an H200: ~815 a tile and warp without the measures below,
// 440 with them and Note [dQ tiles]; docs/CHANGELOG.md, 2026-11-23):
// - The mask is compiled only into the tiles that need it. Causal, those the diagonal crosses, which
//   come first (i <= c); with keys past T, every tile. Queries past T need none: their Q, dO rows,
//   lse and Dsum are zero-filled, so Pᵀ = 1 there and dSᵀ = 0, dV and dK gain Pᵀ·0 and dSᵀ·Q = 0,
//   and their dQ rows are not stored. Keys past T must be masked: Pᵀ = 2^(−lse·log2 e) may
//   overflow, and inf·0 would reach dQ through K's zero rows. (Left in every tile, if-converted by
//   ptxas, the mask costs ~200 predicated instructions a tile.)
// - The producer scales lse by log2 e and Dsum by the softmax scale in shared memory once they have
//   landed, so Pᵀ = 2^(Sᵀ·scale·log2 e − lse') is one FFMA before the exp and dSᵀ = Pᵀ·(dPᵀ·scale −
//   Dsum') one FFMA and one FMUL.
// - dSᵀ goes to shared memory by four stmatrix (16 32-bit stores and their swizzled addresses before).
// - The warpgroup index comes from a shuffle (warpgroup_index), so the descriptors of a consumer's
//   own K, V rows stay in uniform registers.
#include "blu/backend/cuda/flash_attention.cuh"
#include "blu/backend/cuda/flash_attention_wgmma.cuh"
#include "blu/backend/cuda/flash_attention_wgmma.h"
#include "blu/backend/cuda/loops.cuh"
#include "blu/backend/cuda/rotary.cuh"
#include "blu/backend/cuda/runtime.h"

#include <algorithm>
#include <atomic>

namespace blu::cuda {

namespace flash {
namespace {

constexpr int kWbBK = 128;       // keys per CTA: two consumer warpgroups of 64
constexpr int kWbBQ = 64;        // queries per tile
static_assert(kWbBQ == 64, "flash_dq_accum_floats rounds T up to these 64-row query tiles");
constexpr int kWbThreads = 384;  // producer + 2 consumers
// Stages of the Q, dO, lse, Dsum ring (Note [wgmma backward pipeline]).
constexpr int kWbStages = 2;
template <int D>
constexpr int wb_smem_bytes() {
  // K, V [128][D]; Q, dO [NS][64][D]; dSᵀ [2][128][64] (16-bit); lse, Dsum [NS][64], dQ [64·D]
  // (fp32); + 1024 to align the base to a swizzle atom.
  constexpr int NS = kWbStages;
  return (2 * kWbBK * D + 2 * NS * kWbBQ * D + 2 * kWbBK * kWbBQ) * 2 + (2 * NS * kWbBQ + kWbBQ * D) * 4 + 1024;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// setmaxnreg budgets as in the forward: 128·40 + 256·232 = 384·168.
constexpr int kWbProducerRegs = 40, kWbConsumerRegs = 232;
// Named barrier ids (+ stage or + consumer index): FULL 1.., EMPTY after the NS FULL ones, then DS,
// then WG[2].
struct WbBars {
  static constexpr int kFull = 1, kEmpty = kFull + kWbStages, kDs = kEmpty + kWbStages, kWg = kDs + 1;
  static_assert(kWg + 1 < 16, "named barrier ids");
};
#endif

// Gqa: the CTA's query tiles are those of its key/value head's `group` query heads (Note [GQA
// backward]); false: of the one head, its tiles in order.
template <typename T, int D, bool Gqa>
__global__ void __launch_bounds__(kWbThreads, 1) flash_bwd_wgmma_kernel(FlashBwdParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = kWbBK, BQ = kWbBQ, NS = kWbStages;
  constexpr int kBarFull = WbBars::kFull, kBarEmpty = WbBars::kEmpty, kBarDs = WbBars::kDs, kBarWg = WbBars::kWg;
  constexpr uint32_t kTileBytes = BQ * D * 2;  // one stage of Q or dO
  constexpr uint32_t kHalfBytes = 64 * D * 2;  // one consumer's K (V) rows
  constexpr uint32_t kDsBytes = BK * BQ * 2;   // one dSᵀ buffer
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // 2 x [64][D]
  T* sV = sK + BK * D;                                                        // 2 x [64][D]
  T* sQ = sV + BK * D;                                                        // [NS][64][D]
  T* sdO = sQ + NS * BQ * D;                                                  // [NS][64][D]
  T* sdS = sdO + NS * BQ * D;                                                 // [2][128][64]
  float* sL = reinterpret_cast<float*>(sdS + 2 * BK * BQ);                    // [NS][64] lse
  float* sDs = sL + NS * BQ;                                                  // [NS][64] Dsum
  float* sdQ = sDs + NS * BQ;  // [2 consumers][32·D]: a tile's dQ in fragment order (Note [dQ tiles])

  // Key block and head in head groups (Note [head groups]); causal: small kb (the most query tiles)
  // launches first within a group.
  // The grid's x is (batch, key/value head); with GQA the CTA's query tiles are n_per tiles of
  // each of the group's query heads in turn: tile i (CTA-wide count, which the stages, dSᵀ buffers
  // and barriers follow) is tile l = i − j·n_per of head hk·group + j.
  const TileSlot slot = tile_slot(p.head_group);
  const int kb = slot.rank;
  const int Hkv = Gqa ? p.H / p.group : p.H, G = Gqa ? p.group : 1;
  const int b = slot.bh / Hkv, hk = slot.bh % Hkv;
  const int64_t bh = int64_t(b) * p.H + hk * G;  // the first (without GQA: the one) query head's (b, h)
  const int k0 = kb * BK;
  const int qt_begin = p.causal ? k0 / BQ : 0;  // k0 < T, so at least one tile
  const int n_per = (p.T + BQ - 1) / BQ - qt_begin, n_tiles = G * n_per;
  const int wg = warpgroup_index(), tid = threadIdx.x % 128;

  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<kWbProducerRegs>();
    // The first (without GQA: the one) query head's Q and dO.
    const T* Qg = slice<T>(p.q, b, hk * G);
    const T* dOg = slice<T>(p.dout, b, hk * G);
    // Threads 0..63 copy lse, 64..127 Dsum: element tid % 64 of the tile, which they scale in place
    // once it has landed (lse by log2 e, Dsum by the softmax scale: Note [wgmma backward math]).
    const float* vec_g = (tid < BQ ? p.lse : p.dsum) + bh * p.T;
    float* vec_s = (tid < BQ ? sL : sDs) + tid % BQ;
    const float vec_scale = tid < BQ ? kLog2e : p.scale;
    // Tile j's copies have landed: scale its lse, Dsum, make Q, dO visible to wgmma, hand it over.
    auto publish = [&](int j) {
      cp_async_wait<0>();
      vec_s[(j % NS) * BQ] *= vec_scale;
      fence_proxy_async();
      bar_arrive(kBarFull + j % NS, kWbThreads);
    };
    // Tile i (tile l of query head h) into stage i % NS once tile i − NS has been consumed.
    auto produce = [&](int i, int l, const T* Qg, const T* dOg, const float* vec_g) {
      const int s = i % NS, q0 = (qt_begin + l) * BQ;
      if (i >= 1) publish(i - 1);
      if (i >= NS) bar_sync(kBarEmpty + s, kWbThreads);  // tile i-NS consumed
      load_wg_tile<T, D, BQ>(sQ + s * BQ * D, Qg, p.q.st, q0, p.T, tid);
      load_wg_tile<T, D, BQ>(sdO + s * BQ * D, dOg, p.dout.st, q0, p.T, tid);
      const int q = q0 + tid % BQ;
      cp_async_4(vec_s + s * BQ, vec_g + (q < p.T ? q : 0), q < p.T);
      cp_async_commit();
    };
    if constexpr (Gqa) {
      for (int j = 0; j < G; ++j) {
        const int h = hk * G + j;
        const float* vec_h = (tid < BQ ? p.lse : p.dsum) + (int64_t(b) * p.H + h) * p.T;
        for (int l = 0; l < n_per; ++l) produce(j * n_per + l, l, slice<T>(p.q, b, h), slice<T>(p.dout, b, h), vec_h);
      }
    } else {
      for (int i = 0; i < n_tiles; ++i) produce(i, i, Qg, dOg, vec_g);
    }
    publish(n_tiles - 1);
    return;
  }

  // ---- consumers ----
  setmaxnreg_inc<kWbConsumerRegs>();
  const int c = wg - 1;  // consumer index: keys k0 + 64c .. k0 + 64c + 63
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int kw0 = k0 + 64 * c;
  const int key_lo = kw0 + 16 * warp + g;  // this thread's keys (rows of Sᵀ, dK, dV): key_lo, key_lo + 8
  T* sKc = sK + c * 64 * D;
  T* sVc = sV + c * 64 * D;

  load_wg_tile<T, D, 64>(sKc, slice<T>(p.k, b, hk), p.k.st, kw0, p.T, tid);
  load_wg_tile<T, D, 64>(sVc, slice<T>(p.v, b, hk), p.v.st, kw0, p.T, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  bar_sync(kBarWg + c, 128);

  // Descriptors (see the header comment). koff: k step kk (16 columns of D) of a K-major [64][D] tile.
  const uint64_t dKa = make_desc(smem_u32(sKc), 16, 1024);              // A of Sᵀ
  const uint64_t dVa = make_desc(smem_u32(sVc), 16, 1024);              // A of dPᵀ
  const uint64_t dQk = make_desc(smem_u32(sQ), 16, 1024);               // B of Sᵀ
  const uint64_t dOk = make_desc(smem_u32(sdO), 16, 1024);              // B of dPᵀ
  const uint64_t dQn = make_desc(smem_u32(sQ), 64 * 128, 1024);         // B of dK
  const uint64_t dOn = make_desc(smem_u32(sdO), 64 * 128, 1024);        // B of dV
  const uint64_t dSm = make_desc(smem_u32(sdS), 64 * 128, 1024);        // A of dQ (M-major)
  const uint32_t kcol = D == 64 ? 64u * c : 8192u * c;                  // K column c·D/2
  const uint64_t dKn = make_desc(smem_u32(sK) + kcol, 64 * 128, 1024);  // B of dQ
  auto koff = [](int kk) { return uint32_t((kk / 4) * 64 * 128 + (kk % 4) * 32); };

  float dk[D / 2], dv[D / 2];  // 64 keys x D: d[4j + e] = row 16·warp + g + 8(e/2), column 8j + 2t + e%2
  float s[BQ / 2], dp[BQ / 2];  // Sᵀ (then Pᵀ), dPᵀ (then dSᵀ): 64 keys x 64 queries, same layout
  float dq[D / 4];              // 64 queries x D/2 (columns c·D/2 + ...), same layout
  // (s, dp and dq are written by the first k step of their products: wgmma_ss_first.)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) {
    dk[i] = dv[i] = 0.f;
  }
  uint32_t pf[BQ / 16][4], dsf[BQ / 16][4];  // Pᵀ, dSᵀ as A fragments, one per 16-query k step
  const float sl2 = p.scale * kLog2e;
  // The dQ tiles of query head h (Note [dQ tiles]); dq_tiles: those of the one head without GQA.
  auto head_dq_tiles = [&](int h) { return p.dq_accum + (int64_t(b) * p.H + h) * flash_dq_accum_floats(1, 1, p.T, D); };
  float* dq_tiles = p.dq_accum + bh * flash_dq_accum_floats(1, 1, p.T, D);
  // dSᵀ by stmatrix (Note [wgmma backward math]): this lane gives row 64c + 16·warp + lane % 8 +
  // 8·(lane / 8 % 2), 16-byte chunk 2kk + lane / 16 of it, stored at chunk (2kk + lane / 16) ^ (row
  // % 8) = 2kk ^ y: the address of k step kk is that of k step 0 with its bits 5-6 xor 32·kk.
  const uint32_t ds_addr0 = smem_u32(sdS) + (64 * c + 16 * warp + lane % 8 + 8 * (lane / 8 % 2)) * 128 +
                            (((lane / 16) ^ (lane % 8)) << 4);

  // Columns 16kk..16kk+15 of an accumulator as an A fragment (k step kk): column groups 2kk, 2kk+1.
  auto to_frag = [](const float (&x)[BQ / 2], uint32_t (&f)[BQ / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) f[kk][i] = Elem<T>::pack(x[8 * kk + 2 * i], x[8 * kk + 2 * i + 1]);
  };

  // dq (the dQ product of a query tile, complete) added to its dQ tile (Note [dQ tiles]): staged in
  // shared memory in fragment order, 16 bytes a thread and register group, at the end of the tile;
  // flushed at the start of the next (or after the last), once that tile's products are issued:
  // fence, warpgroup barrier, and thread 0's bulk reduction of this consumer's half (32·D floats).
  // Thread 0 waits for its read before the next dSᵀ barrier.
  float* sdQc = sdQ + c * 32 * D;
  auto stage_dq = [&] {
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      *reinterpret_cast<float4*>(sdQc + (j * 128 + tid) * 4) = make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
  };
  auto flush_dq = [&](float* tiles, int q0) {
    fence_proxy_async();  // the stores, for the bulk copy
    bar_sync(kBarWg + c, 128);
    if (tid == 0) {
      bulk_reduce_add_f32(tiles + int64_t(q0) * D + c * 32 * D, sdQc, 32 * D * 4);
      bulk_commit();
    }
  };

  // The tiles of a head that need the mask come first: with keys past T all of them, causal those
  // the diagonal crosses (q0 < kw0 + 63: l <= c, as qt_begin·64 = k0).
  const int n_masked = kw0 + 64 > p.T ? n_per : p.causal ? min(c + 1, n_per) : 0;
  // Tile i of the CTA, tile l of query head h. Masked: compiled with the mask, which zeroes Pᵀ
  // where keys are past T or, causal, after the query (Note [wgmma backward math]).
  auto tile = [&](auto masked, int i, int h, int l) {
    constexpr bool Masked = decltype(masked)::value;
    const int st = i % NS, q0 = (qt_begin + l) * BQ;
    const float* l_s = sL + st * BQ;   // lse·log2 e
    const float* ds_s = sDs + st * BQ;  // Dsum·scale
    bar_sync(kBarFull + st, kWbThreads);
    wgmma_fence();  // s, dp, dq, dk, dv, pf, dsf were accessed since the last wgmma
    wgmma_ss_first<T, 64, 0, 0>(s, dKa, desc_add(dQk, st * kTileBytes));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_ss<T, 64, 0, 0>(s, desc_add(dKa, koff(kk)), desc_add(dQk, st * kTileBytes + koff(kk)), 1);
    wgmma_commit();
    wgmma_ss_first<T, 64, 0, 0>(dp, dVa, desc_add(dOk, st * kTileBytes));
#pragma unroll
    for (int kk = 1; kk < D / 16; ++kk)
      wgmma_ss<T, 64, 0, 0>(dp, desc_add(dVa, koff(kk)), desc_add(dOk, st * kTileBytes + koff(kk)), 1);
    wgmma_commit();
    if (i > 0) {  // the previous tile's dQ: tile l − 1 of head h, or (l = 0, GQA) the last of head h − 1
      if constexpr (Gqa) flush_dq(head_dq_tiles(l > 0 ? h : h - 1), (l > 0 ? q0 : (qt_begin + n_per) * BQ) - BQ);
      else flush_dq(dq_tiles, q0 - BQ);
    }
    // lse·log2 e and Dsum·scale of this thread's queries, read while Sᵀ and dPᵀ run (at D = 128
    // after the waits: no registers to spare).
    float2 l2[BQ / 8], d2[BQ / 8];
    auto read_vec = [&](const float* v, float2 (&x)[BQ / 8]) {
#pragma unroll
      for (int j = 0; j < BQ / 8; ++j) x[j] = *reinterpret_cast<const float2*>(v + 8 * j + 2 * t);
    };
    if constexpr (D == 64) read_vec(l_s, l2);
    wgmma_wait<1>();  // Sᵀ
    pin(s);
    if constexpr (D != 64) read_vec(l_s, l2);

    // Pᵀ: element 4j + e is key key_lo + 8(e/2), query q0 + 8j + 2t + e%2.
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(s[4 * j + e] * sl2 - ((e & 1) ? l2[j].y : l2[j].x));
        if (Masked && l < n_masked) {
          const int key = key_lo + (e >> 1) * 8, q = q0 + 8 * j + 2 * t + (e & 1);
          if (key >= p.T || (p.causal && key > q)) pv = 0.f;
        }
        s[4 * j + e] = pv;
      }
    }
    to_frag(s, pf);
    wgmma_fence();  // pf
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk)
      wgmma_rs<T, D>(dv, pf[kk], desc_add(dOn, st * kTileBytes + kk * 2048), 1);
    wgmma_commit();
    if constexpr (D == 64) read_vec(ds_s, d2);
    wgmma_wait<1>();  // dPᵀ (dV may still run)
    pin(dp);
    if constexpr (D != 64) read_vec(ds_s, d2);

    // dSᵀ = Pᵀ ∘ (dPᵀ·scale − Dsum·scale), into registers and into dSᵀ buffer i % 2.
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * fmaf(dp[4 * j + e], p.scale, -((e & 1) ? d2[j].y : d2[j].x));
    to_frag(dp, dsf);
    const uint32_t ds_off = uint32_t(i & 1) * kDsBytes;
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      if constexpr (D == 64) {
        stmatrix_x4((ds_addr0 + ds_off) ^ uint32_t(32 * kk), dsf[kk]);
      } else {  // at D = 128 stmatrix's four-register operands make ptxas spill: 32-bit stores
        T* dst = sdS + (i & 1) * BK * BQ;
        const int r = 64 * c + 16 * warp + g, qc = 16 * kk + 2 * t;
        *reinterpret_cast<uint32_t*>(dst + swz<64>(r, qc)) = dsf[kk][0];
        *reinterpret_cast<uint32_t*>(dst + swz<64>(r + 8, qc)) = dsf[kk][1];
        *reinterpret_cast<uint32_t*>(dst + swz<64>(r, qc + 8)) = dsf[kk][2];
        *reinterpret_cast<uint32_t*>(dst + swz<64>(r + 8, qc + 8)) = dsf[kk][3];
      }
    }
    fence_proxy_async();  // the dSᵀ stores, for the dQ wgmma of both consumers
    wgmma_fence();        // dsf
    auto issue_dk = [&] {
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk)
        wgmma_rs<T, D>(dk, dsf[kk], desc_add(dQn, st * kTileBytes + kk * 2048), 1);
      wgmma_commit();
    };
    issue_dk();
    if (tid == 0) bulk_wait_read<0>();  // tile i-1's dQ has left sdQc
    bar_sync(kBarDs, 256);  // both halves of dSᵀ are in buffer i % 2; sdQ is free
    wgmma_ss_first<T, D / 2, 1, 1>(dq, desc_add(dSm, ds_off), dKn);
#pragma unroll
    for (int kk = 1; kk < BK / 16; ++kk)
      wgmma_ss<T, D / 2, 1, 1>(dq, desc_add(dSm, ds_off + kk * 2048),
                               desc_add(dKn, (kk / 4) * kHalfBytes + (kk % 4) * 2048), 1);
    wgmma_commit();
    wgmma_wait<0>();
    pin(dq);
    pin(dk);
    pin(dv);
    if (i + NS < n_tiles) bar_arrive(kBarEmpty + st, kWbThreads);
    stage_dq();
  };
  if constexpr (Gqa) {
    for (int j = 0; j < G; ++j) {
      const int h = hk * G + j, i0 = j * n_per;
      if constexpr (D == 64) {
        int l = 0;
        for (; l < n_masked; ++l) tile(std::true_type{}, i0 + l, h, l);
        for (; l < n_per; ++l) tile(std::false_type{}, i0 + l, h, l);
      } else {  // one copy of the loop: two make ptxas spill at D = 128
        for (int l = 0; l < n_per; ++l) tile(std::true_type{}, i0 + l, h, l);
      }
    }
    flush_dq(head_dq_tiles(hk * G + G - 1), (qt_begin + n_per - 1) * BQ);
  } else {
    if constexpr (D == 64) {
      int i = 0;
      for (; i < n_masked; ++i) tile(std::true_type{}, i, hk, i);
      for (; i < n_tiles; ++i) tile(std::false_type{}, i, hk, i);
    } else {  // one copy of the loop: two make ptxas spill at D = 128
      for (int i = 0; i < n_tiles; ++i) tile(std::true_type{}, i, hk, i);
    }
    flush_dq(dq_tiles, (qt_begin + n_tiles - 1) * BQ);
  }
  if (tid == 0) bulk_wait<0>();  // the last dQ tile added before the shared memory goes

  // Epilogue: dV, then dK, cast and staged through this consumer's V tile (its only reader, dPᵀ,
  // is done once every warp of the warpgroup passes the first barrier), stored with 16-byte
  // coalesced writes.
  constexpr int kChunks = D / 8;
  auto store = [&](const float (&acc)[D / 2], const AttnOperand& out) {
    bar_sync(kBarWg + c, 128);
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        *reinterpret_cast<uint32_t*>(sVc + wg_off<64>(16 * warp + g + 8 * rr, 8 * j + 2 * t)) =
            Elem<T>::pack(acc[4 * j + 2 * rr], acc[4 * j + 2 * rr + 1]);
    bar_sync(kBarWg + c, 128);
    T* dst = slice_mut<T>(out, b, hk);
#pragma unroll
    for (int it = 0; it < 64 * kChunks / 128; ++it) {
      const int idx = tid + it * 128;
      const int rr = idx / kChunks, ch = idx % kChunks;
      if (kw0 + rr < p.T)
        *reinterpret_cast<uint4*>(dst + int64_t(kw0 + rr) * out.st + ch * 8) =
            *reinterpret_cast<const uint4*>(sVc + wg_off<64>(rr, ch * 8));
    }
  };
  // Note [RoPE in the dQ cast]: dK rotated back in registers. The tables' values for this thread's
  // two keys are loaded before dV's store, which hides their latency.
  float rc[D / 2], rs[D / 2];  // per (key rr, column j, e): cos/sin at col, then at col + D/2 from D/4
  if (p.rope_cos) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int key = min(key_lo + 8 * rr, p.T - 1);
      const float* cs = p.rope_cos + int64_t(key) * D;
      const float* sn = p.rope_sin + int64_t(key) * D;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) {
        const float2 c_lo = *reinterpret_cast<const float2*>(cs + 8 * j + 2 * t);
        const float2 c_hi = *reinterpret_cast<const float2*>(cs + 8 * j + 2 * t + D / 2);
        const float2 s_lo = *reinterpret_cast<const float2*>(sn + 8 * j + 2 * t);
        const float2 s_hi = *reinterpret_cast<const float2*>(sn + 8 * j + 2 * t + D / 2);
        const int k = (rr * (D / 16) + j) * 2;
        rc[k] = c_lo.x, rc[k + 1] = c_lo.y, rs[k] = s_lo.x, rs[k + 1] = s_lo.y;
        rc[D / 4 + k] = c_hi.x, rc[D / 4 + k + 1] = c_hi.y, rs[D / 4 + k] = s_hi.x, rs[D / 4 + k + 1] = s_hi.y;
      }
    }
  }
  store(dv, p.dv);
  if (p.rope_cos) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
      for (int j = 0; j < D / 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = (rr * (D / 16) + j) * 2 + e, i1 = 4 * j + 2 * rr + e, i2 = 4 * (j + D / 16) + 2 * rr + e;
          rope_pair<true>(dk[i1], dk[i2], rc[k], rs[k], rc[D / 4 + k], rs[D / 4 + k], dk[i1], dk[i2]);
        }
  }
  store(dk, p.dk);
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
}

template <typename T, int D, bool Gqa>
void launch_bwd_wgmma_variant(const FlashBwdParams& p, cudaStream_t stream) {
  constexpr int smem = wb_smem_bytes<D>();
  static std::atomic<uint64_t> configured{0};  // one bit per device
  ensure_smem_limit(flash_bwd_wgmma_kernel<T, D, Gqa>, smem, configured);
  const int num_kb = (p.T + kWbBK - 1) / kWbBK;
  BLU_CHECK(num_kb <= 65535, "flash_attention_backward: sequence too long (T = ", p.T, ")");
  const dim3 grid(unsigned(p.B) * unsigned(p.H / p.group), unsigned(num_kb));  // (batch, key/value head)
  flash_bwd_wgmma_kernel<T, D, Gqa><<<grid, kWbThreads, smem, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
}
template <typename T, int D>
void launch_bwd_wgmma(const FlashBwdParams& p, cudaStream_t stream) {
  if (p.group > 1) {
    // A CTA reads Q, dO and adds to dQ of `group` query heads: as many fewer key/value heads per
    // head group keep a group's working set in the L2, unless that order ends later (Note [GQA
    // head groups]).
    FlashBwdParams pg = p;
    pg.head_group = gqa_backward_head_group(p.B * (p.H / p.group), (p.T + kWbBK - 1) / kWbBK,
                                            (p.T + kWbBQ - 1) / kWbBQ, p.group, p.causal, sm_count(),
                                            p.head_group > 0 ? std::max(1, p.head_group / p.group) : 0);
    return launch_bwd_wgmma_variant<T, D, true>(pg, stream);
  }
  launch_bwd_wgmma_variant<T, D, false>(p, stream);
}

// float4 number f of a dQ tile (Note [dQ tiles]: consumer c, register group j, thread tid of the
// backward; its registers 4j..4j+3) put in row order.
template <int D>
__device__ __forceinline__ void scatter_dq(float (*rows)[D + 4], int f, float4 v) {
  const int c = f / (8 * D), j = f % (8 * D) / 128, tid = f % 128;
  const int r = 16 * (tid / 32) + (tid % 32) / 4, col = c * (D / 2) + 8 * j + 2 * (tid % 4);
  rows[r][col] = v.x;
  rows[r][col + 1] = v.y;
  rows[r + 8][col] = v.z;
  rows[r + 8][col + 1] = v.w;
}

// dQ tiles (Note [dQ tiles]) cast into the strided dq: a block of 256 threads per 64-row tile reads
// its 64·D floats as float4s in order, puts them in row order in shared memory, and writes whole
// rows, 16 bytes a thread.
template <typename T, int D>
__global__ void __launch_bounds__(256) flash_bwd_dq_tiles_convert_kernel(FlashBwdParams p) {
  __shared__ __align__(16) float rows[kWbBQ][D + 4];  // + 4: fewer bank conflicts on the scatter
  const int n_qt = (p.T + kWbBQ - 1) / kWbBQ;
  const int bh = int(blockIdx.x) / n_qt, qt = int(blockIdx.x) % n_qt;
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum + int64_t(blockIdx.x) * kWbBQ * D);
  for (int f = threadIdx.x; f < kWbBQ * D / 4; f += 256) scatter_dq<D>(rows, f, src[f]);
  __syncthreads();
  T* dst = slice_mut<T>(p.dq, bh / p.H, bh % p.H);
  for (int idx = threadIdx.x; idx < kWbBQ * D / 8; idx += 256) {
    const int r = idx / (D / 8), ch = idx % (D / 8), q = qt * kWbBQ + r;
    if (q >= p.T) continue;
    const float4 lo = *reinterpret_cast<const float4*>(&rows[r][ch * 8]);
    const float4 hi = *reinterpret_cast<const float4*>(&rows[r][ch * 8 + 4]);
    const uint4 out{Elem<T>::pack(lo.x, lo.y), Elem<T>::pack(lo.z, lo.w), Elem<T>::pack(hi.x, hi.y),
                    Elem<T>::pack(hi.z, hi.w)};
    *reinterpret_cast<uint4*>(dst + int64_t(q) * p.dq.st + ch * 8) = out;
  }
}

// Note [RoPE in the dQ cast]
// When q and k were rotated by RoPE (rotary_attention, ops/attention.h), the gradients the caller
// wants are those of q and k before the rotation: rotary_embedding_backward's y[j] = g[j]·cos[j] +
// g[j+D/2]·sin[j+D/2], y[j+D/2] = g[j+D/2]·cos[j+D/2] − g[j]·sin[j] at the row's position
// (rope_pair<true>, rotary.cuh). Both are taken where the gradient is still fp32, so each rounds
// once where a separate rotary backward would round twice, and no pass over dQ or dK is added:
// - dK: a thread's accumulator holds columns c and c + D/2 of its two keys (registers 4j + e and
//   4(j + D/16) + e of the layout above), so the epilogue rotates them in registers before the cast.
// - dQ: the cast below has a tile's rows in shared memory in fp32; a thread takes 8 columns of the
//   first half and their partners D/2 on. Its cos/sin (4 · 8 floats a row-chunk) come from L2 once
//   and serve kRopeHeads heads of the same query tile, which a block takes in turn: read per head,
//   the tables' 32 KiB a tile cost more L2 traffic than the tile's 16 KiB of dQ (measured: the cast
//   222 → 315 µs a step on llama-250m, H200).
constexpr int kRopeHeads = 4;

template <typename T, int D>
__global__ void __launch_bounds__(256) flash_bwd_dq_tiles_convert_rope_kernel(FlashBwdParams p) {
  constexpr int h = D / 2, kItems = kWbBQ * h / 8 / 256;  // (row, 8-column chunk) items a thread
  __shared__ __align__(16) float rows[kWbBQ][D + 4];
  const int n_qt = (p.T + kWbBQ - 1) / kWbBQ, n_hg = (p.H + kRopeHeads - 1) / kRopeHeads;
  const int qt = int(blockIdx.x) % n_qt, hg = int(blockIdx.x) / n_qt % n_hg, b = int(blockIdx.x) / n_qt / n_hg;
  float c1[kItems][8], c2[kItems][8], s1[kItems][8], s2[kItems][8];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = threadIdx.x + it * 256, r = idx / (h / 8), j = idx % (h / 8) * 8;
    const int q = min(qt * kWbBQ + r, p.T - 1);
    const float* cs = p.rope_cos + int64_t(q) * D;
    const float* sn = p.rope_sin + int64_t(q) * D;
#pragma unroll
    for (int v = 0; v < 8; v += 4) {
      *reinterpret_cast<float4*>(&c1[it][v]) = *reinterpret_cast<const float4*>(cs + j + v);
      *reinterpret_cast<float4*>(&c2[it][v]) = *reinterpret_cast<const float4*>(cs + j + h + v);
      *reinterpret_cast<float4*>(&s1[it][v]) = *reinterpret_cast<const float4*>(sn + j + v);
      *reinterpret_cast<float4*>(&s2[it][v]) = *reinterpret_cast<const float4*>(sn + j + h + v);
    }
  }
  const int h0 = hg * kRopeHeads, h_end = min(p.H, h0 + kRopeHeads);
  // A head's tile is loaded into registers while the one before is rotated and stored.
  constexpr int kLoads = kWbBQ * D / 4 / 256;
  auto tile = [&](int hh) {
    return reinterpret_cast<const float4*>(p.dq_accum + (int64_t(b * p.H + hh) * n_qt + qt) * kWbBQ * D);
  };
  float4 next[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) next[l] = tile(h0)[threadIdx.x + l * 256];
  for (int hh = h0; hh < h_end; ++hh) {
    if (hh != h0) __syncthreads();  // the previous head's rows are read
#pragma unroll
    for (int l = 0; l < kLoads; ++l) scatter_dq<D>(rows, threadIdx.x + l * 256, next[l]);
    __syncthreads();
    if (hh + 1 < h_end) {
#pragma unroll
      for (int l = 0; l < kLoads; ++l) next[l] = tile(hh + 1)[threadIdx.x + l * 256];
    }
    T* dst = slice_mut<T>(p.dq, b, hh);
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int idx = threadIdx.x + it * 256, r = idx / (h / 8), j = idx % (h / 8) * 8, q = qt * kWbBQ + r;
      if (q >= p.T) continue;
      float a[8], g2[8], y1[8], y2[8];
#pragma unroll
      for (int v = 0; v < 8; v += 4) {
        *reinterpret_cast<float4*>(&a[v]) = *reinterpret_cast<const float4*>(&rows[r][j + v]);
        *reinterpret_cast<float4*>(&g2[v]) = *reinterpret_cast<const float4*>(&rows[r][j + h + v]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e)
        rope_pair<true>(a[e], g2[e], c1[it][e], s1[it][e], c2[it][e], s2[it][e], y1[e], y2[e]);
      *reinterpret_cast<uint4*>(dst + int64_t(q) * p.dq.st + j) =
          uint4{Elem<T>::pack(y1[0], y1[1]), Elem<T>::pack(y1[2], y1[3]), Elem<T>::pack(y1[4], y1[5]),
                Elem<T>::pack(y1[6], y1[7])};
      *reinterpret_cast<uint4*>(dst + int64_t(q) * p.dq.st + j + h) =
          uint4{Elem<T>::pack(y2[0], y2[1]), Elem<T>::pack(y2[2], y2[3]), Elem<T>::pack(y2[4], y2[5]),
                Elem<T>::pack(y2[6], y2[7])};
    }
  }
}

template <typename T, int D>
void launch_bwd_wgmma_all(const FlashBwdParams& p, cudaStream_t stream) {
  launch_bwd_wgmma<T, D>(p, stream);
  const int64_t blocks = int64_t(p.B) * p.H * ((p.T + kWbBQ - 1) / kWbBQ);
  BLU_CHECK(blocks <= 0x7fffffff, "flash_attention_backward: too many query tiles");
  if (p.rope_cos) {  // Note [RoPE in the dQ cast]
    const int64_t rope_blocks = int64_t(p.B) * ((p.H + kRopeHeads - 1) / kRopeHeads) * ((p.T + kWbBQ - 1) / kWbBQ);
    flash_bwd_dq_tiles_convert_rope_kernel<T, D><<<unsigned(rope_blocks), 256, 0, stream>>>(p);
  } else {
    flash_bwd_dq_tiles_convert_kernel<T, D><<<unsigned(blocks), 256, 0, stream>>>(p);
  }
  BLU_CUDA_CHECK_LAUNCH();
}

}  // namespace

void flash_attention_backward_wgmma(const FlashBwdParams& params, DType dtype, cudaStream_t stream) {
  FlashBwdParams p = params;
  p.head_group = flash_attention_head_group(true);
  BLU_ASSERT(p.D == 64 || p.D == 128, "flash_attention_backward_wgmma: D = ", p.D);
  BLU_ASSERT(p.dq_accum && p.dsum, "flash_attention_backward_wgmma: needs dq_accum and dsum");
  // The caller zeroed B·H·T·D floats; the tiles of a T that is not a multiple of 64 have more.
  const int64_t zeroed = int64_t(p.B) * p.H * p.T * p.D, floats = flash_dq_accum_floats(p.B, p.H, p.T, p.D);
  if (floats > zeroed)
    BLU_CUDA_CHECK(cudaMemsetAsync(p.dq_accum + zeroed, 0, size_t(floats - zeroed) * sizeof(float), stream));
  switch (dtype) {
    case DType::bf16:
      return p.D == 64 ? launch_bwd_wgmma_all<__nv_bfloat16, 64>(p, stream)
                       : launch_bwd_wgmma_all<__nv_bfloat16, 128>(p, stream);
    case DType::f16:
      return p.D == 64 ? launch_bwd_wgmma_all<__half, 64>(p, stream) : launch_bwd_wgmma_all<__half, 128>(p, stream);
    default: BLU_ASSERT(false, "flash_attention_backward_wgmma: unsupported dtype ", dtype);
  }
}

}  // namespace flash

}  // namespace blu::cuda
