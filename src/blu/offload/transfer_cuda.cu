// offload/transfer_cuda: the copy engine on a GPU (offload/transfer.h) — the compute lane is the
// current stream, the in and out lanes two side streams of this engine; copies are
// cudaMemcpyAsync between pinned host memory and the device, events are cudaEvents. Device memory
// a side lane touches is recorded with that stream (cuda::record_stream) and pinned memory with
// the pinned allocator, so neither is reused before the copy has run.
// Depends on offload/transfer, memory/cuda_allocator, core/cuda/runtime. CUDA builds only.
// Keep: no host synchronisation except host_wait.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "blu/core/cuda/runtime.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/offload/transfer.h"

namespace blu::offload {

namespace {

// The side streams of a device, created once and kept for the life of the process: the caching
// allocators bind blocks to them (record_stream) and record an event on them when such a block is
// freed, which can be after the engine that copied it is gone.
cudaStream_t side_stream(int device, int lane) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[{device, lane}];
  if (!s) {
    cuda::DeviceGuard g(device);
    BLU_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}

class CudaCopyEvent final : public CopyEvent {
 public:
  cuda::Event event;
};

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(Device device)
      : device_(device), in_(side_stream(device.index, 0)), out_(side_stream(device.index, 1)) {}
  Device device() const override { return device_; }

  void copy(const Tensor& dst, const Tensor& src, Lane lane) override {
    BLU_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(),
              "offload copy: expected contiguous tensors of one dtype and size, got ", dst.str(), " and ", src.str());
    const bool to_device = dst.device().is_cuda();
    BLU_CHECK(to_device != src.device().is_cuda(), "offload copy: expected one host and one device tensor, got ",
              dst.device(), " and ", src.device());
    cuda::DeviceGuard g(device_.index);
    cudaStream_t s = stream(lane);
    BLU_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(), cudaMemcpyDefault, s));
    const Tensor& dev = to_device ? dst : src;
    const Tensor& host = to_device ? src : dst;
    if (s != cuda::current_stream()) cuda::record_stream(dev, s);
    cuda::pinned_allocator().record_stream(host.storage()->ptr(), s);
    dst.storage()->bump_version();
  }
  EventPtr record(Lane lane) override {
    cuda::DeviceGuard g(device_.index);  // the event on the stream's device, from any thread
    auto e = std::make_shared<CudaCopyEvent>();
    e->event.record(stream(lane));
    return e;
  }
  void wait(Lane waiter, const EventPtr& e) override {
    if (!e) return;
    BLU_CUDA_CHECK(cudaStreamWaitEvent(stream(waiter), static_cast<CudaCopyEvent*>(e.get())->event.get(), 0));
  }
  void host_wait(const EventPtr& e) override {
    if (e) {
      static_cast<CudaCopyEvent*>(e.get())->event.synchronize();
      return;
    }
    BLU_CUDA_CHECK(cudaStreamSynchronize(in_));
    BLU_CUDA_CHECK(cudaStreamSynchronize(out_));
  }

 private:
  cudaStream_t stream(Lane lane) const {
    return lane == Lane::in ? in_ : lane == Lane::out ? out_ : cuda::current_stream();
  }
  Device device_;
  cudaStream_t in_, out_;  // side_stream(): never destroyed
};

}  // namespace

std::unique_ptr<CopyEngine> make_cuda_copy_engine(Device device) { return std::make_unique<CudaCopyEngine>(device); }

}  // namespace blu::offload
