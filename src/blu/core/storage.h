// core/storage: a block of bytes on one device that tensors view. The bytes come from an
// allocator (memory/), which the core does not know: a DataPtr carries its own release function.
// Depends on core/device. Keep: Storage is shared (shared_ptr) by every tensor viewing it, and
// frees its bytes exactly once when the last view goes; every write to existing bytes bumps the
// version (Note [Storage versions]).
#pragma once
#include <atomic>
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

// Note [Storage versions]
// A storage counts the writes made to its bytes after they were first produced: version() is 0
// for a fresh allocation (an op's output) and every later write bumps it — ops/dispatch after
// each in-place kernel (copy_, fill_, add_, optimizer steps: every input the op writes, see
// OpDef::writes), the process groups for the tensors a collective fills (dist/), and any other
// code that writes through raw_data() into a storage someone may already read. What reads it:
// a value derived from a storage can remember (storage, version) and know it is still current
// while the version has not moved — nn/compute_copy.h keeps the 16-bit compute copies of
// parameters that way. Views share their storage, so a write through any view bumps them all
// (conservative: a copy of one view is re-made after a write to another). The bump happens on
// the host when the write is issued (a device kernel or collective may still be running); readers
// that go through ops are ordered after it on the stream.
struct Storage {
  DataPtr data;
  explicit Storage(DataPtr d) : data(std::move(d)) {}
  void* ptr() const { return data.get(); }
  size_t nbytes() const { return data.nbytes(); }
  Device device() const { return data.device(); }
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  // Set by a backward that hands disjoint pieces of this storage, a gradient nothing else refers
  // to, to different leaf tensors as their gradients (ops/view.h: cast_with_copy over sibling
  // parameters): a leaf may keep its piece without a copy (autograd/node.cpp, AccumulateGrad).
  bool split_among_leaves = false;

 private:
  std::atomic<uint64_t> version_{0};
};

}  // namespace blu
