// The CUDA HostTransfer (memory/host_transfer.h): device ↔ pinned host copies on one side stream
// per device, each ordered after the current stream's work by an event and marked done by another.
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <mutex>

#include "blu/core/cuda/runtime.h"
#include "blu/core/tensor.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/memory/host_transfer.h"

namespace blu::cuda {

namespace {

constexpr int kMaxDevices = 16;

class CudaHostTransfer final : public HostTransfer {
 public:
  TransferTicket to_host(const std::shared_ptr<Storage>& src) override {
    const int dev = src->device().index;
    DeviceGuard guard(dev);
    cudaStream_t side = side_stream(dev), compute = current_stream();
    Event produced;
    produced.record(compute);  // src's bytes are final after the work queued so far
    BLU_CUDA_CHECK(cudaStreamWaitEvent(side, produced.get(), 0));
    auto dst = std::make_shared<Storage>(pinned_allocator().allocate(src->nbytes()));
    if (src->nbytes()) BLU_CUDA_CHECK(cudaMemcpyAsync(dst->ptr(), src->ptr(), src->nbytes(), cudaMemcpyDeviceToHost, side));
    // src may be freed by the caller right away: its block waits for the side stream's copy.
    record_stream(Tensor(src, {int64_t(src->nbytes())}, {1}, 0, DType::u8), side);
    pinned_allocator().record_stream(dst->ptr(), side);
    auto done = std::make_shared<Event>();
    done->record(side);
    return {std::move(dst), std::static_pointer_cast<void>(done)};
  }

  TransferTicket to_device(const TransferTicket& host, Device device) override {
    BLU_CHECK(device.is_cuda(), "host_transfer: the CUDA transfer copies to a CUDA device, not ", device);
    DeviceGuard guard(device.index);
    cudaStream_t side = side_stream(device.index), compute = current_stream();
    // Allocated for the current stream (which reads it after wait()); written on the side stream,
    // which already follows the host copy it reads (same stream, in order). The block may have
    // been freed by work the current stream has queued and not yet run (the caching allocator
    // hands it back to the same stream at once): the side stream writes it only after that work.
    auto dst = std::make_shared<Storage>(allocator_for(device).allocate(host.storage->nbytes()));
    Event queued;
    queued.record(compute);
    BLU_CUDA_CHECK(cudaStreamWaitEvent(side, queued.get(), 0));
    if (host.storage->nbytes())
      BLU_CUDA_CHECK(cudaMemcpyAsync(dst->ptr(), host.storage->ptr(), host.storage->nbytes(), cudaMemcpyHostToDevice, side));
    record_stream(Tensor(dst, {int64_t(dst->nbytes())}, {1}, 0, DType::u8), side);
    pinned_allocator().record_stream(host.storage->ptr(), side);
    auto done = std::make_shared<Event>();
    done->record(side);
    return {std::move(dst), std::static_pointer_cast<void>(done)};
  }

  void wait(const TransferTicket& t) override {
    if (!t.done) return;
    BLU_CUDA_CHECK(cudaStreamWaitEvent(current_stream(), static_cast<Event*>(t.done.get())->get(), 0));
  }
  Allocator& host_allocator() override { return pinned_allocator(); }

 private:
  cudaStream_t side_stream(int dev) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& s = streams_.at(size_t(dev));
    if (!s) s = std::make_unique<Stream>();
    return s->get();
  }
  std::mutex mu_;
  std::array<std::unique_ptr<Stream>, kMaxDevices> streams_;
};

}  // namespace

HostTransfer& cuda_host_transfer() {
  static CudaHostTransfer t;
  return t;
}

}  // namespace blu::cuda
