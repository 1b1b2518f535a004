// CUDA kernels for the random factories of ops/factory (rand, randn, randint). Element i of a
// draw uses Philox block (offset + i/4), lane i%4 (core/rng.h); each thread makes one block's
// four values, so a seeded tensor is the same on the CPU and the GPU, bit for bit.
#include "blu/backend/cuda/loops.cuh"
#include "blu/backend/cuda/philox.cuh"

namespace blu::cuda {

namespace {

template <typename T, typename Gen>
__global__ void philox_kernel(int64_t n, uint64_t seed, uint64_t offset, T* out, bool vec_ok, Gen gen) {
  const int64_t nblocks = (n + 3) / 4;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < nblocks; b += step) {
    const PhiloxOut r = philox_block(seed, offset + uint64_t(b));
    Vec<T, 4> v;
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) v.v[lane] = gen(r, lane);
    if (vec_ok && 4 * b + 3 < n) {
      reinterpret_cast<Vec<T, 4>*>(out)[b] = v;
    } else {
      for (int lane = 0; lane < 4 && 4 * b + lane < n; ++lane) out[4 * b + lane] = v.v[lane];
    }
  }
}

template <typename T, typename Gen>
void philox_fill(cudaStream_t stream, const Tensor& t, const Attrs& a, Gen gen) {
  const int64_t n = t.numel();
  if (n == 0) return;
  BLU_ASSERT(t.is_contiguous(), "random fill into a strided tensor ", t.str());
  T* p = static_cast<T*>(t.raw_data());
  const bool vec_ok = aligned_to(p, sizeof(Vec<T, 4>));
  philox_kernel<T, Gen><<<blocks_for((n + 3) / 4), 256, 0, stream>>>(
      n, uint64_t(a.i("seed")), uint64_t(a.i("offset")), p, vec_ok, gen);
  BLU_CUDA_CHECK_LAUNCH();
}

template <typename T>
struct uniform_gen {
  int bits;
  __device__ T operator()(const PhiloxOut& r, int lane) const { return from_acc<T>(philox_uniform(r.v[lane], bits)); }
};
template <typename T>
struct normal_gen {
  __device__ T operator()(const PhiloxOut& r, int lane) const { return from_acc<T>(philox_normal(r, lane)); }
};
template <typename T>
struct int_gen {
  int64_t low;
  uint64_t range;
  __device__ T operator()(const PhiloxOut& r, int lane) const {
    return from_acc<T>(low + int64_t(uint64_t(r.v[lane]) % range));
  }
};

void rand_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), "rand", {
    using T = dev_t<scalar_t>;
    // As many bits as the type holds (core/rng.h).
    constexpr int bits = std::is_same_v<scalar_t, bf16> ? 8 : std::is_same_v<scalar_t, f16> ? 11 : 24;
    philox_fill<T>(stream_of(c.ctx), c.out[0], c.attrs, uniform_gen<T>{bits});
  });
}
BLU_REGISTER_KERNEL(cuda, "rand", rand_kernel);

void randn_kernel(const KernelCall& c) {
  BLU_DISPATCH_FLOATING(c.out[0].dtype(), "randn", {
    using T = dev_t<scalar_t>;
    philox_fill<T>(stream_of(c.ctx), c.out[0], c.attrs, normal_gen<T>{});
  });
}
BLU_REGISTER_KERNEL(cuda, "randn", randn_kernel);

void randint_kernel(const KernelCall& c) {
  const int64_t low = c.attrs.i("low"), range = c.attrs.i("high") - low;
  BLU_CHECK(range > 0, "randint: empty range [", low, ", ", low + range, ")");
  BLU_DISPATCH_ALL(c.out[0].dtype(), "randint", {
    using T = dev_t<scalar_t>;
    philox_fill<T>(stream_of(c.ctx), c.out[0], c.attrs, int_gen<T>{low, uint64_t(range)});
  });
}
BLU_REGISTER_KERNEL(cuda, "randint", randint_kernel);

}  // namespace

}  // namespace blu::cuda
