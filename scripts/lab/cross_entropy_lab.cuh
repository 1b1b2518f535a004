// What the cross-entropy lab programs share (cross_entropy_reread.cu, cross_entropy_registers.cu):
// bf16 logits in 16-byte vectors, the fill of a [N, C] matrix whose first K columns are classes
// (values in [-4, 4), zero past K), a copy kernel (one read and one write: the ceiling), and a
// timer (CUDA events, 10 calls after 2, µs a call).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "lab_check.cuh"

typedef __nv_bfloat16 T;
constexpr int V = 8;
struct alignas(16) Vec {
  T v[V];
};
__device__ __forceinline__ float to_f(T x) { return __bfloat162float(x); }
__device__ __forceinline__ T to_t(float x) { return __float2bfloat16_rn(x); }

__global__ void copy_kernel(const Vec* x, Vec* y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) y[i] = x[i];
}

__global__ void fill(T* p, int64_t n, int64_t C, int64_t K, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    p[i] = i % C < K ? to_t(4.f * (float(h & 0xffff) / 32768.f - 1.f)) : to_t(0.f);
  }
}

template <typename F>
float time_us(F&& call) {
  for (int i = 0; i < 2; ++i) call();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < 10; ++i) call();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  return ms * 100.f;
}
