// core/storage: a block of bytes on one device that tensors view. The bytes come from an
// allocator (memory/), which the core does not know: a DataPtr carries its own release function.
// Depends on core/device. Keep: Storage is shared (shared_ptr) by every tensor viewing it, and
// frees its bytes exactly once when the last view goes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "blu/core/device.h"

namespace blu {

// Owning pointer to device bytes, released through `release` (the allocator that made them).
class DataPtr {
 public:
  using Release = void (*)(void* ctx, void* ptr, size_t nbytes);
  DataPtr() = default;
  DataPtr(void* ptr, size_t nbytes, Device device, Release release, void* ctx)
      : ptr_(ptr), nbytes_(nbytes), device_(device), release_(release), ctx_(ctx) {}
  DataPtr(DataPtr&& o) noexcept { swap(o); }
  DataPtr& operator=(DataPtr&& o) noexcept {
    DataPtr tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  DataPtr(const DataPtr&) = delete;
  DataPtr& operator=(const DataPtr&) = delete;
  ~DataPtr() {
    if (release_) release_(ctx_, ptr_, nbytes_);
  }
  void* get() const { return ptr_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void swap(DataPtr& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(nbytes_, o.nbytes_);
    std::swap(device_, o.device_);
    std::swap(release_, o.release_);
    std::swap(ctx_, o.ctx_);
  }
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Release release_ = nullptr;
  void* ctx_ = nullptr;
};

struct Storage {
  DataPtr data;
  explicit Storage(DataPtr d) : data(std::move(d)) {}
  void* ptr() const { return data.get(); }
  size_t nbytes() const { return data.nbytes(); }
  Device device() const { return data.device(); }
};

}  // namespace blu
