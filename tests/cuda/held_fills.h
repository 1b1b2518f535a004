// A race harness for code that takes device blocks from the caching allocator and writes them on
// a side stream: fills queued on the current stream behind a host callback that holds it, on
// blocks freed right after. The caching allocator hands those blocks to the next allocations of
// their size at once, while the fills are still to run; code that writes them on another stream
// without waiting for the current one has its bytes overwritten when the hold ends.
// Nothing between the frees and the code under test may wait for the device, or the race hides:
// the victims are allocated (and the fill kernel loaded: a kernel's first launch loads its module,
// which waits) before the hold, and the cache is emptied first so that the victims' blocks are the
// only free ones of their size. Callers warm every other cache and kernel they use beforehand.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "blu/blu.h"
#include "blu/core/cuda/runtime.h"
#include "blu/memory/cuda_allocator.h"

namespace blu::test {

// `count` blocks of `n` f32 on `dev` get fills (1e3) held behind `hold_ms` of the current stream
// and are freed; returns when the hold started (a step queued after it must end before hold_ms).
inline std::chrono::steady_clock::time_point hold_fills_on_freed_blocks(int64_t n, int count, Device dev,
                                                                         int hold_ms = 300) {
  cuda::empty_cache();
  std::vector<Tensor> victims;
  for (int i = 0; i < count; ++i) victims.push_back(full({n}, 1.0, DType::f32, dev));
  const auto start = std::chrono::steady_clock::now();
  BLU_CUDA_CHECK(cudaLaunchHostFunc(
      cuda::current_stream(),
      [](void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms))); },
      reinterpret_cast<void*>(intptr_t(hold_ms))));
  for (const Tensor& v : victims) fill_(v, 1e3);  // queued behind the hold
  return start;                                   // the victims go here: their blocks are free
}

}  // namespace blu::test
