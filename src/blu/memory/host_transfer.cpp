#include "blu/memory/host_transfer.h"

#include <cstdlib>
#include <cstring>

#include "blu/core/error.h"

namespace blu {

namespace {

class HostOffloadAllocator final : public Allocator {
 public:
  DataPtr allocate(size_t nbytes) override {
    const size_t padded = (std::max<size_t>(nbytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, padded);
    BLU_CHECK(p, "out of host memory allocating ", nbytes, " bytes for offloaded activations (",
              counters_.snapshot().current_bytes, " bytes live)");
    counters_.on_alloc(nbytes);
    return DataPtr(p, nbytes, kCPU, &HostOffloadAllocator::release, this);
  }
  AllocatorStats stats() const override { return counters_.snapshot(); }
  void reset_peak() override { counters_.reset_peak(); }
  Device device() const override { return kCPU; }

 private:
  static void release(void* ctx, void* ptr, size_t nbytes) {
    std::free(ptr);
    static_cast<HostOffloadAllocator*>(ctx)->counters_.on_free(nbytes);
  }
  StatCounters counters_;
};

// The CPU build: both copies are memcpy, complete on return.
class CpuHostTransfer final : public HostTransfer {
 public:
  TransferTicket to_host(const std::shared_ptr<Storage>& src) override {
    auto dst = std::make_shared<Storage>(host_offload_allocator().allocate(src->nbytes()));
    if (src->nbytes()) std::memcpy(dst->ptr(), src->ptr(), src->nbytes());
    return {std::move(dst), nullptr};
  }
  TransferTicket to_device(const TransferTicket& host, Device device) override {
    BLU_CHECK(device.is_cpu(), "host_transfer: the CPU transfer cannot copy to ", device);
    auto dst = std::make_shared<Storage>(allocator_for(device).allocate(host.storage->nbytes()));
    if (host.storage->nbytes()) std::memcpy(dst->ptr(), host.storage->ptr(), host.storage->nbytes());
    return {std::move(dst), nullptr};
  }
  void wait(const TransferTicket&) override {}
  Allocator& host_allocator() override { return host_offload_allocator(); }
};

}  // namespace

#ifdef BLU_HAVE_CUDA
namespace cuda {
HostTransfer& cuda_host_transfer();  // memory/cuda_host_transfer.cpp
}
#endif

Allocator& host_offload_allocator() {
  static HostOffloadAllocator a;
  return a;
}

HostTransfer& host_transfer(Device device) {
  if (device.is_cpu()) {
    static CpuHostTransfer t;
    return t;
  }
#ifdef BLU_HAVE_CUDA
  if (device.is_cuda()) return cuda::cuda_host_transfer();
#endif
  BLU_CHECK(false, "host_transfer: no activation transfer for device ", device, " in this build");
}

}  // namespace blu
