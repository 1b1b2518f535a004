// offload/transfer: the copy engine (header); the CPU engine here, the CUDA one in transfer_cuda.cu.
#include "blu/offload/transfer.h"

#include <cstring>

#ifdef BLU_HAVE_CUDA
#include "blu/memory/cuda_allocator.h"
#endif

namespace blu::offload {

namespace {

void check_pair(const Tensor& dst, const Tensor& src) {
  BLU_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), "offload copy: destination ", dst.str(),
            " and source ", src.str(), " differ in dtype or size");
  BLU_CHECK(dst.is_contiguous() && src.is_contiguous(), "offload copy: expected contiguous tensors, got ", dst.str(),
            " and ", src.str());
}

// cpu:0 ↔ cpu:N: a memcpy at once; every event is complete when made.
class HostPoolEngine final : public CopyEngine {
 public:
  explicit HostPoolEngine(Device device) : device_(device) {}
  Device device() const override { return device_; }
  void copy(const Tensor& dst, const Tensor& src, Lane) override {
    check_pair(dst, src);
    BLU_CHECK((dst.device() == kCPU) != (src.device() == kCPU), "offload copy: expected one host and one device tensor, got ",
              dst.device(), " and ", src.device());
    std::memcpy(dst.raw_data(), src.raw_data(), dst.nbytes());
    dst.storage()->bump_version();
  }
  EventPtr record(Lane) override { return nullptr; }
  void wait(Lane, const EventPtr&) override {}
  void host_wait(const EventPtr&) override {}

 private:
  Device device_;
};

}  // namespace

std::unique_ptr<CopyEngine> make_copy_engine(Device device) {
#ifdef BLU_HAVE_CUDA
  if (device.is_cuda()) return make_cuda_copy_engine(device);
#endif
  BLU_CHECK(device.is_cpu() && device.index >= 1, "offload: the device must be a GPU or a device pool cpu:N (N >= 1), got ",
            device);
  return std::make_unique<HostPoolEngine>(device);
}

void stream_through_slots(CopyEngine& engine, size_t chunks, EventPtr& pending_out,
                          const std::function<void(size_t, int)>& load, const std::function<void(size_t, int)>& update,
                          const std::function<void(size_t, int)>& store) {
  engine.wait(Lane::in, pending_out);
  EventPtr slot_free[2];
  for (size_t c = 0; c < chunks; ++c) {
    const int b = int(c % 2);
    engine.wait(Lane::in, slot_free[b]);
    load(c, b);
    engine.wait(Lane::compute, engine.record(Lane::in));
    update(c, b);
    engine.wait(Lane::out, engine.record(Lane::compute));
    store(c, b);
    slot_free[b] = engine.record(Lane::out);
  }
  pending_out = engine.record(Lane::out);
}

Allocator& host_allocator_for(Device device) {
#ifdef BLU_HAVE_CUDA
  if (device.is_cuda()) return cuda::pinned_allocator();
#endif
  return cpu_allocator();
}

Tensor empty_from(Allocator& alloc, const Shape& shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  auto storage = std::make_shared<Storage>(alloc.allocate(size_t(n) * dtype_size(dtype)));
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

}  // namespace blu::offload
