// backend/cuda/peer_add: the arithmetic half of a two-rank all-reduce whose transfer is a copy
// (dist/nccl_peer_window.h): dst ← (dst + src) · scale, elementwise, in dst's float dtype.
// Depends on core/dtype and the CUDA runtime. Keep: the sum is formed in the dtype's arithmetic
// type (float for bf16/f16) and rounded once, so both ranks, adding the same two operands in either
// order, get the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "blu/core/dtype.h"

namespace blu::cuda {

// n elements of dtype dt (f32, f64, bf16 or f16) at dst and src (device pointers, any alignment);
// enqueued on `s`.
void peer_add(void* dst, const void* src, int64_t n, DType dt, double scale, cudaStream_t s);

}  // namespace blu::cuda
