// backend/cuda/peer_add: see peer_add.h.
#include "blu/backend/cuda/peer_add.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "blu/backend/cuda/runtime.h"

namespace blu::cuda {

namespace {

template <typename T>
__device__ __forceinline__ float widen(T v) {
  return float(v);
}
template <>
__device__ __forceinline__ float widen(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float widen(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ __forceinline__ T narrow_to(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return T(v);
}

// Sixteen bytes a thread where both pointers allow it, then the tail element by element.
template <typename T, typename A>
__global__ void peer_add_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n, A scale) {
  constexpr int V = 16 / sizeof(T);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool vec = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 == 0;
  int64_t done = 0;
  if (vec) {
    struct alignas(16) Pack {
      T v[V];
    };
    const int64_t nv = n / V;
    Pack* d = reinterpret_cast<Pack*>(dst);
    const Pack* s = reinterpret_cast<const Pack*>(src);
    for (int64_t i = tid; i < nv; i += stride) {
      Pack a = d[i];
      const Pack b = s[i];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if constexpr (std::is_same_v<T, double>) a.v[k] = (a.v[k] + b.v[k]) * scale;
        else a.v[k] = narrow_to<T>((widen(a.v[k]) + widen(b.v[k])) * float(scale));
      }
      d[i] = a;
    }
    done = nv * V;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    if constexpr (std::is_same_v<T, double>) dst[i] = (dst[i] + src[i]) * scale;
    else dst[i] = narrow_to<T>((widen(dst[i]) + widen(src[i])) * float(scale));
  }
}

template <typename T, typename A>
void launch(void* dst, const void* src, int64_t n, double scale, cudaStream_t s) {
  peer_add_kernel<T, A><<<grid_for((n + 7) / 8, 256), 256, 0, s>>>(static_cast<T*>(dst), static_cast<const T*>(src),
                                                                     n, A(scale));
  BLU_CUDA_CHECK_LAUNCH();
}

}  // namespace

void peer_add(void* dst, const void* src, int64_t n, DType dt, double scale, cudaStream_t s) {
  if (n == 0) return;
  switch (dt) {
    case DType::f32: return launch<float, float>(dst, src, n, scale, s);
    case DType::f64: return launch<double, double>(dst, src, n, scale, s);
    case DType::bf16: return launch<__nv_bfloat16, float>(dst, src, n, scale, s);
    case DType::f16: return launch<__half, float>(dst, src, n, scale, s);
    default: break;
  }
  BLU_CHECK(false, "peer_add: expected a float dtype (f32, f64, bf16, f16), got ", dt);
}

}  // namespace blu::cuda
