// backend/cuda/flash_attention_wgmma: the Hopper (sm_90a) forward and backward of flash attention
// for bf16/f16, head dim 64 or 128, written with warpgroup MMA (wgmma) in the FlashAttention-3
// scheme (flash_attention_wgmma.cu, flash_attention_wgmma_backward.cu; shared device pieces in
// flash_attention_wgmma.cuh). flash_attention_forward (flash_attention.cu) routes bf16/f16 here
// when flash_attention_wgmma_available() and the set_flash_attention_wgmma hook allow it, and to
// the mma.sync kernel otherwise; flash_attention_backward likewise under
// set_flash_attention_wgmma_backward.
// Keep: same contract and same results (up to rounding) as the mma.sync kernels: out and the
// natural-log lse of the scaled scores; dq (through the fp32 dq_accum), dk, dv; every layout that
// flash_attention.h admits.
#pragma once
#include <cuda_runtime.h>

#include "blu/backend/cuda/flash_attention.h"

namespace blu::cuda::flash {

// Launch on `stream`; dtype bf16 or f16, p.D 64 or 128, flash_attention_wgmma_available().
void flash_attention_forward_wgmma(const FlashFwdParams& p, DType dtype, cudaStream_t stream);
// The backward after Dsum: dk, dv, and dQ through p.dq_accum in 64-row tiles (Note [dQ tiles]),
// cast into dq at the end. The caller filled p.dsum and zeroed the first B·H·T·D floats of
// dq_accum (flash_dq_accum_floats of them exist). Same conditions as the forward.
void flash_attention_backward_wgmma(const FlashBwdParams& p, DType dtype, cudaStream_t stream);

}  // namespace blu::cuda::flash
