// What the cuBLASLt lab programs (gemm_algos.cu, gemm_search.cu) share: error checks that exit,
// the handle and 32 MiB workspace, and random bf16 operands.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#define LT(x)                                                                   \
  do {                                                                          \
    cublasStatus_t s_ = (x);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                          \
      std::fprintf(stderr, "%s:%d cublasLt %d\n", __FILE__, __LINE__, int(s_)); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

static cublasLtHandle_t handle;
static void* workspace;
static const size_t kWorkspace = size_t(32) << 20;

// Values in [-1, 1) from a hash of the index: a tensor core's power, and so its clock, depends on
// the bits, so operands are never constant.
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 0x9e3779b9u;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    p[i] = __float2bfloat16(float(h) / 2147483648.0f - 1.0f);
  }
}
