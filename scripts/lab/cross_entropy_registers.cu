// Whether the loss's forward and its logit gradient, made by one kernel that holds each row in
// registers between its logsumexp and its gradient, beat the two kernels the step runs now
// (backend/cuda/nn.cu: cross_entropy_rows_kernel with exp2f, then cross_entropy_backward_kernel
// with expf over the logits in place). One read and one write of the logits instead of two reads
// and a write (GPT-2 124M B=16: 3.3 GB instead of 4.9 a step). A row of GPT-2's 50,304 bf16
// columns is 100 KB, more than one block's registers leave room for at several blocks a
// multiprocessor, so a row is split over a cluster of `cl` blocks: each loads its share into
// registers (all of a thread's 16-byte loads issued before the first is used), takes its
// (max, sum of exp), the blocks merge theirs through distributed shared memory in rank order (the
// same lse in every block), and each writes its share's gradient over the logits. The shared-memory
// one-pass kernel (cross_entropy_one_pass.patch) held two rows a multiprocessor and lost in the
// step; here a multiprocessor holds as many row shares as its registers allow. A second one-pass
// design runs first: persistent blocks whose producer warp moves whole rows between memory and
// shared-memory buffers with bulk copies while the other warps compute (tma_kernel).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/cross_entropy_registers scripts/lab/cross_entropy_registers.cu && /tmp/cross_entropy_registers [all]
//
// (`all`: the register variants too.)
//
// Times in µs a call (CUDA events, 10 calls after 2; the logits are far larger than L2). "differ"
// counts the gradient's elements that differ from the two kernels' (bf16 units; > 1 ulp apart in
// brackets) and the largest relative difference of lse.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cross_entropy_lab.cuh"

namespace cg = cooperative_groups;

constexpr float kLog2e = 1.4426950408889634f;

// Marks a vector's words as rewritten, so that the compiler converts its values to fp32 again
// where they are next used instead of keeping twice as many fp32 registers live between uses.
__device__ __forceinline__ void refresh(Vec& p) {
  uint32_t* w = reinterpret_cast<uint32_t*>(&p);
#pragma unroll
  for (int i = 0; i < V / 2; ++i) asm volatile("" : "+r"(w[i]));
}

struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}
__device__ __forceinline__ MaxSum block_merge(MaxSum v, float* sm, float* ss) {
  v = warp_merge(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  if (lane == 0) sm[warp] = v.m, ss[warp] = v.s;
  __syncthreads();
  v = lane < nwarps ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.f};
  return warp_merge(v);
}

// --- the step's two kernels (backend/cuda/nn.cu, aligned rows, mean reduction) ---
__global__ void rows_kernel(const T* x, const int64_t* target, int64_t C, int64_t K, float* lse, float* loss) {
  __shared__ float sm[32], ss[32];
  const T* xr = x + int64_t(blockIdx.x) * C;
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
      acc.s = acc.m == -INFINITY ? 0.f : acc.s * expf(acc.m - vmax);
      acc.m = vmax;
    }
    if (acc.m != -INFINITY) {
      const float ml = acc.m * kLog2e;
#pragma unroll
      for (int i = 0; i < V; ++i) acc.s += exp2f(fmaf(vals[i], kLog2e, -ml));
    }
  }
  for (int64_t k = nv * V + threadIdx.x; k < K; k += blockDim.x) {
    const float v = to_f(xr[k]);
    if (v > acc.m) {
      acc.s = acc.s * expf(acc.m - v) + 1.f;
      acc.m = v;
    } else {
      acc.s += expf(v - acc.m);
    }
  }
  acc = block_merge(acc, sm, ss);
  if (threadIdx.x == 0) {
    const float l = acc.m + logf(acc.s);
    lse[blockIdx.x] = l;
    loss[blockIdx.x] = l - to_f(xr[target[blockIdx.x]]);
  }
}

__global__ void backward_kernel(float scale, const T* x, const int64_t* target, const float* lse, int64_t C, int64_t K,
                                T* gx) {
  const int64_t row = blockIdx.x;
  const Vec* xv = reinterpret_cast<const Vec*>(x + row * C);
  Vec* gv = reinterpret_cast<Vec*>(gx + row * C);
  const int64_t t = target[row];
  const float l = lse[row];
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
        o.v[i] = k < K ? to_t((expf(to_f(p.v[i]) - l) - (k == t ? 1.f : 0.f)) * scale) : to_t(0.f);
      }
    }
    gv[j] = o;
  }
}

// --- one pass, the row in registers, split over a cluster ---
// kVpt: 16-byte vectors a thread holds. Block b of cluster rank r takes vectors r·blockDim +
// threadIdx + i·blockDim·cl (i < kVpt) of row b / cl. kFastGrad: the gradient's exp as exp2f of
// one FMA (else expf, as the step's backward kernel).
template <int kVpt, bool kFastGrad, int kMaxThreads = 1024, int kMinBlocks = 1>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks) registers_kernel(T* x, const int64_t* target, float scale, int64_t C, int64_t K, float* lse,
                                 float* loss) {
  __shared__ float sm[32], ss[32];
  __shared__ float part_m, part_s, tot_m, tot_s;
  cg::cluster_group cl = cg::this_cluster();
  const int ncl = int(cl.num_blocks()), rank = int(cl.block_rank());
  const int64_t row = blockIdx.x / ncl;
  T* xr = x + row * C;
  Vec* xv = reinterpret_cast<Vec*>(xr);
  // 32-bit indices within the row (a row has far fewer than 2^31 vectors).
  const int nv = int(C / V), k_end = int(K);
  const int j0 = rank * int(blockDim.x) + int(threadIdx.x), stride = int(blockDim.x) * ncl;
  const int t = int(target[row]);
  float xt = 0.f;
  if (rank == 0 && threadIdx.x == 0) xt = to_f(xr[t]);  // before any block of the cluster writes the row
  Vec p[kVpt];
#pragma unroll
  for (int i = 0; i < kVpt; ++i)
    if (j0 + i * stride < nv) p[i] = xv[j0 + i * stride];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int j = j0 + i * stride;
    if (j >= nv) continue;
    if ((j + 1) * V <= k_end) {
#pragma unroll
      for (int e = 0; e < V; ++e) m = fmaxf(m, to_f(p[i].v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (j * V + e < k_end) m = fmaxf(m, to_f(p[i].v[e]));
    }
  }
#pragma unroll
  for (int i = 0; i < kVpt; ++i) refresh(p[i]);
  float s = 0.f;
  if (m != -INFINITY) {
    const float ml = m * kLog2e;
#pragma unroll
    for (int i = 0; i < kVpt; ++i) {
      const int j = j0 + i * stride;
      if (j >= nv) continue;
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (j * V + e < k_end) s += exp2f(fmaf(to_f(p[i].v[e]), kLog2e, -ml));
    }
  }
  MaxSum acc = block_merge(MaxSum{m, s}, sm, ss);
  if (threadIdx.x == 0) part_m = acc.m, part_s = acc.s;
  cl.sync();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    MaxSum v{-INFINITY, 0.f};
    if (lane < ncl) v = MaxSum{*cl.map_shared_rank(&part_m, lane), *cl.map_shared_rank(&part_s, lane)};
    v = warp_merge(v);
    if (lane == 0) tot_m = v.m, tot_s = v.s;
  }
  __syncthreads();
  cl.barrier_arrive();  // this block has read the others' partials; they stay until every block has
  const float l = tot_m + logf(tot_s);
  if (rank == 0 && threadIdx.x == 0) {
    lse[row] = l;
    loss[row] = l - xt;
  }
  const float ll = l * kLog2e;
#pragma unroll
  for (int i = 0; i < kVpt; ++i) refresh(p[i]);
#pragma unroll
  for (int i = 0; i < kVpt; ++i) {
    const int j = j0 + i * stride;
    if (j >= nv) continue;
    Vec o;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int k = j * V + e;
      const float v = to_f(p[i].v[e]);
      const float ex = kFastGrad ? exp2f(fmaf(v, kLog2e, -ll)) : expf(v - l);
      o.v[e] = k < k_end ? to_t((ex - (k == t ? 1.f : 0.f)) * scale) : to_t(0.f);
    }
    xv[j] = o;
  }
  cl.barrier_wait();
}


// Gradient elements of a and b that differ, and those more than one bf16 unit apart.
__global__ void count_diff(const uint16_t* a, const uint16_t* b, int64_t n, unsigned long long* out) {
  unsigned long long d = 0, f = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (a[i] != b[i]) ++d, f += abs(int(a[i]) - int(b[i])) > 1;
  atomicAdd(&out[0], d);
  atomicAdd(&out[1], f);
}

// How far a result is from the two kernels' (ref, lse_ref): gradient elements that differ, those
// more than one bf16 unit apart, and lse's largest relative difference.
struct Diff {
  long long differ, far;
  double lse;
};
Diff compare(const T* x, const T* ref, const float* lse, const float* lse_ref, int64_t N, int64_t n) {
  std::vector<float> a(N), b(N);
  CK(cudaMemcpy(a.data(), lse, N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), lse_ref, N * 4, cudaMemcpyDeviceToHost));
  Diff d{0, 0, 0.0};
  for (int64_t r = 0; r < N; ++r) d.lse = std::fmax(d.lse, std::fabs(double(a[r]) - b[r]) / std::fabs(double(b[r])));
  static unsigned long long* counts = nullptr;
  if (!counts) CK(cudaMalloc(&counts, 16));
  CK(cudaMemset(counts, 0, 16));
  count_diff<<<1024, 256>>>(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(ref), n, counts);
  unsigned long long hc[2];
  CK(cudaMemcpy(hc, counts, 16, cudaMemcpyDeviceToHost));
  d.differ = (long long)hc[0];
  d.far = (long long)hc[1];
  return d;
}

// --- one pass, persistent blocks, rows staged through shared memory by the TMA ---
// One block a multiprocessor, kBuf row buffers in shared memory. Warp 0's lane 0 is the producer:
// it loads row i into buffer i % kBuf with one bulk copy (cp.async.bulk, completing on full[b]),
// and once the consumers have written the row's gradient over it (done[b]) stores it back with a
// bulk copy and, when the store has read the buffer, loads the block's next row into it. The
// kCons consumer threads (warps 1..) take the row's (max, sum of exp) from shared memory, merge
// them over the block, write the gradient over the row in place, and arrive on done[b]. So a
// multiprocessor's loads and stores run while its consumers compute another row.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void cons_sync(int cons) { asm volatile("bar.sync 1, %0;" ::"r"(cons) : "memory"); }

constexpr uint32_t kPiece = 32768;  // bytes a bulk copy moves at most
__device__ __forceinline__ void load_row(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  mbar_expect_tx(bar, bytes);
  for (uint32_t o = 0; o < bytes; o += kPiece)
    bulk_load(static_cast<char*>(dst) + o, static_cast<const char*>(src) + o, min(kPiece, bytes - o), bar);
}
__device__ __forceinline__ void store_row(void* dst, const void* src, uint32_t bytes) {
  for (uint32_t o = 0; o < bytes; o += kPiece)
    bulk_store(static_cast<char*>(dst) + o, static_cast<const char*>(src) + o, min(kPiece, bytes - o));
  bulk_commit();
}

template <int kBuf, int kCons, bool kFastGrad>
__global__ void __launch_bounds__(32 + kCons, 1) tma_kernel(T* x, const int64_t* target, float scale, int64_t N,
                                                            int64_t C, int64_t K, float* lse, float* loss) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kBuf], done[kBuf];
  __shared__ float sm[32], ss[32];
  const uint32_t row_bytes = uint32_t(C * sizeof(T));
  const uint32_t buf_bytes = (row_bytes + 127) / 128 * 128;
  const int64_t first = blockIdx.x, step = gridDim.x;
  const int64_t rows = first < N ? (N - 1 - first) / step + 1 : 0;
  if (threadIdx.x == 0) {
    for (int b = 0; b < kBuf; ++b) mbar_init(&full[b], 1), mbar_init(&done[b], kCons);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // the producer warp
    if (threadIdx.x == 0) {
      for (int64_t i = 0; i < rows + kBuf; ++i) {
        const int b = int(i % kBuf);
        if (i >= kBuf) {  // buffer b holds row i - kBuf: store it once its gradient is written
          mbar_wait(&done[b], uint32_t((i / kBuf - 1) & 1));
          store_row(x + (first + (i - kBuf) * step) * C, smem + b * buf_bytes, row_bytes);
          bulk_wait_read0();
        }
        if (i < rows) load_row(smem + b * buf_bytes, x + (first + i * step) * C, row_bytes, &full[b]);
      }
      bulk_wait0();
    }
    return;
  }
  const int tid = threadIdx.x - 32;
  const int nv = int(C / V), k_end = int(K);
  for (int64_t i = 0; i < rows; ++i) {
    const int b = int(i % kBuf);
    const int64_t row = first + i * step;
    const int t = int(target[row]);
    mbar_wait(&full[b], uint32_t((i / kBuf) & 1));
    Vec* xv = reinterpret_cast<Vec*>(smem + b * buf_bytes);
    const T* xs = reinterpret_cast<const T*>(xv);
    MaxSum acc{-INFINITY, 0.f};
    for (int j = tid; j < nv; j += kCons) {
      const Vec p = xv[j];
      float vals[V];
      float vmax = -INFINITY;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        vals[e] = j * V + e < k_end ? to_f(p.v[e]) : -INFINITY;
        vmax = fmaxf(vmax, vals[e]);
      }
      if (vmax > acc.m) {
        acc.s = acc.m == -INFINITY ? 0.f : acc.s * expf(acc.m - vmax);
        acc.m = vmax;
      }
      if (acc.m != -INFINITY) {
        const float ml = acc.m * kLog2e;
#pragma unroll
        for (int e = 0; e < V; ++e) acc.s += exp2f(fmaf(vals[e], kLog2e, -ml));
      }
    }
    // The block merge over the consumers (named barrier 1; the producer warp is not in it).
    acc = warp_merge(acc);
    const int lane = tid % 32, warp = tid / 32;
    if (lane == 0) sm[warp] = acc.m, ss[warp] = acc.s;
    const float xt = to_f(xs[t]);  // before the barrier after which the row is overwritten
    cons_sync(kCons);
    acc = lane < kCons / 32 ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.f};
    acc = warp_merge(acc);
    const float l = acc.m + logf(acc.s);
    if (tid == 0) lse[row] = l, loss[row] = l - xt;
    const float ll = l * kLog2e;
    for (int j = tid; j < nv; j += kCons) {
      const Vec p = xv[j];
      Vec o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int k = j * V + e;
        const float v = to_f(p.v[e]);
        const float ex = kFastGrad ? exp2f(fmaf(v, kLog2e, -ll)) : expf(v - l);
        o.v[e] = k < k_end ? to_t((ex - (k == t ? 1.f : 0.f)) * scale) : to_t(0.f);
      }
      xv[j] = o;
    }
    fence_async_smem();  // the gradient's stores before the bulk store that reads them
    mbar_arrive(&done[b]);
    cons_sync(kCons);  // sm/ss are free for the next row
  }
}

template <int kBuf, int kCons, bool kFastGrad>
void run_tma(T* x, T* ref, const float* lse_ref, int64_t N, int64_t C, int64_t K, const int64_t* target, float scale,
             float* lse, float* loss, int sms) {
  const size_t buf_bytes = (size_t(C) * sizeof(T) + 127) / 128 * 128;
  const size_t smem = kBuf * buf_bytes;
  auto kern = tma_kernel<kBuf, kCons, kFastGrad>;
  int smem_max;
  CK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  if (smem + 2048 > size_t(smem_max)) return;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int64_t n = N * C;
  fill<<<4096, 256>>>(x, n, C, K, 1);
  kern<<<unsigned(sms), 32 + kCons, smem>>>(x, target, scale, N, C, K, lse, loss);
  CK(cudaDeviceSynchronize());
  const Diff d = compare(x, ref, lse, lse_ref, N, n);
  const float us = time_us([&] { kern<<<unsigned(sms), 32 + kCons, smem>>>(x, target, scale, N, C, K, lse, loss); });
  const double bytes = 2.0 * n * sizeof(T);
  std::printf("  tma %s  buffers %d consumers %4d smem %6zu  %8.1f us %5.2f TB/s  differ %lld (%lld) lse %.1e\n",
              kFastGrad ? "fast grad" : "expf grad", kBuf, kCons, smem, us, bytes / us / 1e6, d.differ, d.far,
              d.lse);
}

template <int kVpt, bool kFastGrad, int kMaxThreads = 1024, int kMinBlocks = 1>
void run_registers(const char* name, T* x, T* ref, const float* lse_ref, int64_t N, int64_t C, int64_t K,
                   const int64_t* target, float scale, float* lse, float* loss, int ncl) {
  const int64_t nv = C / V;
  const int64_t per_block = (nv + int64_t(ncl) - 1) / ncl;
  const int threads = int(((per_block + kVpt - 1) / kVpt + 31) / 32 * 32);
  if (threads > kMaxThreads || threads * int64_t(kVpt) * ncl < nv) return;
  auto kern = registers_kernel<kVpt, kFastGrad, kMaxThreads, kMinBlocks>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(N * ncl));
  cfg.blockDim = dim3(unsigned(threads));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(ncl);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, kern));
  int clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
  const int64_t n = N * C;
  fill<<<4096, 256>>>(x, n, C, K, 1);
  CK(cudaLaunchKernelEx(&cfg, kern, x, target, scale, C, K, lse, loss));
  CK(cudaDeviceSynchronize());
  // Against the two kernels: lse relative, gradient elements that differ.
  const Diff d = compare(x, ref, lse, lse_ref, N, n);
  const float us = time_us([&] { CK(cudaLaunchKernelEx(&cfg, kern, x, target, scale, C, K, lse, loss)); });
  const double bytes = 2.0 * n * sizeof(T);
  std::printf("  %-10s vpt %d cl %d threads %4d (bound %4d, %d) regs %3d clusters/GPU %4d  %8.1f us %5.2f TB/s  differ %lld (%lld) lse %.1e\n",
              name, kVpt, ncl, threads, kMaxThreads, kMinBlocks, fa.numRegs, clusters, us, bytes / us / 1e6, d.differ,
              d.far, d.lse);
}

bool g_registers = false;  // the cluster-register variants too (argument "all")

void shape(const char* name, int64_t N, int64_t C, int64_t K) {
  const int64_t n = N * C;
  T *x, *x2, *ref;
  CK(cudaMalloc(&x, n * sizeof(T)));
  CK(cudaMalloc(&x2, n * sizeof(T)));
  CK(cudaMalloc(&ref, n * sizeof(T)));
  std::vector<int64_t> tg(N);
  for (int64_t r = 0; r < N; ++r) tg[r] = (r * 7919) % K;
  int64_t* target;
  float *lse, *loss, *lse_ref;
  CK(cudaMalloc(&target, N * 8));
  CK(cudaMemcpy(target, tg.data(), N * 8, cudaMemcpyHostToDevice));
  for (float** p : {&lse, &loss, &lse_ref}) CK(cudaMalloc(p, N * 4));
  const float scale = 1.f / float(N);
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double bytes = 2.0 * n * sizeof(T);
  std::printf("%s: logits bf16 [%lld, %lld], %lld classes; one read and one write %.2f GB\n", name, (long long)N,
              (long long)C, (long long)K, bytes / 1e9);
  auto two = [&](T* buf) {
    rows_kernel<<<unsigned(N), 256>>>(buf, target, C, K, lse, loss);
    backward_kernel<<<unsigned(N), 256>>>(scale, buf, target, lse, C, K, buf);
  };
  fill<<<4096, 256>>>(x, n, C, K, 1);
  two(x);
  CK(cudaMemcpy(ref, x, n * sizeof(T), cudaMemcpyDeviceToDevice));
  CK(cudaMemcpy(lse_ref, lse, N * 4, cudaMemcpyDeviceToDevice));
  float us = time_us([&] { two(x); });
  std::printf("  %-60s %8.1f us %5.2f TB/s\n", "rows + backward (the step's two kernels)", us, bytes / us / 1e6);
  us = time_us([&] { copy_kernel<<<unsigned(sms * 8), 256>>>((const Vec*)x, (Vec*)x2, n / V); });
  std::printf("  %-60s %8.1f us %5.2f TB/s\n", "copy (one read, one write: the ceiling)", us, bytes / us / 1e6);
  run_tma<2, 256, false>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<2, 512, false>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<2, 992, false>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<2, 512, true>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<3, 512, false>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<3, 992, false>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  run_tma<3, 512, true>(x, ref, lse_ref, N, C, K, target, scale, lse, loss, sms);
  if (!g_registers) return;
  for (int ncl : {1, 2, 4, 8}) {
#define RUN(vpt, fast, ...) \
  run_registers<vpt, fast, ##__VA_ARGS__>(fast ? "fast grad" : "expf grad", x, ref, lse_ref, N, C, K, target, scale, lse, loss, ncl)
    RUN(2, true);
    RUN(4, true);
    RUN(7, true);
    RUN(4, true, 512, 2);
    RUN(4, true, 256, 4);
    RUN(7, true, 512, 2);
    RUN(7, true, 256, 4);
    RUN(7, true, 160, 6);
    RUN(7, true, 128, 8);
    RUN(4, false);
    RUN(7, false);
    RUN(7, false, 256, 4);
#undef RUN
  }
  CK(cudaFree(x));
  CK(cudaFree(x2));
  CK(cudaFree(ref));
}

int main(int argc, char** argv) {
  g_registers = argc > 1 && std::strcmp(argv[1], "all") == 0;
  shape("GPT-2 124M B=16", 16384, 50304, 50257);
  shape("llama-250m B=8", 8192, 32000, 32000);
  return 0;
}
