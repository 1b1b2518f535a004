// Lab variant (not built): the plain SIMT flash-attention kernels — one warp per query row (forward,
// backward dQ) or per key row (backward dK, dV; per key/value head over the queries of its group's
// query heads), every dtype but f64, deterministic, scores recomputed in each. They were kept in
// src/ as a cross-check of the tensor-core kernels and selected by a test hook
// (set_flash_attention_force_simt); no shipping path uses them, so they live here. To run them again: paste the kernels and launchers below into
// src/blu/backend/cuda/flash_attention.cu (forward) and flash_attention_backward.cu (backward,
// inside namespace flash, where flash_bwd_dsum_kernel and dsum_blocks are), call
// launch_fwd_simt<T, D> / launch_bwd_simt<T, D> from fwd_dispatch_d / bwd_dispatch_d, and run
// build-cuda/tests/test_cuda --gtest_filter='FlashAttention*' (the sweeps compare against an f64
// reference on the CPU).
#include "blu/backend/cuda/flash_attention.cuh"

namespace blu::cuda::flash {

// === forward (flash_attention.cu) ===
// ---------------------------------------------------------------------------------------------
// SIMT forward: warp per query row.
template <typename T, int D>
__global__ void __launch_bounds__(128) flash_fwd_simt_kernel(FlashFwdParams p) {
  constexpr int E = D / 32;  // columns per lane: lane l holds columns [l*E, l*E + E)
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= int64_t(p.B) * p.H * p.T) return;
  const int i = int(row % p.T);
  const int bh = int(row / p.T), b = bh / p.H, h = bh % p.H;
  const T* qp = slice<T>(p.q, b, h) + int64_t(i) * p.q.st + lane * E;
  const T* kb = slice<T>(p.k, b, h / p.group) + lane * E;  // the query head's key/value head (GQA)
  const T* vb = slice<T>(p.v, b, h / p.group) + lane * E;
  float q[E], acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    q[e] = Elem<T>::load(qp + e);
    acc[e] = 0.f;
  }
  float m = kNegInf, l = 0.f;
  const int jend = p.causal ? i + 1 : p.T;
  for (int j = 0; j < jend; ++j) {
    const T* kr = kb + int64_t(j) * p.k.st;
    const T* vr = vb + int64_t(j) * p.v.st;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) dot += q[e] * Elem<T>::load(kr + e);
    const float s = warp_sum(dot) * p.scale;
    const float m_new = fmaxf(m, s);
    const float alpha = __expf(m - m_new);  // 0 on the first key (m = -inf)
    const float pj = __expf(s - m_new);
    l = l * alpha + pj;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = acc[e] * alpha + pj * Elem<T>::load(vr + e);
    m = m_new;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* op = slice_mut<T>(p.o, b, h) + int64_t(i) * p.o.st + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) Elem<T>::store(op + e, acc[e] * inv);
  if (lane == 0) p.lse[row] = l > 0.f ? m + logf(l) : kNegInf;
}

template <typename T, int D>
void launch_fwd_simt(const FlashFwdParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.B) * p.H * p.T;
  const int64_t blocks = (rows + 3) / 4;
  BLU_CHECK(blocks <= 0x7fffffff, "flash_attention: too many rows (", rows, ")");
  flash_fwd_simt_kernel<T, D><<<unsigned(blocks), 128, 0, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
}


// === backward (flash_attention_backward.cu) ===
// ---------------------------------------------------------------------------------------------
// SIMT dQ: warp per query row i, over the keys it sees.
template <typename T, int D>
__global__ void __launch_bounds__(128) flash_bwd_dq_simt_kernel(FlashBwdParams p) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= int64_t(p.B) * p.H * p.T) return;
  const int i = int(row % p.T);
  const int bh = int(row / p.T), b = bh / p.H, h = bh % p.H;
  const T* qp = slice<T>(p.q, b, h) + int64_t(i) * p.q.st + lane * E;
  const T* dop = slice<T>(p.dout, b, h) + int64_t(i) * p.dout.st + lane * E;
  const T* kb = slice<T>(p.k, b, h / p.group) + lane * E;  // the query head's key/value head (GQA)
  const T* vb = slice<T>(p.v, b, h / p.group) + lane * E;
  float q[E], dov[E], dq[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    q[e] = Elem<T>::load(qp + e);
    dov[e] = Elem<T>::load(dop + e);
    dq[e] = 0.f;
  }
  const float lse = p.lse[row], dsum = p.dsum[row];
  const int jend = p.causal ? i + 1 : p.T;
  for (int j = 0; j < jend; ++j) {
    const T* kr = kb + int64_t(j) * p.k.st;
    const T* vr = vb + int64_t(j) * p.v.st;
    float kv[E], s = 0.f, dp = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kv[e] = Elem<T>::load(kr + e);
      s += q[e] * kv[e];
      dp += dov[e] * Elem<T>::load(vr + e);
    }
    s = warp_sum(s);
    dp = warp_sum(dp);
    const float pij = __expf(s * p.scale - lse);
    const float ds = pij * (dp - dsum) * p.scale;
#pragma unroll
    for (int e = 0; e < E; ++e) dq[e] += ds * kv[e];
  }
  T* dqp = slice_mut<T>(p.dq, b, h) + int64_t(i) * p.dq.st + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) Elem<T>::store(dqp + e, dq[e]);
}

// SIMT dK, dV: warp per key row j of key/value head hk, over the queries that see it in each of
// hk's query heads (hk·group .. hk·group + group − 1, in order: Note [GQA backward]).
template <typename T, int D>
__global__ void __launch_bounds__(128) flash_bwd_dkv_simt_kernel(FlashBwdParams p) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const int Hkv = p.H / p.group;
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (row >= int64_t(p.B) * Hkv * p.T) return;
  const int j = int(row % p.T);
  const int bhk = int(row / p.T), b = bhk / Hkv, hk = bhk % Hkv;
  const T* kp = slice<T>(p.k, b, hk) + int64_t(j) * p.k.st + lane * E;
  const T* vp = slice<T>(p.v, b, hk) + int64_t(j) * p.v.st + lane * E;
  float k[E], v[E], dk[E], dv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    k[e] = Elem<T>::load(kp + e);
    v[e] = Elem<T>::load(vp + e);
    dk[e] = dv[e] = 0.f;
  }
  for (int h = hk * p.group; h < (hk + 1) * p.group; ++h) {
    const T* qb = slice<T>(p.q, b, h) + lane * E;
    const T* dob = slice<T>(p.dout, b, h) + lane * E;
    const float* lse = p.lse + (int64_t(b) * p.H + h) * p.T;
    const float* dsum = p.dsum + (int64_t(b) * p.H + h) * p.T;
    for (int i = p.causal ? j : 0; i < p.T; ++i) {
      const T* qr = qb + int64_t(i) * p.q.st;
      const T* dor = dob + int64_t(i) * p.dout.st;
      float qv[E], dov[E], s = 0.f, dp = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        qv[e] = Elem<T>::load(qr + e);
        dov[e] = Elem<T>::load(dor + e);
        s += qv[e] * k[e];
        dp += dov[e] * v[e];
      }
      s = warp_sum(s);
      dp = warp_sum(dp);
      const float pij = __expf(s * p.scale - lse[i]);
      const float ds = pij * (dp - dsum[i]) * p.scale;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        dv[e] += pij * dov[e];
        dk[e] += ds * qv[e];
      }
    }
  }
  T* dkp = slice_mut<T>(p.dk, b, hk) + int64_t(j) * p.dk.st + lane * E;
  T* dvp = slice_mut<T>(p.dv, b, hk) + int64_t(j) * p.dv.st + lane * E;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    Elem<T>::store(dkp + e, dk[e]);
    Elem<T>::store(dvp + e, dv[e]);
  }
}

// Blocks of 4 warps, a warp per row of B·heads·T.
unsigned row_blocks(const FlashBwdParams& p, int heads) {
  const int64_t blocks = (int64_t(p.B) * heads * p.T + 3) / 4;
  BLU_CHECK(blocks <= 0x7fffffff, "flash_attention_backward: too many rows");
  return unsigned(blocks);
}

template <typename T, int D>
void launch_bwd_simt(const FlashBwdParams& p, cudaStream_t stream) {
  FlashBwdParams pd = p;
  pd.dq_accum = nullptr;  // the SIMT kernels need no accumulator
  flash_bwd_dsum_kernel<T, D><<<dsum_blocks<T, D>(p), 256, 0, stream>>>(pd);
  BLU_CUDA_CHECK_LAUNCH();
  flash_bwd_dq_simt_kernel<T, D><<<row_blocks(p, p.H), 128, 0, stream>>>(p);
  BLU_CUDA_CHECK_LAUNCH();
  flash_bwd_dkv_simt_kernel<T, D><<<row_blocks(p, p.H / p.group), 128, 0, stream>>>(p);  // key/value rows
  BLU_CUDA_CHECK_LAUNCH();
}

}  // namespace blu::cuda::flash
