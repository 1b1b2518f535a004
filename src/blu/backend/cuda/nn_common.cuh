// backend/cuda/nn_common: what the linalg/nn/optim kernels share — the device scalar type of each
// floating DType (float, double, __nv_bfloat16, __half) with its accumulation type, conversions,
// warp and block sum reductions and column sums of partial rows in a fixed order
// (deterministic), a rank-8 strided index, the
// block → tensor map of multi-tensor launches, and temporary device buffers from the CUDA allocator.
// Depends on backend/cuda/runtime, memory/allocator. Keep: 16-bit types compute in float;
// reductions combine in an order fixed by the launch shape, so reruns are bit-identical.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "blu/backend/cuda/colsum.cuh"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/tensor.h"
#include "blu/memory/allocator.h"

namespace blu::cuda {

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_of = typename AccOf<T>::type;

template <typename T>
__device__ __forceinline__ acc_of<T> to_acc(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else return v;
}
template <typename T, typename A>
__device__ __forceinline__ T from_acc(A v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(float(v));
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(float(v));
  else return T(v);
}

// A gradient already rounded to T plus the gradient waiting for the same input, rounded once: what
// the autograd engine's add of the two would give (Note [Folded gradient sums], ops/dispatch.h).
// The _rn intrinsics are never contracted into a multiply before them.
template <typename T>
__device__ __forceinline__ T add_pending(T gx, T pending) {
  if constexpr (std::is_same_v<T, double>) return __dadd_rn(gx, pending);
  else return from_acc<T>(__fadd_rn(to_acc(gx), to_acc(pending)));
}

// The tensor that owns block b of a multi-tensor launch: the last i with first_block[i] <= b
// (binary search; first_block ascending, first_block[0] = 0).
__device__ __forceinline__ int owning_tensor(const int32_t* first_block, int count, int b) {
  int t = 0;
  for (int lo = 0, hi = count - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (first_block[mid] <= b) {
      t = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return t;
}

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A>
__device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `shared` holds 32 values. Calls __syncthreads: every thread of the block must reach it.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : A(0);
  return warp_sum(v);
}
template <typename A>
__device__ __forceinline__ A block_max(A v, A* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : A(-INFINITY);
  return warp_max(v);
}

// A tensor's layout by value, for kernels that walk any strides: the offset of row-major
// element i.
struct StridedIndex {
  static constexpr int kMaxRank = 8;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
  __device__ __forceinline__ int64_t offset(int64_t i) const {
    int64_t off = 0;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t q = i / shape[d];
      off += (i - q * shape[d]) * strides[d];
      i = q;
    }
    return off;
  }
};
StridedIndex strided_index(const Tensor& t);  // BLU_CHECK rank <= 8 (nn.cu)

// A kernel call's temporary device buffer: a slice of the call's workspace (Note [Execution
// context]), valid while the kernels queued by this call on the call's stream use it.
struct Scratch {
  void* ptr;
  Scratch(const ExecContext& ctx, size_t nbytes) : ptr(ctx.scratch->take(nbytes)) {}
  template <typename T>
  T* as() const { return static_cast<T*>(ptr); }
};

}  // namespace blu::cuda

// BLU_CUDA_DISPATCH_FLOATING(dtype, name, body): `body` with scalar_t bound to the device type.
#define BLU_CUDA_DTYPE_CASE(DT, T, ...) \
  case ::blu::DType::DT: {              \
    using scalar_t = T;                 \
    __VA_ARGS__;                        \
    break;                              \
  }
#define BLU_CUDA_DISPATCH_FLOATING(dtype, name, ...)                                                \
  switch (dtype) {                                                                                  \
    BLU_CUDA_DTYPE_CASE(f32, float, __VA_ARGS__)                                                    \
    BLU_CUDA_DTYPE_CASE(f64, double, __VA_ARGS__)                                                   \
    BLU_CUDA_DTYPE_CASE(bf16, __nv_bfloat16, __VA_ARGS__)                                           \
    BLU_CUDA_DTYPE_CASE(f16, __half, __VA_ARGS__)                                                   \
    default: BLU_CHECK(false, name, ": expected a floating dtype (f32, f64, bf16, f16), got ", dtype); \
  }
#define BLU_CUDA_DISPATCH_INDEX(dtype, name, ...)                                           \
  switch (dtype) {                                                                          \
    BLU_CUDA_DTYPE_CASE(i32, int32_t, __VA_ARGS__)                                          \
    BLU_CUDA_DTYPE_CASE(i64, int64_t, __VA_ARGS__)                                          \
    default: BLU_CHECK(false, name, ": expected an index dtype (i32 or i64), got ", dtype); \
  }
