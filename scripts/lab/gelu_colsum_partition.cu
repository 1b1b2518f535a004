// Whether a kernel that makes a gradient can take its column sum (a bias gradient) for less than
// the two kernels apart: GPT-2's GELU backward (y = gelu(x), d = g·gelu'(x), tanh form, bf16
// [16384, 3072]) as the flat 16-byte-per-thread kernel, and in the column-sum partition of
// backend/cuda/linalg.cu (block (32, 8) over a slab of 256 columns and a chunk of rows, then the
// chunks summed in double) at chunks of 256 to 32 rows, beside the column sum alone (also at
// GPT-2's 768 and 2304 columns). The operands stay in L2 between repetitions for the narrow ones.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/gelu_colsum_partition scripts/lab/gelu_colsum_partition.cu && /tmp/gelu_colsum_partition
//
// Times in µs a call (CUDA events, 50 calls after 5).
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
typedef __nv_bfloat16 T;
struct alignas(16) V8 { T v[8]; };
__device__ __forceinline__ float tanh_fast(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ void gelu2(const V8& g, const V8& x, V8& y, V8& d) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float xa = __bfloat162float(x.v[j]);
    float u = 0.7978845608f * (xa + 0.044715f * xa * xa * xa);
    float t = tanh_fast(u);
    y.v[j] = __float2bfloat16_rn(0.5f * xa * (1.f + t));
    float dt = (1.f - t * t) * 0.7978845608f * (1.f + 3.f * 0.044715f * xa * xa);
    d.v[j] = __float2bfloat16_rn(__bfloat162float(g.v[j]) * (0.5f * (1.f + t) + 0.5f * xa * dt));
  }
}
__global__ void flat(int64_t nvec, const V8* g, const V8* x, V8* y, V8* d) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * blockDim.x) {
    V8 a, b; gelu2(g[i], x[i], a, b); y[i] = a; d[i] = b;
  }
}
template <bool kFused>
__global__ void __launch_bounds__(256) slab(int64_t R, int64_t N, int64_t chunk, const T* g, const T* x, T* y, T* d, float* partial) {
  __shared__ float sm[8][32 * 8 + 1];
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t col0 = (int64_t(blockIdx.x) * 32 + lane) * 8;
  const int64_t r0 = int64_t(blockIdx.y) * chunk, r1 = min(R, r0 + chunk);
  float acc[8] = {};
  if (col0 < N)
    for (int64_t r = r0 + warp; r < r1; r += 8) {
      const int64_t i = r * N + col0;
      V8 dv;
      if (kFused) {
        V8 yv; gelu2(*(const V8*)(g + i), *(const V8*)(x + i), yv, dv); *(V8*)(y + i) = yv; *(V8*)(d + i) = dv;
      } else {
        dv = *(const V8*)(d + i);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(dv.v[e]);
    }
#pragma unroll
  for (int e = 0; e < 8; ++e) sm[warp][lane * 8 + e] = acc[e];
  __syncthreads();
  for (int i = warp * 32 + lane; i < 256; i += 256) {
    const int64_t col = int64_t(blockIdx.x) * 256 + i;
    if (col >= N) continue;
    float t = 0.f;
    for (int w = 0; w < 8; ++w) t += sm[w][i];
    partial[int64_t(blockIdx.y) * N + col] = t;
  }
}
__global__ void final_(const float* p, int64_t chunks, int64_t N, float* out) {
  __shared__ double sm[32][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double t = 0;
  if (col < N) for (int64_t i = threadIdx.y; i < chunks; i += blockDim.y) t += p[i * N + col];
  sm[threadIdx.y][threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) { t = 0; for (int i = 0; i < 32; ++i) t += sm[i][threadIdx.x]; out[col] = float(t); }
}
int main() {
  const int64_t R = 16384;
  for (int64_t N : {3072, 768, 2304}) {
  T *g, *x, *y, *d; float *part, *out;
  cudaMalloc(&g, R * N * 2); cudaMalloc(&x, R * N * 2); cudaMalloc(&y, R * N * 2); cudaMalloc(&d, R * N * 2);
  cudaMalloc(&part, 1024 * N * 4); cudaMalloc(&out, N * 4);
  cudaMemset(g, 0x3c, R * N * 2); cudaMemset(x, 0x3c, R * N * 2);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto time = [&](auto f) { for (int i = 0; i < 5; ++i) f(); cudaEventRecord(e0); for (int i = 0; i < 50; ++i) f(); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); return ms * 1000 / 50; };
  const int64_t nvec = R * N / 8;
  if (N == 3072) printf("N %ld flat gelu: %.1f us\n", (long)N, time([&] { flat<<<132 * 16, 256>>>(nvec, (V8*)g, (V8*)x, (V8*)y, (V8*)d); }));
  const int64_t slabs = (N + 255) / 256;
  for (int64_t chunk : {256, 128, 64, 32}) {
    const int64_t chunks = (R + chunk - 1) / chunk;
    float plain = time([&] { slab<false><<<dim3(slabs, chunks), dim3(32, 8)>>>(R, N, chunk, g, x, y, d, part); final_<<<(N + 31) / 32, dim3(32, 32)>>>(part, chunks, N, out); });
    float fused = N == 3072 ? time([&] { slab<true><<<dim3(slabs, chunks), dim3(32, 8)>>>(R, N, chunk, g, x, y, d, part); final_<<<(N + 31) / 32, dim3(32, 32)>>>(part, chunks, N, out); }) : 0;
    printf("N %ld chunk %ld (%ld blocks): colsum %.1f us, fused gelu+colsum %.1f us\n", (long)N, (long)chunk, (long)(slabs * chunks), plain, fused);
  }
  cudaFree(g); cudaFree(x); cudaFree(y); cudaFree(d); cudaFree(part); cudaFree(out);
  }
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
}
