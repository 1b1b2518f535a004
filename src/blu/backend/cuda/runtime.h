// backend/cuda/runtime: the CUDA runtime as the kernels use it — everything of
// core/cuda/runtime.h (error checks, devices, streams, events, the current stream) plus what only
// kernels need: cuBLAS error checking, the per-device cuBLASLt handle, and the launch geometry
// helper. Kernel files include this header.
// Depends on core/cuda/runtime, core/error, the CUDA runtime and cuBLASLt. Keep: every CUDA call
// is wrapped in BLU_CUDA_CHECK (cuBLAS calls in BLU_CUBLAS_CHECK); every kernel launch is followed
// by BLU_CUDA_CHECK_LAUNCH(); kernels launch on their call's context stream (stream_of(call.ctx)),
// never on the legacy default stream, and take scratch from the call's workspace.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "blu/core/cuda/runtime.h"
#include "blu/core/error.h"

namespace blu::cuda {

[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line);

}  // namespace blu::cuda

#define BLU_CUBLAS_CHECK(expr)                                                                      \
  do {                                                                                              \
    const cublasStatus_t blu_st_ = (expr);                                                          \
    if (blu_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                              \
      ::blu::cuda::throw_cublas_error(blu_st_, #expr, __FILE__, __LINE__);                          \
  } while (0)

namespace blu::cuda {

// Per-device cuBLASLt handle (created once, on first use). Its workspace comes with each call
// (gemm.h).
cublasLtHandle_t cublaslt_handle();

// Launch geometry helper: blocks of `threads` covering n elements, capped for grid-stride loops.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

}  // namespace blu::cuda
