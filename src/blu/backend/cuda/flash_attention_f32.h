// backend/cuda/flash_attention_f32: the f32 path of flash_attention_forward / _backward
// (flash_attention.cu and flash_attention_backward.cu route f32 here): the TF32 tensor-core kernels
// of flash_attention_tf32.cu, 1xTF32 when matmul_precision() is "tf32" and 3xTF32 (fp32-level
// accuracy) when it is "ieee".
// Keep: same contract as flash_attention.h; the backward writes p.dsum (needs it) and leaves
// p.dq_accum unused; it sums dQ with fp32 atomics into p.dq (dK, dV deterministic; dQ may differ
// between runs at rounding level).
#pragma once
#include <cuda_runtime.h>

#include "blu/backend/cuda/flash_attention.h"

namespace blu::cuda::flash {

// The f32 entry points: the TF32 kernels at the split matmul_precision() asks for.
void flash_attention_forward_f32(const FlashFwdParams& p, cudaStream_t stream);
void flash_attention_backward_f32(const FlashBwdParams& p, cudaStream_t stream);

// The TF32 tensor-core kernels (head dim 64 or 128); split 1 = 1xTF32, 3 = 3xTF32.
void flash_attention_forward_tf32(const FlashFwdParams& p, int split, cudaStream_t stream);
void flash_attention_backward_tf32(const FlashBwdParams& p, int split, cudaStream_t stream);

}  // namespace blu::cuda::flash
