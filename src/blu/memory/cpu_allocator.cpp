#include <cstdlib>
#include <new>

#include "blu/core/error.h"
#include "blu/core/exec_context.h"
#include "blu/memory/allocator.h"
#include "blu/memory/device_pool.h"

namespace blu {

void StatCounters::on_alloc(size_t n) {
  const int64_t cur = current_.fetch_add(int64_t(n)) + int64_t(n);
  int64_t peak = peak_.load();
  while (cur > peak && !peak_.compare_exchange_weak(peak, cur)) {
  }
  allocs_.fetch_add(1);
}

void StatCounters::on_free(size_t n) {
  current_.fetch_sub(int64_t(n));
  frees_.fetch_add(1);
}

AllocatorStats StatCounters::snapshot() const {
  AllocatorStats s;
  s.current_bytes = current_.load();
  s.peak_bytes = peak_.load();
  s.allocs = allocs_.load();
  s.frees = frees_.load();
  s.reserved_bytes = s.current_bytes;
  s.peak_reserved_bytes = s.peak_bytes;
  return s;
}

DataPtr CpuAllocator::allocate(size_t nbytes) {
  // aligned_alloc needs a size that is a multiple of the alignment; zero-byte tensors still get
  // a unique pointer so views of them are valid.
  const size_t padded = (std::max<size_t>(nbytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, padded);
  BLU_CHECK(p, "out of host memory allocating ", nbytes, " bytes (", counters_.snapshot().current_bytes,
            " bytes live)");
  counters_.on_alloc(nbytes);
  return DataPtr(p, nbytes, kCPU, &CpuAllocator::release, this);
}

void CpuAllocator::release(void* ctx, void* ptr, size_t nbytes) {
  std::free(ptr);
  static_cast<CpuAllocator*>(ctx)->counters_.on_free(nbytes);
}

CpuAllocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

static Allocator* (*g_allocators[kNumDeviceTypes])(int) = {};

void register_allocator(DeviceType type, Allocator* (*get)(int)) { g_allocators[int(type)] = get; }

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) return device.index == 0 ? static_cast<Allocator&>(cpu_allocator()) : device_pool(device.index);
  auto get = g_allocators[int(device.type)];
  BLU_CHECK(get, "no allocator for device ", device, ": this build has no backend for it");
  return *get(device.index);
}

// Workspaces (core/exec_context.h) grow through the device's allocator. A workspace grows a few
// times early in a run and then lives to its end: on a GPU the allocator's free segments go back
// first, so it gets a segment of its own instead of the start of a larger free one (an eager step's
// freed activation), which it would keep reserved for the rest of the run (GPT-2 124M at 0.6× of
// torch.compile's memory with 4 loss pieces: its 50 MiB scratch in a 394 MiB logits segment).
static const bool g_workspace_allocate_set = [] {
  set_workspace_allocate([](Device device, size_t nbytes) {
    Allocator& a = allocator_for(device);
    if (device.is_cuda()) a.release_cached();  // skipped while a stream records a graph
    DataPtr p = a.allocate(nbytes);
    a.tag(p.get(), MemoryTag{MemoryCategory::workspaces, "workspace"});
    return p;
  });
  return true;
}();

}  // namespace blu
