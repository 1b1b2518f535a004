// memory/allocator: the interface every device allocator implements (the CPU one here, the CUDA
// caching allocator later), with the statistics users and tests read, and the registry that maps
// a device type to its allocator.
// Depends on core/storage. Keep: every tensor byte comes from an Allocator; statistics count
// bytes as requested by callers (`current`, `peak`) and calls (`allocs`, `frees`).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "blu/core/device.h"
#include "blu/core/storage.h"
#include "blu/memory/memory_report.h"

namespace blu {

struct AllocatorStats {
  int64_t current_bytes = 0;  // live, as requested
  int64_t peak_bytes = 0;     // highest current_bytes since the last reset_peak()
  int64_t allocs = 0;         // allocate() calls
  int64_t frees = 0;          // releases
  int64_t reserved_bytes = 0; // held from the system (== current for allocators that do not cache)
  int64_t peak_reserved_bytes = 0;  // highest reserved_bytes since the last reset_peak() (what
                                    // torch.cuda.max_memory_reserved reports)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual DataPtr allocate(size_t nbytes) = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void reset_peak() = 0;
  virtual Device device() const = 0;
  // Records what the live block at `ptr` holds, for the out-of-memory report
  // (memory/memory_report.h). Allocators that keep no tags ignore it.
  virtual void tag(void* ptr, MemoryTag tag) {}
  // Gives cached free memory back to the system (a caching allocator's free segments); what is
  // allocated stays. Allocators that cache nothing do nothing.
  virtual void release_cached() {}
};

// Counters shared by allocators; thread-safe.
class StatCounters {
 public:
  void on_alloc(size_t n);
  void on_free(size_t n);
  AllocatorStats snapshot() const;
  void reset_peak() { peak_.store(current_.load()); }

 private:
  std::atomic<int64_t> current_{0}, peak_{0}, allocs_{0}, frees_{0};
};

// Host memory aligned to 64 bytes (a cache line; enough for any vector load).
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  DataPtr allocate(size_t nbytes) override;
  AllocatorStats stats() const override { return counters_.snapshot(); }
  void reset_peak() override { counters_.reset_peak(); }
  Device device() const override { return kCPU; }

 private:
  static void release(void* ctx, void* ptr, size_t nbytes);
  StatCounters counters_;
};

CpuAllocator& cpu_allocator();
// The allocator for a device: the host's for cpu:0, the budgeted device pool
// (memory/device_pool.h) for cpu:N with N >= 1, the registered backend's otherwise. BLU_CHECK when that device type has none (e.g. CUDA not built).
Allocator& allocator_for(Device device);
// Lets a backend (the CUDA one) install its allocator.
void register_allocator(DeviceType type, Allocator* (*get)(int index));

}  // namespace blu
