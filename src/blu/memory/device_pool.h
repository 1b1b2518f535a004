// memory/device_pool: the budgeted host pool behind Device cpu:N (N >= 1) — a second allocator on
// the CPU that plays an accelerator's memory, so that on a machine without a GPU the offload plans
// (offload/) put bytes on a "device" that is really separate from the host (cpu:0), moves between
// the two are explicit copies (to_device, offload/transfer), and the budget is enforced: a request
// that would take the live bytes past it throws OutOfMemoryError with the category report
// (memory/memory_report.h), as the CUDA caching allocator does when the GPU is full.
// Tensors on cpu:N run the CPU kernels (the backend is chosen by device type); only the accounting
// differs from cpu:0.
// Depends on memory/allocator, memory/memory_report. Keep: the budget is checked on the bytes
// callers asked for (rounded up to 64, the alignment) — what current_bytes/peak_bytes count, so a
// plan that predicts requested bytes is compared with the same number; unlimited until a budget is
// set; every live block's tag is dropped on its free.
#pragma once
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "blu/memory/allocator.h"
#include "blu/memory/memory_report.h"

namespace blu {

class DevicePool final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  explicit DevicePool(int index) : index_(index) {}
  DataPtr allocate(size_t nbytes) override;
  AllocatorStats stats() const override;
  void reset_peak() override;
  Device device() const override { return Device(DeviceType::cpu, index_); }
  void tag(void* ptr, MemoryTag tag) override { tags_.set(ptr, std::move(tag)); }

  // Live bytes may not exceed `bytes` (0: no budget). A budget below what is live already is
  // accepted; the next allocation fails.
  void set_budget(int64_t bytes);
  int64_t budget() const;
  // Every live block with its tag (for the report and the tests).
  std::vector<LiveBlock> live_blocks() const;

 private:
  static void release(void* ctx, void* ptr, size_t nbytes);
  static size_t rounded(size_t nbytes) { return (std::max<size_t>(nbytes, 1) + kAlignment - 1) / kAlignment * kAlignment; }
  int index_;
  mutable std::mutex mu_;
  int64_t budget_ = 0;
  int64_t current_ = 0, peak_ = 0, allocs_ = 0, frees_ = 0;
  std::unordered_map<void*, int64_t> live_;  // block → rounded bytes
  MemoryTags tags_;
};

// The pool of cpu:`index` (index >= 1), created on first use.
DevicePool& device_pool(int index);

}  // namespace blu
