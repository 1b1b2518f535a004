// memory/cuda_allocator: the CUDA device allocator (one caching allocator per device over
// cudaMalloc/cudaFree, blocks bound to blu::cuda::current_stream() at allocation, reuse across
// streams guarded by cudaEvents) and the pinned host allocator used to stage transfers
// (cudaHostAlloc, cached the same way). The device allocator installs itself for
// DeviceType::cuda at static init, touching no CUDA API until the first allocation.
// Depends on memory/caching_allocator, memory/allocator, core/cuda/runtime. CUDA builds only.
// Keep: in a warm training loop no raw cudaMalloc happens (stats().raw_allocs stays flat); a
// tensor used on a stream other than the one it was allocated on needs record_stream(); pinned
// memory read or written by queued GPU work needs pinned_allocator().record_stream().
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "blu/core/tensor.h"
#include "blu/memory/allocator.h"
#include "blu/memory/caching_allocator.h"

namespace blu::cuda {

// Full statistics of cuda:`device`'s caching allocator (creates it if needed, touching no memory).
CachingAllocatorStats memory_stats(int device = -1);  // -1: the current device
void reset_peak_memory_stats(int device = -1);
// Gives every cached, unused segment of every device (and of the pinned allocator) back.
void empty_cache();
// Every segment and block of every device allocator that exists, and the pinned one, as JSON:
// {"cuda:0": [...segments...], "pinned": [...]} (see memory/caching_allocator.h).
std::string memory_snapshot();

// Marks `t`'s storage as used by work on `stream`: when freed, its block waits for that work.
void record_stream(const Tensor& t, cudaStream_t stream);

// Pinned (page-locked) host memory: Device cpu, but the GPU can DMA from and to it
// asynchronously. Blocks freed while a stream may still use them must have been recorded.
class PinnedAllocator final : public Allocator {
 public:
  PinnedAllocator();
  DataPtr allocate(size_t nbytes) override;
  AllocatorStats stats() const override;
  void reset_peak() override;
  Device device() const override { return kCPU; }
  // `ptr` (the start of an allocation from here) is used by work queued on `stream`.
  void record_stream(void* ptr, cudaStream_t stream);
  CachingAllocator& caching();

 private:
  static void release(void* ctx, void* ptr, size_t nbytes);
};
PinnedAllocator& pinned_allocator();
CachingAllocatorStats pinned_memory_stats();

}  // namespace blu::cuda
