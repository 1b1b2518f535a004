// What the cuBLASLt lab programs (gemm_algos.cu, gemm_search.cu, gemm_epilogues.cu) share: error
// checks that exit, the handle and 32 MiB workspace, random bf16 operands, one matmul's timing.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lab_check.cuh"

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

// One matmul: its descriptor, layouts and operands.
struct Problem {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  const void *a, *b;
  void* c;
};

// ms per call of `algo` on p (beta 0), `warm` untimed calls first; negative when it fails to run.
static float time_algo(const Problem& p, const cublasLtMatmulAlgo_t& algo, int warm, int reps) {
  const float alpha = 1, beta = 0;
  for (int i = 0; i < warm; ++i)
    if (cublasLtMatmul(handle, p.desc, &alpha, p.a, p.la, p.b, p.lb, &beta, p.c, p.lc, p.c, p.lc, &algo, workspace,
                       kWorkspace, 0) != CUBLAS_STATUS_SUCCESS) {
      cudaGetLastError();
      return -1;
    }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i)
    cublasLtMatmul(handle, p.desc, &alpha, p.a, p.la, p.b, p.lb, &beta, p.c, p.lc, p.c, p.lc, &algo, workspace,
                   kWorkspace, 0);
  CK(cudaEventRecord(e1));
  if (cudaEventSynchronize(e1) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / reps;
}

static void destroy(Problem& p) {
  cublasLtMatrixLayoutDestroy(p.la);
  cublasLtMatrixLayoutDestroy(p.lb);
  cublasLtMatrixLayoutDestroy(p.lc);
  cublasLtMatmulDescDestroy(p.desc);
}

// The heuristic's first `want` candidates for p (within the workspace); how many it found (0 when
// it has none or refuses the problem).
static int heuristic(const Problem& p, int want, std::vector<cublasLtMatmulHeuristicResult_t>& res) {
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                          sizeof kWorkspace));
  res.resize(size_t(want));
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.la, p.lb, p.lc, p.lc, pref, want, res.data(), &found) !=
      CUBLAS_STATUS_SUCCESS)
    found = 0;
  cublasLtMatmulPreferenceDestroy(pref);
  return found;
}
