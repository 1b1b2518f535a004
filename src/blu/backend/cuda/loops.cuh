// backend/cuda/loops: the elementwise machinery every CUDA pointwise kernel builds on — device
// element types and their conversions, dim coalescing, index→offset maps, and `launch_map`, which
// runs out[i] = f(in...[i]) with the inputs broadcast to the output's shape.
// Three paths: all operands contiguous, same shape and 16-byte aligned → vectorised 16-byte loads
// and stores in a grid-stride loop; strided, but with the innermost dim contiguous in every
// operand and rows of whole 16-byte vectors (a slice of rows, cat along the last dim, a permute
// of outer dims) → the strided index map over 16-byte vectors; anything else (broadcast, strided, misaligned) → a strided
// kernel over coalesced dims (at most kMaxDims after coalescing) whose index→offset map divides
// by precomputed 32-bit magic numbers (64-bit division only past 2^31 elements).
// Depends on backend/cuda/runtime and core/. Keep: 16-bit floats compute in float and round once,
// to nearest even, with NaN encoded as the CPU structs encode it (core/dtype.h), so results
// match the CPU reference bit for bit wherever the math itself does; FMA contraction is kept out
// of multi-step formulas with the *_rn helpers below (the CPU build does not contract either).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda/std/tuple>

#include <algorithm>
#include <array>
#include <optional>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/int_div.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/tensor.h"

namespace blu::cuda {

// --- element types: the device type a dtype's scalar is stored as, and the type math runs in ---
template <typename T> struct dev_type { using type = T; };
template <> struct dev_type<blu::bf16> { using type = __nv_bfloat16; };
template <> struct dev_type<blu::f16> { using type = __half; };
template <typename T> using dev_t = typename dev_type<T>::type;

template <typename T> struct acc_type { using type = T; };
template <> struct acc_type<__nv_bfloat16> { using type = float; };
template <> struct acc_type<__half> { using type = float; };
template <typename T> using acc_t = typename acc_type<T>::type;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(x);
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return x;
}
// One rounding, ties to even. NaN as the CPU writes it: bf16 0x7fc0, f16 sign|0x7e00.
template <typename T, typename A>
__device__ __forceinline__ T from_acc(A a) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const float f = float(a);
    return isnan(f) ? __ushort_as_bfloat16(0x7fc0) : __float2bfloat16_rn(f);
  } else if constexpr (std::is_same_v<T, __half>) {
    const float f = float(a);
    return isnan(f) ? __ushort_as_half(uint16_t((__float_as_uint(f) >> 16) & 0x8000u) | 0x7e00u) : __float2half_rn(f);
  } else {
    return T(a);
  }
}

// Uncontracted arithmetic (no FMA fusion), so multi-step formulas round as the CPU's do.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

// --- index→offset maps ---
inline constexpr int kMaxDims = 8;

// N operands over one iteration space of coalesced dims, innermost first. offsets(i) gives each
// operand's element offset for linear (row-major) index i.
template <int N>
struct Indexer {
  int ndim = 0;
  bool wide = false;  // the index space reaches 2^31: 64-bit division
  int64_t size[kMaxDims] = {};
  Div32 div[kMaxDims];
  int64_t stride[kMaxDims][N] = {};

  __device__ __forceinline__ void offsets(int64_t i, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    if (!wide) {
      uint32_t r = uint32_t(i);
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        uint32_t c = r;
        if (d + 1 < ndim) {
          const uint32_t q = div[d].div(r);
          c = r - q * uint32_t(size[d]);
          r = q;
        }
#pragma unroll
        for (int k = 0; k < N; ++k) off[k] += int64_t(c) * stride[d][k];
      }
    } else {
      int64_t r = i;
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        int64_t c = r;
        if (d + 1 < ndim) {
          c = r % size[d];
          r /= size[d];
        }
#pragma unroll
        for (int k = 0; k < N; ++k) off[k] += c * stride[d][k];
      }
    }
  }
};

// Strides of `t` seen from `shape` (t broadcast to it: leading and size-1 dims get stride 0).
Shape broadcast_strides(const Tensor& t, const Shape& shape);

// Drops size-1 dims and merges neighbours that every operand walks as one; innermost first.
// strides[k] is operand k's strides aligned to `shape` (row-major, outermost first).
struct Coalesced {
  Shape size;                        // innermost first
  std::vector<std::vector<int64_t>> stride;  // [dim][operand]
};
Coalesced coalesce(const Shape& shape, const std::vector<Shape>& strides);

template <int N>
Indexer<N> make_indexer(const Coalesced& c, int64_t total) {
  BLU_CHECK(int(c.size.size()) <= kMaxDims, "CUDA elementwise: ", c.size.size(),
            " dims remain after coalescing; at most ", kMaxDims, " are supported (make the tensor contiguous first)");
  Indexer<N> ix;
  ix.ndim = int(c.size.size());
  ix.wide = total > int64_t(INT32_MAX);
  for (int d = 0; d < ix.ndim; ++d) {
    ix.size[d] = c.size[d];
    if (!ix.wide) ix.div[d] = Div32(uint32_t(c.size[d]));
    for (int k = 0; k < N; ++k) ix.stride[d][k] = c.stride[d][k];
  }
  return ix;
}

int sm_count();  // of the current device, cached
// Blocks for a grid-stride loop over `work` items with `threads` per block.
inline unsigned blocks_for(int64_t work, int threads = 256) {
  const int64_t want = (work + threads - 1) / threads;
  const int64_t cap = int64_t(sm_count()) * 16;  // enough resident warps to cover latency
  return unsigned(std::max<int64_t>(1, std::min(want, cap)));
}

// --- the map kernels ---
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <int NIN>
struct InPtrs {
  const void* p[NIN > 0 ? NIN : 1];
};

template <typename T> constexpr size_t max_size_of() { return sizeof(T); }
template <typename T, typename U, typename... R> constexpr size_t max_size_of() {
  return std::max(sizeof(T), max_size_of<U, R...>());
}

// All operands contiguous, same numel, aligned to V elements. Thread handles vector v, then the
// tail [nvec*V, n) scalar by scalar.
template <int V, typename F, typename Out, typename... Ins>
__global__ void map_vec_kernel(int64_t n, F f, Out* __restrict__ out, InPtrs<sizeof...(Ins)> in) {
  const int64_t nvec = n / V;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += step) {
    [&]<size_t... I>(std::index_sequence<I...>) {
      const auto vs = ::cuda::std::make_tuple(reinterpret_cast<const Vec<Ins, V>*>(in.p[I])[v]...);
      Vec<Out, V> r;
#pragma unroll
      for (int j = 0; j < V; ++j) r.v[j] = from_acc<Out>(f(to_acc(::cuda::std::get<I>(vs).v[j])...));
      reinterpret_cast<Vec<Out, V>*>(out)[v] = r;
    }(std::index_sequence_for<Ins...>{});
  }
  const int64_t i = nvec * V + tid;
  if (i < n) {
    [&]<size_t... I>(std::index_sequence<I...>) {
      out[i] = from_acc<Out>(f(to_acc(static_cast<const Ins*>(in.p[I])[i])...));
    }(std::index_sequence_for<Ins...>{});
  }
}

template <typename F, typename Out, typename... Ins>
__global__ void map_strided_kernel(int64_t n, F f, Out* out, InPtrs<sizeof...(Ins)> in,
                                   Indexer<sizeof...(Ins) + 1> ix) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    int64_t off[sizeof...(Ins) + 1];
    ix.offsets(i, off);
    [&]<size_t... I>(std::index_sequence<I...>) {
      out[off[0]] = from_acc<Out>(f(to_acc(static_cast<const Ins*>(in.p[I])[off[I + 1]])...));
    }(std::index_sequence_for<Ins...>{});
  }
}

// Strided operands whose innermost dim is contiguous in every one of them (rows of a slice, a
// permute that keeps the last dim): the same index map over vectors of V elements (the caller
// divided the innermost size and the outer strides by V), each a 16-byte load or store.
template <int V, typename F, typename Out, typename... Ins>
__global__ void map_rowvec_kernel(int64_t nvec, F f, Out* out, InPtrs<sizeof...(Ins)> in,
                                  Indexer<sizeof...(Ins) + 1> ix) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec; i += step) {
    int64_t off[sizeof...(Ins) + 1];
    ix.offsets(i, off);
    [&]<size_t... I>(std::index_sequence<I...>) {
      const auto vs = ::cuda::std::make_tuple(reinterpret_cast<const Vec<Ins, V>*>(in.p[I])[off[I + 1]]...);
      Vec<Out, V> r;
#pragma unroll
      for (int j = 0; j < V; ++j) r.v[j] = from_acc<Out>(f(to_acc(::cuda::std::get<I>(vs).v[j])...));
      reinterpret_cast<Vec<Out, V>*>(out)[off[0]] = r;
    }(std::index_sequence_for<Ins...>{});
  }
}

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The coalesced space in units of V-element vectors when every operand's innermost dim is
// contiguous (stride 1), its size and every outer stride are multiples of V; else nothing.
std::optional<Coalesced> rows_as_vectors(const Coalesced& co, int v);

// out[i] = from_acc<Out>(f(to_acc(in_k[i])...)) over out's shape, inputs broadcast to it. Out and
// Ins are device element types (dev_t<...>). `out` may be strided (in-place ops); inputs may
// alias it element for element. Launched on `stream`.
template <typename Out, typename... Ins, typename F, typename... Ts>
void launch_map(cudaStream_t stream, const Tensor& out, F f, const Ts&... in) {
  static_assert(sizeof...(Ins) == sizeof...(Ts));
  constexpr int NIN = int(sizeof...(Ins));
  const int64_t n = out.numel();
  if (n == 0) return;
  const Shape& shape = out.shape();
  std::vector<Shape> strides{out.strides(), broadcast_strides(in, shape)...};
  const Coalesced co = coalesce(shape, strides);
  Out* optr = static_cast<Out*>(out.raw_data());
  InPtrs<NIN> ptrs{{in.raw_data()...}};

  constexpr int V = int(16 / max_size_of<Out, Ins...>());
  bool contiguous = co.size.size() <= 1;
  for (size_t d = 0; d < co.size.size(); ++d)
    for (int64_t s : co.stride[d]) contiguous = contiguous && s == 1;
  if (contiguous && V > 1) {
    bool aligned = aligned_to(optr, sizeof(Out) * V);
    const size_t in_align[] = {sizeof(Ins) * V...};
    for (int k = 0; k < NIN; ++k) aligned = aligned && aligned_to(ptrs.p[k], in_align[k]);
    if (aligned) {
      const int64_t work = std::max<int64_t>(n / V, 1);
      map_vec_kernel<V, F, Out, Ins...><<<blocks_for(work), 256, 0, stream>>>(n, f, optr, ptrs);
      BLU_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  if (V > 1 && co.size.size() > 1) {
    if (const std::optional<Coalesced> cv = rows_as_vectors(co, V)) {
      bool aligned = aligned_to(optr, sizeof(Out) * V);
      const size_t in_align[] = {sizeof(Ins) * V...};
      for (int k = 0; k < NIN; ++k) aligned = aligned && aligned_to(ptrs.p[k], in_align[k]);
      if (aligned) {
        const int64_t nvec = n / V;
        const auto ix = make_indexer<NIN + 1>(*cv, nvec);
        map_rowvec_kernel<V, F, Out, Ins...><<<blocks_for(nvec), 256, 0, stream>>>(nvec, f, optr, ptrs, ix);
        BLU_CUDA_CHECK_LAUNCH();
        return;
      }
    }
  }
  const auto ix = make_indexer<NIN + 1>(co, n);
  map_strided_kernel<F, Out, Ins...><<<blocks_for(n), 256, 0, stream>>>(n, f, optr, ptrs, ix);
  BLU_CUDA_CHECK_LAUNCH();
}

// The unsigned type of a dtype's size: kernels that only move bits (where, cat) dispatch on it.
template <size_t Bytes> struct bits_type;
template <> struct bits_type<1> { using type = uint8_t; };
template <> struct bits_type<2> { using type = uint16_t; };
template <> struct bits_type<4> { using type = uint32_t; };
template <> struct bits_type<8> { using type = uint64_t; };

#define BLU_DISPATCH_BITS(nbytes, name, ...)                             \
  switch (nbytes) {                                                      \
    case 1: { using bits_t = uint8_t; __VA_ARGS__; break; }              \
    case 2: { using bits_t = uint16_t; __VA_ARGS__; break; }             \
    case 4: { using bits_t = uint32_t; __VA_ARGS__; break; }             \
    case 8: { using bits_t = uint64_t; __VA_ARGS__; break; }             \
    default: BLU_ASSERT(false, name, ": element size ", nbytes);         \
  }

}  // namespace blu::cuda
