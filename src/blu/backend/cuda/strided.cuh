// backend/cuda/strided: how a CUDA kernel reads a tensor of any layout. A StridedLayout is a
// by-value struct (shape and strides in elements, up to 8 dims) passed as a kernel argument;
// offset(i) maps the i-th element in row-major order of the shape to its element offset.
// Host helpers build layouts from tensors (broadcast to an iteration shape: stride 0) and
// coalesce the dims of several operands that are laid out alike, so most calls end up 1-D.
// Depends on core/tensor and the CUDA runtime. Keep: the struct stays trivially copyable and
// small enough to pass by value; shapes never exceed kMaxDims after coalescing (BLU_CHECK).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "blu/core/error.h"
#include "blu/core/tensor.h"

namespace blu::cuda {

struct StridedLayout {
  static constexpr int kMaxDims = 8;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  // Element offset of the `linear`-th element (row-major over shape).
  __host__ __device__ int64_t offset(int64_t linear) const {
    int64_t off = 0;
#pragma unroll
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d >= ndim) continue;
      const int64_t s = shape[d];
      const int64_t q = linear / s;
      off += (linear - q * s) * strides[d];
      linear = q;
    }
    return off;
  }
  // True when offset(i) == i for every i.
  __host__ __device__ bool contiguous() const {
    int64_t expect = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expect) return false;
      expect *= shape[d];
    }
    return true;
  }
};

// Strides of `t` seen from `shape`, which t broadcasts to (new leading and size-1 dims: stride 0).
inline Shape broadcast_strides_to(const Tensor& t, const Shape& shape) {
  const int64_t lead = int64_t(shape.size()) - t.dim();
  BLU_ASSERT(lead >= 0, "broadcast of ", t.shape(), " to ", shape);
  Shape st(shape.size(), 0);
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.shape()[d] != 1) st[lead + d] = t.strides()[d];
  return st;
}

// Layouts of N operands over one iteration shape, with dims merged where every operand allows
// it (size-1 dims dropped; d-1 and d merged when stride[d-1] == stride[d] * shape[d] for all).
template <size_t N>
std::array<StridedLayout, N> coalesced_layouts(const Shape& shape, const std::array<Shape, N>& strides) {
  Shape sh;
  std::array<Shape, N> st;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !sh.empty();
    for (size_t k = 0; k < N && merge; ++k) merge = st[k].back() == strides[k][d] * shape[d];
    if (merge) {
      sh.back() *= shape[d];
      for (size_t k = 0; k < N; ++k) st[k].back() = strides[k][d];
    } else {
      sh.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k) st[k].push_back(strides[k][d]);
    }
  }
  BLU_CHECK(int(sh.size()) <= StridedLayout::kMaxDims, "CUDA kernels take at most ", StridedLayout::kMaxDims,
            " non-mergeable dims; got shape ", shape);
  std::array<StridedLayout, N> out;
  for (size_t k = 0; k < N; ++k) {
    out[k].ndim = int(sh.size());
    for (size_t d = 0; d < sh.size(); ++d) {
      out[k].shape[d] = sh[d];
      out[k].strides[d] = st[k][d];
    }
  }
  return out;
}

// dst = src (src broadcast to dst's shape, same device) through loops.cuh's launch_map — its
// 16-byte contiguous and row paths — when the dtypes allow it: the same dtype (bits moved), or
// both among f32/bf16/f16 (where its conversion is the copy kernels' bit for bit). Returns false
// (nothing launched) for the other pairs. Defined in elementwise.cu.
bool copy_through_map(cudaStream_t stream, const Tensor& dst, const Tensor& src);

}  // namespace blu::cuda
