// CUDA kernels for ops/nn, part 3: embedding (gather), its deterministic backward, and dropout.
// Semantics as backend/cpu/nn.cpp.
// embedding_backward (and embedding_backward_add_, which adds scale · the rows into an existing
// gradient instead of writing a zeroed one) is sort-based, like the CPU kernel: positions are stably radix-sorted by
// index (cub), then one block per distinct index sums its gradient rows in position order in the
// accumulation type and writes the row once. So the result is the same on every run and, for
// f32 and the 16-bit types, bit-identical to the CPU's. Rows no index names are zero.
// dropout uses the Philox mapping of core/rng.h (element i: counter offset + i/4, lane i % 4, the
// top 24 bits as a uniform in [0, 1)), so masks match the CPU's bit for bit.
// Indices outside [0, V) cannot be reported without a host synchronisation: the forward writes
// NaN rows for them and the backward skips them (the CPU raises an error).
#include <cub/device/device_radix_sort.cuh>

#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

namespace {

// --- embedding -------------------------------------------------------------------------------

template <typename T, typename I>
__global__ void embedding_forward_kernel(const T* __restrict__ w, int64_t s0, int64_t s1, const I* __restrict__ idx,
                                         int64_t M, int64_t V, int64_t C, T* __restrict__ out) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < M * C; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / C, k = e - i * C;
    const int64_t v = int64_t(idx[i]);
    out[e] = v >= 0 && v < V ? w[v * s0 + k * s1] : from_acc<T>(acc_of<T>(NAN));
  }
}

template <typename T, int V>
struct alignas(16) Vec16 {
  T v[V];
};

// The same with V elements a thread (one 16-byte vector): rows of unit column stride whose length
// and row stride are multiples of V, 16-byte aligned. Thread e takes vector e: row i = e / (C/V).
template <typename T, typename I, int V>
__global__ void embedding_forward_vec_kernel(const T* __restrict__ w, int64_t s0, const I* __restrict__ idx, int64_t M,
                                             int64_t V_rows, int64_t C, T* __restrict__ out) {
  const int64_t per_row = C / V;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < M * per_row; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / per_row, k = (e - i * per_row) * V;
    const int64_t v = int64_t(idx[i]);
    Vec16<T, V> r;
    if (v >= 0 && v < V_rows) {
      r = *reinterpret_cast<const Vec16<T, V>*>(w + v * s0 + k);
    } else {
#pragma unroll
      for (int q = 0; q < V; ++q) r.v[q] = from_acc<T>(acc_of<T>(NAN));
    }
    *reinterpret_cast<Vec16<T, V>*>(out + i * C + k) = r;
  }
}

// keys[j] = idx[j] - first_row (V for an index outside the window [first_row, first_row + V):
// sorted last, skipped), vals[j] = j.
template <typename I>
__global__ void embedding_keys_kernel(const I* __restrict__ idx, int64_t M, int64_t first_row, int64_t V,
                                      uint32_t* __restrict__ keys, int32_t* __restrict__ vals) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < M; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = int64_t(idx[j]) - first_row;
    keys[j] = uint32_t(v >= 0 && v < V ? v : V);
    vals[j] = int32_t(j);
  }
}

// Block j handles the run of equal keys starting at sorted position j (if one starts there).
template <typename T>
__global__ void embedding_backward_segments_kernel(const T* __restrict__ g, const uint32_t* __restrict__ keys,
                                                   const int32_t* __restrict__ pos, int64_t M, int64_t V, int64_t C,
                                                   bool accumulate, acc_of<T> scale, T* __restrict__ out) {
  using A = acc_of<T>;
  const int64_t j = blockIdx.x;
  const uint32_t key = keys[j];
  if (int64_t(key) >= V || (j > 0 && keys[j - 1] == key)) return;
  int64_t end = j + 1;
  while (end < M && keys[end] == key) ++end;
  T* dst = out + int64_t(key) * C;
  for (int64_t k = threadIdx.x; k < C; k += blockDim.x) {
    A acc = 0;
    for (int64_t p = j; p < end; ++p) acc += to_acc(g[int64_t(pos[p]) * C + k]);
    dst[k] = accumulate ? from_acc<T>(to_acc(dst[k]) + scale * acc) : from_acc<T>(acc);
  }
}

void embedding_kernel(const KernelCall& c) {
  const Tensor& w = c.in[0];
  const Tensor& idx = c.in[1];
  BLU_ASSERT(idx.is_contiguous(), "embedding: indices must be contiguous");
  const int64_t V = w.shape()[0], C = w.shape()[1], M = idx.numel();
  if (M * C == 0) return;
  BLU_CUDA_DISPATCH_INDEX(idx.dtype(), "embedding", {
    using I = scalar_t;
    const I* ip = static_cast<const I*>(idx.raw_data());
    BLU_CUDA_DISPATCH_FLOATING(w.dtype(), "embedding", {
      constexpr int kV = 16 / int(sizeof(scalar_t));
      const scalar_t* wp = static_cast<const scalar_t*>(w.raw_data());
      scalar_t* op = static_cast<scalar_t*>(c.out[0].raw_data());
      const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      if (kV > 1 && w.stride(1) == 1 && C % kV == 0 && w.stride(0) % kV == 0 && aligned(wp) && aligned(op) &&
          c.out[0].is_contiguous()) {
        embedding_forward_vec_kernel<scalar_t, I, kV><<<grid_for(M * (C / kV)), 256, 0, stream_of(c.ctx)>>>(
            wp, w.stride(0), ip, M, V, C, op);
      } else {
        embedding_forward_kernel<scalar_t, I><<<grid_for(M * C), 256, 0, stream_of(c.ctx)>>>(
            wp, w.stride(0), w.stride(1), ip, M, V, C, op);
      }
      BLU_CUDA_CHECK_LAUNCH();
    });
  });
}
BLU_REGISTER_KERNEL(cuda, "embedding", embedding_kernel);

int bits_for(int64_t v) {  // bits needed to hold 0..v
  int b = 1;
  while (b < 32 && (int64_t(1) << b) <= v) ++b;
  return b;
}

// out [V, C] = the sum of g's rows per index (g [M, C] contiguous, indices [M]); with `accumulate`
// out[v] += scale · that sum instead, rows no index names untouched. out holds the rows
// [first_row, first_row + V) of the table (indices outside are skipped).
void embedding_backward_rows(const ExecContext& ctx, const Tensor& g, const Tensor& idx, const Tensor& out,
                             bool accumulate, double scale, int64_t first_row = 0) {
  BLU_ASSERT(g.is_contiguous() && idx.is_contiguous(), "embedding_backward: inputs must be contiguous");
  const int64_t V = out.shape()[0], C = out.shape()[1], M = idx.numel();
  BLU_CHECK(M < (int64_t(1) << 31) && V < (int64_t(1) << 32) - 1, "embedding_backward: ", M, " indices into ", V,
            " rows exceed the CUDA kernel's 32-bit sort keys");
  cudaStream_t s = stream_of(ctx);
  if (!accumulate && out.numel() > 0) BLU_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), s));
  if (M == 0 || C == 0) return;
  Scratch keys(ctx, size_t(M) * 4 * 2), vals(ctx, size_t(M) * 4 * 2);  // in and out halves
  uint32_t* keys_in = keys.as<uint32_t>();
  uint32_t* keys_out = keys_in + M;
  int32_t* vals_in = vals.as<int32_t>();
  int32_t* vals_out = vals_in + M;
  BLU_CUDA_DISPATCH_INDEX(idx.dtype(), "embedding_backward", {
    embedding_keys_kernel<scalar_t><<<grid_for(M), 256, 0, s>>>(static_cast<const scalar_t*>(idx.raw_data()), M,
                                                                 first_row, V, keys_in, vals_in);
    BLU_CUDA_CHECK_LAUNCH();
  });
  const int end_bit = bits_for(V);
  size_t temp_bytes = 0;
  BLU_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, vals_in, vals_out, int(M), 0,
                                                 end_bit, s));
  Scratch temp(ctx, std::max<size_t>(temp_bytes, 1));
  BLU_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.ptr, temp_bytes, keys_in, keys_out, vals_in, vals_out,
                                                 int(M), 0, end_bit, s));
  BLU_CUDA_DISPATCH_FLOATING(out.dtype(), "embedding_backward", {
    embedding_backward_segments_kernel<scalar_t><<<unsigned(M), 128, 0, s>>>(
        static_cast<const scalar_t*>(g.raw_data()), keys_out, vals_out, M, V, C, accumulate,
        acc_of<scalar_t>(scale), static_cast<scalar_t*>(out.raw_data()));
    BLU_CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward_kernel(const KernelCall& c) { embedding_backward_rows(c.ctx, c.in[0], c.in[1], c.out[0], false, 1.0); }
BLU_REGISTER_KERNEL(cuda, "embedding_backward", embedding_backward_kernel);

// Inputs (grad_weight, written; g [M, C]; indices [M]); attrs scale, first_row (-1: the whole table).
void embedding_backward_add_kernel(const KernelCall& c) {
  embedding_backward_rows(c.ctx, c.in[1], c.in[2], c.in[0], true, c.attrs.f("scale"), std::max<int64_t>(c.attrs.i("first_row"), 0));
}
BLU_REGISTER_KERNEL(cuda, "embedding_backward_add_", embedding_backward_add_kernel);

// --- dropout ---------------------------------------------------------------------------------

// Philox-4x32-10 with key = seed and counter = (counter, 0): the same function as
// Philox::block(seed, counter) in core/rng.h.
__device__ __forceinline__ uint4 philox_block(uint64_t seed, uint64_t counter) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1), n2 = uint32_t(p0 >> 32) ^ c3 ^ k1,
                   n3 = uint32_t(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}
__device__ __forceinline__ float philox_uniform24(uint32_t u) { return float(u >> 8) * (1.0f / 16777216.0f); }

// Thread q: elements 4q .. 4q+3 (row-major), from Philox block offset + q.
template <typename T>
__global__ void dropout_kernel(const T* __restrict__ in, StridedIndex in_idx, bool in_contiguous, int64_t n, float p,
                               acc_of<T> scale, uint64_t seed, uint64_t offset, T* __restrict__ out) {
  const int64_t nq = (n + 3) / 4;
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < nq; q += int64_t(gridDim.x) * blockDim.x) {
    const uint4 r = philox_block(seed, offset + uint64_t(q));
    const uint32_t lanes[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int64_t i = 4 * q + l;
      if (i >= n) break;
      const bool keep = philox_uniform24(lanes[l]) >= p;
      const T v = in[in_contiguous ? i : in_idx.offset(i)];
      out[i] = keep ? from_acc<T>(to_acc(v) * scale) : from_acc<T>(acc_of<T>(0));
    }
  }
}

void dropout_entry(const KernelCall& c) {
  const Tensor& in = c.in[0];
  Tensor& out = c.out[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  const double p = c.attrs.f("p");
  const uint64_t seed = uint64_t(c.attrs.i("seed")), offset = uint64_t(c.attrs.i("offset"));
  const StridedIndex idx = strided_index(in);
  BLU_CUDA_DISPATCH_FLOATING(out.dtype(), "dropout", {
    using A = acc_of<scalar_t>;
    const A scale = p < 1 ? A(1.0 / (1.0 - p)) : A(0);
    dropout_kernel<scalar_t><<<grid_for((n + 3) / 4), 256, 0, stream_of(c.ctx)>>>(
        static_cast<const scalar_t*>(in.raw_data()), idx, in.is_contiguous(), n, float(p), scale, seed, offset,
        static_cast<scalar_t*>(out.raw_data()));
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "dropout", dropout_entry);

}  // namespace

}  // namespace blu::cuda
