// Whether the loss's forward and its logit gradient, made by one kernel that reads each row twice
// (the second read from L2, right after the first), beat the two kernels the step runs now
// (backend/cuda/nn.cu: cross_entropy_rows_kernel, then cross_entropy_backward_kernel over the
// logits in place): 4.9 GB of DRAM traffic a GPT-2 step, where one read and one write are 3.3.
// The fused kernel keeps the rows kernel's order of sums (per thread over its vectors, then the
// block merge) and the backward's formula, so lse, the losses and the gradient are the same bits;
// how many rows sit between their two reads is set by how many blocks a multiprocessor holds
// (dynamic shared memory that the kernel does not use caps it). Shapes: GPT-2 124M's head (16,384
// rows of 50,304 columns, 50,257 classes) and llama-250m's (8,192 × 32,000), bf16; a read+write
// copy of the logits is the ceiling.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/cross_entropy_reread scripts/lab/cross_entropy_reread.cu && /tmp/cross_entropy_reread
//
// Times in µs a call (CUDA events, 10 calls after 2; the logits are far larger than L2).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cross_entropy_lab.cuh"


// kFast: exp(v) as 2^(v·log2 e) through ex2.approx (what Triton's tl.exp, and so torch.compile's
// generated kernels, use), else expf.
template <bool kFast>
__device__ __forceinline__ float ex(float v) {
  if constexpr (kFast) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v * 1.4426950408889634f));
    return y;
  } else {
    return expf(v);
  }
}

struct MaxSum {
  float m, s;
};
template <bool kFast>
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};
  return {m, a.s * ex<kFast>(a.m - m) + b.s * ex<kFast>(b.m - m)};
}
template <bool kFast>
__device__ __forceinline__ MaxSum block_merge(MaxSum v, float* sm, float* ss) {
  for (int o = 16; o > 0; o >>= 1) v = merge<kFast>(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) sm[warp] = v.m, ss[warp] = v.s;
  __syncthreads();
  v = lane < nwarps ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.f};
  for (int o = 16; o > 0; o >>= 1) v = merge<kFast>(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

// The row's (max, sum of exp) over its K classes, as cross_entropy_rows_kernel (aligned rows).
template <bool kFast>
__device__ __forceinline__ MaxSum row_max_sum(const T* xr, int64_t K, float* sm, float* ss) {
  MaxSum acc{-INFINITY, 0.f};
  const Vec* xv = reinterpret_cast<const Vec*>(xr);
  const int64_t nv = K / V;
  for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
    const Vec p = xv[j];
    float vals[V];
    float vmax = to_f(p.v[0]);
#pragma unroll
    for (int i = 0; i < V; ++i) vals[i] = to_f(p.v[i]), vmax = fmaxf(vmax, vals[i]);
    if (vmax > acc.m) {
      acc.s = acc.m == -INFINITY ? 0.f : acc.s * ex<kFast>(acc.m - vmax);
      acc.m = vmax;
    }
    if (acc.m != -INFINITY)
#pragma unroll
      for (int i = 0; i < V; ++i) acc.s += ex<kFast>(vals[i] - acc.m);
  }
  for (int64_t k = nv * V + threadIdx.x; k < K; k += blockDim.x) {
    const float v = to_f(xr[k]);
    if (v == -INFINITY) continue;
    if (v > acc.m) {
      acc.s = acc.s * ex<kFast>(acc.m - v) + 1.f;
      acc.m = v;
    } else {
      acc.s += ex<kFast>(v - acc.m);
    }
  }
  return block_merge<kFast>(acc, sm, ss);
}

// gx = (exp(x − l) − [k == t])·scale over the C columns (0 past K), as cross_entropy_backward_kernel.
template <bool kFast>
__device__ __forceinline__ void row_grad(const T* xr, T* gr, int64_t C, int64_t K, int64_t t, float l, float scale) {
  const Vec* xv = reinterpret_cast<const Vec*>(xr);
  Vec* gv = reinterpret_cast<Vec*>(gr);
  for (int64_t j = threadIdx.x; j < C / V; j += blockDim.x) {
    Vec o;
    if (j * V >= K) {
#pragma unroll
      for (int i = 0; i < V; ++i) o.v[i] = to_t(0.f);
    } else {
      const Vec p = xv[j];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int64_t k = j * V + i;
        o.v[i] = k < K ? to_t((ex<kFast>(to_f(p.v[i]) - l) - (k == t ? 1.f : 0.f)) * scale) : to_t(0.f);
      }
    }
    gv[j] = o;
  }
}

template <bool kFast>
__global__ void rows_kernel(const T* x, const int64_t* target, int64_t C, int64_t K, float* lse, float* loss) {
  __shared__ float sm[32], ss[32];
  const T* xr = x + int64_t(blockIdx.x) * C;
  const MaxSum acc = row_max_sum<kFast>(xr, K, sm, ss);
  if (threadIdx.x == 0) {
    const float l = acc.m + logf(acc.s);
    lse[blockIdx.x] = l;
    loss[blockIdx.x] = l - to_f(xr[target[blockIdx.x]]);
  }
}

template <bool kFast>
__global__ void backward_kernel(const float* g, const T* x, const int64_t* target, const float* lse, float count,
                                int64_t C, int64_t K, T* gx) {
  const int64_t row = blockIdx.x;
  row_grad<kFast>(x + row * C, gx + row * C, C, K, target[row], lse[row], g[0] / count);
}

// Both at once: the row's sums, then its gradient over the row read again.
template <bool kFast>
__global__ void fused_kernel(const float* g, T* x, const int64_t* target, float count, int64_t C, int64_t K,
                             float* lse, float* loss) {
  __shared__ float sm[32], ss[32];
  extern __shared__ char cap[];  // unused: sized to limit blocks per multiprocessor
  (void)cap;
  const int64_t row = blockIdx.x;
  T* xr = x + row * C;
  const MaxSum acc = row_max_sum<kFast>(xr, K, sm, ss);
  const float l = acc.m + logf(acc.s);
  const int64_t t = target[row];
  if (threadIdx.x == 0) {
    lse[row] = l;
    loss[row] = l - to_f(xr[t]);
  }
  __syncthreads();  // thread 0 has read x[t] before any thread overwrites it
  row_grad<kFast>(xr, xr, C, K, t, l, g[0] / count);
}


bool same(const void* a, const void* b, size_t bytes) {
  std::vector<char> x(bytes), y(bytes);
  CK(cudaMemcpy(x.data(), a, bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), b, bytes, cudaMemcpyDeviceToHost));
  return std::memcmp(x.data(), y.data(), bytes) == 0;
}

void shape(const char* name, int64_t N, int64_t C, int64_t K) {
  const int64_t n = N * C;
  T *x, *x2, *ref;
  CK(cudaMalloc(&x, n * sizeof(T)));
  CK(cudaMalloc(&x2, n * sizeof(T)));
  CK(cudaMalloc(&ref, n * sizeof(T)));
  std::vector<int64_t> tg(N);
  for (int64_t r = 0; r < N; ++r) tg[r] = (r * 7919) % K;
  int64_t* target;
  float *lse, *loss, *lse2, *loss2, *g;
  CK(cudaMalloc(&target, N * 8));
  CK(cudaMemcpy(target, tg.data(), N * 8, cudaMemcpyHostToDevice));
  for (float** p : {&lse, &loss, &lse2, &loss2}) CK(cudaMalloc(p, N * 4));
  CK(cudaMalloc(&g, 4));
  const float one = 1.f;
  CK(cudaMemcpy(g, &one, 4, cudaMemcpyHostToDevice));
  const float count = float(N);
  int sms, smem_max;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  const double bytes = 2.0 * n * sizeof(T);
  std::printf("%s: logits bf16 [%lld, %lld], %lld classes; one read and one write %.2f GB\n", name, (long long)N,
              (long long)C, (long long)K, bytes / 1e9);
  auto report = [&](const char* what, float us, bool ok) {
    std::printf("  %-34s %9.1f us  %5.2f TB/s of one read + one write  %s\n", what, us, bytes / us / 1e6,
                ok ? "bitwise" : "DIFFERS");
  };
  // Reference: the two kernels, accurate and fast; their outputs kept before timing.
  float *lse_ref[2], *lse_fast;
  T* ref_fast;
  CK(cudaMalloc(&ref_fast, n * sizeof(T)));
  for (float** p : {&lse_ref[0], &lse_ref[1]}) CK(cudaMalloc(p, N * 4));
  auto two = [&](bool fast, T* buf) {
    if (fast) {
      rows_kernel<true><<<unsigned(N), 256>>>(buf, target, C, K, lse, loss);
      backward_kernel<true><<<unsigned(N), 256>>>(g, buf, target, lse, count, C, K, buf);
    } else {
      rows_kernel<false><<<unsigned(N), 256>>>(buf, target, C, K, lse, loss);
      backward_kernel<false><<<unsigned(N), 256>>>(g, buf, target, lse, count, C, K, buf);
    }
  };
  for (int f = 0; f < 2; ++f) {
    fill<<<4096, 256>>>(x, n, C, K, 1);
    two(f == 1, x);
    CK(cudaMemcpy(f ? ref_fast : ref, x, n * sizeof(T), cudaMemcpyDeviceToDevice));
    CK(cudaMemcpy(lse_ref[f], lse, N * 4, cudaMemcpyDeviceToDevice));
  }
  (void)lse_fast;
  {  // how far the fast exp moves lse (relative) and the gradient (in bf16 units that differ)
    std::vector<float> a(N), b(N);
    CK(cudaMemcpy(a.data(), lse_ref[0], N * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), lse_ref[1], N * 4, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int64_t r = 0; r < N; ++r) worst = std::fmax(worst, std::fabs(double(a[r]) - b[r]) / std::fabs(double(a[r])));
    std::vector<uint16_t> ga(n), gb(n);
    CK(cudaMemcpy(ga.data(), ref, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gb.data(), ref_fast, n * 2, cudaMemcpyDeviceToHost));
    int64_t differ = 0, far = 0;
    for (int64_t i = 0; i < n; ++i)
      if (ga[i] != gb[i]) ++differ, far += std::abs(int(ga[i]) - int(gb[i])) > 1;
    std::printf("  fast exp against expf: lse max relative difference %.2e; gradient elements that differ %lld of %lld (%lld by more than one bf16 ulp)\n",
                worst, (long long)differ, (long long)n, (long long)far);
  }
  float us = time_us([&] { two(false, x); });
  report("rows + backward (as the step)", us, true);
  us = time_us([&] { two(true, x); });
  report("rows + backward, fast exp", us, true);
  us = time_us([&] { rows_kernel<false><<<unsigned(N), 256>>>(x, target, C, K, lse, loss); });
  report("  rows alone (one read)", us, true);
  us = time_us([&] { rows_kernel<true><<<unsigned(N), 256>>>(x, target, C, K, lse, loss); });
  report("  rows alone, fast exp", us, true);
  us = time_us([&] { copy_kernel<<<unsigned(sms * 8), 256>>>((const Vec*)x, (Vec*)x2, n / V); });
  report("copy (ceiling)", us, true);
  for (int fast = 0; fast < 2; ++fast)
    for (int threads : {256, 512}) {
      for (int per_sm : {3, 4, 6, 8}) {
        if (per_sm * threads > 2048) continue;
        auto kern = fast ? fused_kernel<true> : fused_kernel<false>;
        const int cap = per_sm == 8 ? 0 : smem_max / per_sm - 2048;  // leaves room for the static arrays
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, cap));
        fill<<<4096, 256>>>(x2, n, C, K, 1);
        kern<<<unsigned(N), threads, cap>>>(g, x2, target, count, C, K, lse2, loss2);
        CK(cudaDeviceSynchronize());
        const bool ok = same(x2, fast ? ref_fast : ref, n * sizeof(T)) && same(lse2, lse_ref[fast], N * 4);
        us = time_us([&] { kern<<<unsigned(N), threads, cap>>>(g, x2, target, count, C, K, lse2, loss2); });
        char label[64];
        std::snprintf(label, sizeof label, "fused%s, %d threads, <= %d blocks/SM", fast ? " fast" : "", threads, per_sm);
        report(label, us, ok);
      }
    }
  CK(cudaFree(ref_fast));
  CK(cudaFree(x));
  CK(cudaFree(x2));
  CK(cudaFree(ref));
}

int main() {
  shape("GPT-2 124M B=16", 16384, 50304, 50257);
  shape("llama-250m B=8", 8192, 32000, 32000);
  return 0;
}
