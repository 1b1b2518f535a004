// backend/cuda/flash_attention_f32: the f32 path of flash_attention_forward / _backward
// (flash_attention.cu and flash_attention_backward.cu route f32 here). By default it runs the
// TF32 tensor-core kernels of flash_attention_tf32.cu, 1xTF32 when matmul_precision() is "tf32"
// and 3xTF32 (fp32-level accuracy) when it is "ieee"; with set_flash_attention_f32_cuda_cores(true)
// it runs the register-blocked IEEE-fp32 CUDA-core kernels of flash_attention_f32.cu instead.
// Keep: same contract as flash_attention.h; both backwards write p.dsum (need it) and leave
// p.dq_accum unused. The CUDA-core backward is deterministic; the TF32 backward sums dQ with fp32
// atomics into p.dq (dK, dV deterministic; dQ may differ between runs at rounding level).
#pragma once
#include <cuda_runtime.h>

#include "blu/backend/cuda/flash_attention.h"

namespace blu::cuda::flash {

// The f32 entry points: pick the kernels as described above.
void flash_attention_forward_f32(const FlashFwdParams& p, cudaStream_t stream);
void flash_attention_backward_f32(const FlashBwdParams& p, cudaStream_t stream);

// The TF32 tensor-core kernels (head dim 64 or 128); split 1 = 1xTF32, 3 = 3xTF32.
void flash_attention_forward_tf32(const FlashFwdParams& p, int split, cudaStream_t stream);
void flash_attention_backward_tf32(const FlashBwdParams& p, int split, cudaStream_t stream);

}  // namespace blu::cuda::flash
