// offload/transfer: the copy engine between host memory and one device, on lanes — the compute
// lane (the current stream, where ops run), an in lane (host → device) and an out lane (device →
// host) — ordered by events, so that a copy overlaps the compute it does not depend on and nothing
// waits on the host unless asked to (host_wait). On CUDA the lanes are the current stream and two
// side streams, the events cudaEvents, and host memory pinned (cuda::pinned_allocator); on a CPU
// build the device is a pool cpu:N (memory/device_pool.h), a copy is a memcpy done at once and the
// events are already complete — the same calls in the same order, so the chunking and ordering
// logic built on them runs in CI.
// Depends on core/, memory/ (allocators, pinned memory on CUDA). Keep: a copy is between two
// contiguous tensors of one dtype and numel, one in host memory and one on the device; the
// destination's storage version is bumped (Note [Storage versions]) and device memory used on a
// side lane is recorded with it (so the caching allocator does not reuse it too early).
#pragma once
#include <functional>
#include <memory>

#include "blu/core/tensor.h"
#include "blu/memory/allocator.h"

namespace blu::offload {

enum class Lane : uint8_t { compute, in, out };

// A point in one lane's work.
class CopyEvent {
 public:
  virtual ~CopyEvent() = default;
};
using EventPtr = std::shared_ptr<CopyEvent>;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual Device device() const = 0;
  // dst ← src queued on `lane` (in: host → device, out: device → host).
  virtual void copy(const Tensor& dst, const Tensor& src, Lane lane) = 0;
  // An event after everything queued on `lane` so far.
  virtual EventPtr record(Lane lane) = 0;
  // Work queued on `waiter` from now on starts after `e` (no host wait). Null e: nothing to wait for.
  virtual void wait(Lane waiter, const EventPtr& e) = 0;
  // The host blocks until `e` (null: every lane) is reached.
  virtual void host_wait(const EventPtr& e) = 0;
};

// Host-resident state streamed through two device slots, chunk by chunk: chunk c uses slot
// b = c % 2; `load(c, b)` queues its uploads on Lane::in once the slot's previous chunk has gone
// out, `update(c, b)` queues its work on Lane::compute once they have landed, and `store(c, b)`
// queues its downloads on Lane::out once that work is done. `pending_out` orders calls: this
// call's first uploads wait for it (the last call's downloads wrote the host state they read),
// and it is set to this call's last download.
void stream_through_slots(CopyEngine& engine, size_t chunks, EventPtr& pending_out,
                          const std::function<void(size_t c, int b)>& load,
                          const std::function<void(size_t c, int b)>& update,
                          const std::function<void(size_t c, int b)>& store);

// The engine for `device` (cuda:N, or a pool cpu:N with N >= 1).
std::unique_ptr<CopyEngine> make_copy_engine(Device device);
// Where host-side state for `device` lives: pinned memory for a CUDA device, host memory otherwise.
Allocator& host_allocator_for(Device device);
// An uninitialised contiguous tensor from `alloc`.
Tensor empty_from(Allocator& alloc, const Shape& shape, DType dtype);

#ifdef BLU_HAVE_CUDA
std::unique_ptr<CopyEngine> make_cuda_copy_engine(Device device);  // offload/transfer_cuda.cu
#endif

}  // namespace blu::offload
