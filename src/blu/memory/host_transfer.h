// memory/host_transfer: whole storages moved between a device and host memory, queued so that the
// copies overlap compute — what activation offload (models/activation_offload.h) is built on.
//   to_host(src): a host storage that will hold src's bytes. On CUDA the copy runs on a side
//     stream after the work already queued on the current stream (an event orders it), into
//     pinned memory; src stays allocated until that copy has read it (record_stream). On the CPU
//     it is a memcpy into host_offload_allocator(), so the "device" pool (cpu_allocator()) and the
//     host pool count apart, as the two memories of a GPU machine do.
//   to_device(ticket, device): a new storage on `device` that will hold the host bytes, copied on
//     the same side stream (after the host copy it comes from), allocated from the device's
//     allocator for the current stream.
//   wait(ticket): the current stream waits for that copy (a stream wait, not a host wait).
// Depends on core/storage, core/device, memory/allocator. Keep: no host synchronisation in
// to_host / to_device / wait; a ticket's storage is not read by the current stream before wait().
#pragma once
#include <cstddef>
#include <memory>

#include "blu/core/device.h"
#include "blu/core/storage.h"
#include "blu/memory/allocator.h"

namespace blu {

struct TransferTicket {
  std::shared_ptr<Storage> storage;  // the destination
  std::shared_ptr<void> done;        // backend state marking the copy's completion (CUDA: an event)
};

class HostTransfer {
 public:
  virtual ~HostTransfer() = default;
  virtual TransferTicket to_host(const std::shared_ptr<Storage>& src) = 0;
  virtual TransferTicket to_device(const TransferTicket& host, Device device) = 0;
  virtual void wait(const TransferTicket& t) = 0;
  // Where to_host's storages come from (CPU: host_offload_allocator(); CUDA: the pinned allocator).
  virtual Allocator& host_allocator() = 0;
};

// The transfer for tensors on `device` (BLU_CHECK: a device type this build has).
HostTransfer& host_transfer(Device device);

// The CPU build's "host" memory for offloaded activations (the pinned allocator plays this part on
// a GPU machine). Its statistics are what tests read for bytes offloaded.
Allocator& host_offload_allocator();

}  // namespace blu
