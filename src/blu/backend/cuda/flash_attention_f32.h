// backend/cuda/flash_attention_f32: the fp32 flash-attention kernels (IEEE fp32 on CUDA cores, no
// TF32), register-blocked like an SGEMM; flash_attention.cu and flash_attention_backward.cu route
// f32 here. Keep: same contract as flash_attention.h; the backward writes p.dsum (needs it) and
// leaves p.dq_accum unused; deterministic (no atomics).
#pragma once
#include <cuda_runtime.h>

#include "blu/backend/cuda/flash_attention.h"

namespace blu::cuda::flash {

void flash_attention_forward_f32(const FlashFwdParams& p, cudaStream_t stream);
void flash_attention_backward_f32(const FlashBwdParams& p, cudaStream_t stream);

}  // namespace blu::cuda::flash
