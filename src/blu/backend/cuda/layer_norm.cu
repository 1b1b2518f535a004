// CUDA kernels for ops/nn, part 2: layer_norm and layer_norm_backward, with the CPU kernel's
// semantics (backend/cpu/nn.cpp): inputs (x [R, C] contiguous, weight or undefined, bias or
// undefined), attr eps; outputs y, mean [R], rstd [R] (f32; f64 for f64 inputs).
// Forward and grad_x: one warp per row (8 rows per 256-thread block), row sums in fp32 (f64 for
// f64; the CPU uses double), mean and variance in two passes (the second pass reads L1).
// grad_weight and grad_bias are deterministic: a first kernel has each block sum a 32-column
// tile over a chunk of rows into per-chunk partials (in a fixed order), a second sums the
// partials of each column over the chunks in order, in double. No atomics anywhere.
#include "blu/backend/backend.h"
#include "blu/backend/cuda/nn_common.cuh"

namespace blu::cuda {

namespace {

constexpr int kRowsPerBlock = 8;  // warps per block, one row each
constexpr int kChunkRows = 256;   // rows per partial sum of the weight gradients

__device__ __forceinline__ float sqrt_acc(float v) { return sqrtf(v); }
__device__ __forceinline__ double sqrt_acc(double v) { return sqrt(v); }

template <typename T>
__global__ void layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, int64_t ws,
                                          const T* __restrict__ b, int64_t bs, int64_t R, int64_t C, double eps,
                                          T* __restrict__ y, acc_of<T>* __restrict__ mean_out,
                                          acc_of<T>* __restrict__ rstd_out) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;  // whole warps leave together: no block barrier below
  const T* xr = x + row * C;
  A s = 0;
  for (int64_t k = lane; k < C; k += 32) s += to_acc(xr[k]);
  const A mean = warp_sum(s) / A(C);
  A v = 0;
  for (int64_t k = lane; k < C; k += 32) {
    const A d = to_acc(xr[k]) - mean;
    v += d * d;
  }
  const A rstd = A(1) / sqrt_acc(warp_sum(v) / A(C) + A(eps));
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  T* yr = y + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    A o = (to_acc(xr[k]) - mean) * rstd;
    if (w) o = o * to_acc(w[k * ws]);
    if (b) o = o + to_acc(b[k * bs]);
    yr[k] = from_acc<T>(o);
  }
}

// gx = rstd * (gh - mean(gh) - xh * mean(gh * xh)), gh = g * w, xh = (x - mean) * rstd.
template <typename T>
__global__ void layer_norm_grad_x_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ w,
                                         int64_t ws, const acc_of<T>* __restrict__ mean_in,
                                         const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                         T* __restrict__ gx) {
  using A = acc_of<T>;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= R) return;
  const T* gr = g + row * C;
  const T* xr = x + row * C;
  const A mean = mean_in[row], rstd = rstd_in[row];
  A sg = 0, sgx = 0;
  for (int64_t k = lane; k < C; k += 32) {
    const A gh = to_acc(gr[k]) * (w ? to_acc(w[k * ws]) : A(1));
    sg += gh;
    sgx += gh * (to_acc(xr[k]) - mean) * rstd;
  }
  sg = warp_sum(sg) / A(C);
  sgx = warp_sum(sgx) / A(C);
  T* out = gx + row * C;
  for (int64_t k = lane; k < C; k += 32) {
    const A xh = (to_acc(xr[k]) - mean) * rstd;
    const A gh = to_acc(gr[k]) * (w ? to_acc(w[k * ws]) : A(1));
    out[k] = from_acc<T>(rstd * (gh - sg - xh * sgx));
  }
}

// Block (32, 8) over columns [32·bx, 32·bx + 32) and rows [kChunkRows·by, ...): thread (tx, ty)
// sums rows ty, ty + 8, ... of its column; the 8 sums are then added in ty order.
// partial_w[by, col] = Σ g·xh, partial_b[by, col] = Σ g over the chunk.
template <typename T>
__global__ void layer_norm_grad_wb_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                                  const acc_of<T>* __restrict__ mean_in,
                                                  const acc_of<T>* __restrict__ rstd_in, int64_t R, int64_t C,
                                                  acc_of<T>* __restrict__ partial_w, acc_of<T>* __restrict__ partial_b) {
  using A = acc_of<T>;
  __shared__ A sw[8][33], sb[8][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kChunkRows;
  const int64_t r1 = min(R, r0 + kChunkRows);
  A aw = 0, ab = 0;
  if (col < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const A gv = to_acc(g[r * C + col]);
      aw += gv * (to_acc(x[r * C + col]) - mean_in[r]) * rstd_in[r];
      ab += gv;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < C) {
    A tw = 0, tb = 0;
    for (int i = 0; i < 8; ++i) {
      tw += sw[i][threadIdx.x];
      tb += sb[i][threadIdx.x];
    }
    partial_w[int64_t(blockIdx.y) * C + col] = tw;
    partial_b[int64_t(blockIdx.y) * C + col] = tb;
  }
}

template <typename T>
__global__ void layer_norm_grad_wb_final_kernel(const acc_of<T>* __restrict__ partial_w,
                                                const acc_of<T>* __restrict__ partial_b, int64_t chunks, int64_t C,
                                                T* __restrict__ gw, T* __restrict__ gb) {
  for (int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; col < C; col += int64_t(gridDim.x) * blockDim.x) {
    double tw = 0, tb = 0;
    for (int64_t i = 0; i < chunks; ++i) {
      tw += double(partial_w[i * C + col]);
      tb += double(partial_b[i * C + col]);
    }
    gw[col] = from_acc<T>(acc_of<T>(tw));
    gb[col] = from_acc<T>(acc_of<T>(tb));
  }
}

template <typename T>
const T* opt_ptr(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.raw_data()) : nullptr;
}

void layer_norm_kernel(const KernelCall& c) {
  const Tensor& x = c.in[0];
  BLU_ASSERT(x.is_contiguous(), "layer_norm: input must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (R == 0) return;
  const double eps = c.attrs.f("eps");
  const unsigned blocks = unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock);
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm", {
    using A = acc_of<scalar_t>;
    layer_norm_forward_kernel<scalar_t><<<blocks, 32 * kRowsPerBlock, 0, current_stream()>>>(
        static_cast<const scalar_t*>(x.raw_data()), opt_ptr<scalar_t>(c.in[1]),
        c.in[1].defined() ? c.in[1].stride(0) : 0, opt_ptr<scalar_t>(c.in[2]),
        c.in[2].defined() ? c.in[2].stride(0) : 0, R, C, eps, static_cast<scalar_t*>(c.out[0].raw_data()),
        static_cast<A*>(c.out[1].raw_data()), static_cast<A*>(c.out[2].raw_data()));
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "layer_norm", layer_norm_kernel);

// Inputs (g, x, weight or undefined, mean, rstd); outputs grad_x, grad_weight, grad_bias.
void layer_norm_backward_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& x = c.in[1];
  const Tensor& w = c.in[2];
  BLU_ASSERT(g.is_contiguous() && x.is_contiguous() && c.in[3].is_contiguous() && c.in[4].is_contiguous(),
             "layer_norm_backward: inputs must be contiguous");
  const int64_t C = x.shape().back(), R = C == 0 ? 0 : x.numel() / C;
  if (C == 0) return;
  cudaStream_t s = current_stream();
  BLU_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward", {
    using A = acc_of<scalar_t>;
    const auto* gp = static_cast<const scalar_t*>(g.raw_data());
    const auto* xp = static_cast<const scalar_t*>(x.raw_data());
    const A* mp = static_cast<const A*>(c.in[3].raw_data());
    const A* rp = static_cast<const A*>(c.in[4].raw_data());
    auto* gwp = static_cast<scalar_t*>(c.out[1].raw_data());
    auto* gbp = static_cast<scalar_t*>(c.out[2].raw_data());
    if (R > 0) {
      layer_norm_grad_x_kernel<scalar_t><<<unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                                           s>>>(gp, xp, opt_ptr<scalar_t>(w), w.defined() ? w.stride(0) : 0, mp, rp,
                                                R, C, static_cast<scalar_t*>(c.out[0].raw_data()));
      BLU_CUDA_CHECK_LAUNCH();
    }
    const int64_t chunks = std::max<int64_t>((R + kChunkRows - 1) / kChunkRows, 1);
    BLU_CHECK(chunks <= 65535, "layer_norm_backward: ", R, " rows exceed the grid's ", 65535 * kChunkRows);
    DeviceBuffer partial(x.device(), size_t(2 * chunks * C) * sizeof(A));
    A* pw = partial.as<A>();
    A* pb = pw + chunks * C;
    layer_norm_grad_wb_partial_kernel<scalar_t>
        <<<dim3(unsigned((C + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, s>>>(gp, xp, mp, rp, R, C, pw, pb);
    BLU_CUDA_CHECK_LAUNCH();
    layer_norm_grad_wb_final_kernel<scalar_t><<<grid_for(C), 256, 0, s>>>(pw, pb, chunks, C, gwp, gbp);
    BLU_CUDA_CHECK_LAUNCH();
  });
}
BLU_REGISTER_KERNEL(cuda, "layer_norm_backward", layer_norm_backward_kernel);

}  // namespace

}  // namespace blu::cuda
