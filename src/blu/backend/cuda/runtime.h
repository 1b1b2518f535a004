// backend/cuda/runtime: the CUDA runtime as the kernels use it — everything of
// core/cuda/runtime.h (error checks, devices, streams, events, the current stream) plus what only
// kernels need: cuBLAS error checking, cuBLASLt's entry points and the per-device handle, and the
// launch geometry helper. Kernel files include this header.
// cuBLASLt is not linked: it is loaded on the first GPU GEMM (cublaslt()). Its static
// initialisation costs about 0.43 s of CPU in every process that links it (a program that only
// links it, 10 runs on the 2-core CI machine), which every CPU run, `blutrain --help` and each of
// the test processes paid.
// Depends on core/cuda/runtime, core/error, the CUDA runtime and cuBLASLt's header. Keep: every CUDA call
// is wrapped in BLU_CUDA_CHECK (cuBLAS calls in BLU_CUBLAS_CHECK); every kernel launch is followed
// by BLU_CUDA_CHECK_LAUNCH(); kernels launch on their call's context stream (stream_of(call.ctx)),
// never on the legacy default stream, and take scratch from the call's workspace.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

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

// The cuBLASLt entry points the backend calls, named without their "cublasLt" prefix.
struct CublasLtApi {
  decltype(&::cublasLtGetVersion) GetVersion;
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulAlgoCheck) MatmulAlgoCheck;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  decltype(&::cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute;
};

// cuBLASLt, loaded on the first call: libcublasLt.so.<the header's major version> from the
// directory of the CUDA runtime this process uses (the same toolkit), else by the library search
// path. BLU_CHECK: the library loads, has every entry point, and its major version is the header's.
const CublasLtApi& cublaslt();
// Where cublaslt() loaded the library from.
std::string cublaslt_path();

// Per-device cuBLASLt handle (created once, on first use). Its workspace comes with each call
// (gemm.h).
cublasLtHandle_t cublaslt_handle();

// Launch geometry helper: blocks of `threads` covering n elements, capped for grid-stride loops.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

}  // namespace blu::cuda
