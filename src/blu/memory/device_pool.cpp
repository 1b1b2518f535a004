// memory/device_pool: the budgeted host pool behind cpu:N (header).
#include "blu/memory/device_pool.h"

#include <array>
#include <cstdlib>
#include <memory>

#include "blu/core/error.h"

namespace blu {

DataPtr DevicePool::allocate(size_t nbytes) {
  const int64_t n = int64_t(rounded(nbytes));
  {
    std::unique_lock lock(mu_);
    if (budget_ > 0 && current_ + n > budget_) {
      std::vector<LiveBlock> live;
      for (const auto& [p, b] : live_) live.push_back({b, tags_.get(p)});
      const int64_t budget = budget_;
      lock.unlock();
      MemoryReport r = make_memory_report(device().str(), n, budget, 0, live);
      const std::string msg = explain_oom(r);  // before r is moved into the error
      throw OutOfMemoryError(msg, std::move(r));
    }
    current_ += n;
    peak_ = std::max(peak_, current_);
    ++allocs_;
  }
  void* p = std::aligned_alloc(kAlignment, size_t(n));
  if (!p) {
    std::lock_guard lock(mu_);
    current_ -= n;
    BLU_CHECK(false, device(), ": out of host memory allocating ", nbytes, " bytes");
  }
  {
    std::lock_guard lock(mu_);
    live_[p] = n;
  }
  return DataPtr(p, nbytes, device(), &DevicePool::release, this);
}

void DevicePool::release(void* ctx, void* ptr, size_t) {
  auto* self = static_cast<DevicePool*>(ctx);
  self->tags_.erase(ptr);
  {
    std::lock_guard lock(self->mu_);
    auto it = self->live_.find(ptr);
    BLU_ASSERT(it != self->live_.end(), self->device(), ": free of a block this pool did not hand out");
    self->current_ -= it->second;
    ++self->frees_;
    self->live_.erase(it);
  }
  std::free(ptr);
}

AllocatorStats DevicePool::stats() const {
  std::lock_guard lock(mu_);
  AllocatorStats s;
  s.current_bytes = current_;
  s.peak_bytes = peak_;
  s.allocs = allocs_;
  s.frees = frees_;
  s.reserved_bytes = current_;
  s.peak_reserved_bytes = peak_;
  return s;
}

void DevicePool::reset_peak() {
  std::lock_guard lock(mu_);
  peak_ = current_;
}

void DevicePool::set_budget(int64_t bytes) {
  BLU_CHECK(bytes >= 0, device(), ": a memory budget must be >= 0 bytes, got ", bytes);
  std::lock_guard lock(mu_);
  budget_ = bytes;
}

int64_t DevicePool::budget() const {
  std::lock_guard lock(mu_);
  return budget_;
}

std::vector<LiveBlock> DevicePool::live_blocks() const {
  std::vector<std::pair<void*, int64_t>> blocks;
  {
    std::lock_guard lock(mu_);
    blocks.assign(live_.begin(), live_.end());
  }
  std::vector<LiveBlock> out;
  for (const auto& [p, b] : blocks) out.push_back({b, tags_.get(p)});
  return out;
}

DevicePool& device_pool(int index) {
  constexpr int kMaxPools = 16;
  BLU_CHECK(index >= 1 && index < kMaxPools, "cpu:", index, ": device pools are cpu:1 … cpu:", kMaxPools - 1);
  static std::array<std::unique_ptr<DevicePool>, kMaxPools> pools;
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (!pools[size_t(index)]) pools[size_t(index)] = std::make_unique<DevicePool>(index);
  return *pools[size_t(index)];
}

}  // namespace blu
