// core/host_reads: a count of the host's reads of tensor values — the reads a training step must
// not make except once on a logged step (a read of a device tensor waits for the device).
// Counted, one each: every Tensor::item(); every to_vector() (ops/factory.h), whatever the
// tensor's device (a device tensor's read is counted once, as its copy to the CPU); every
// to_device() of a non-CPU tensor to the CPU (ops/view.h). So to_device(t, kCPU).item() of a
// device tensor counts two. Kernels reading their inputs, and a CPU tensor's raw data<T>(), are
// not counted.
// Depends on nothing. Keep: the count is process-wide (every thread's reads, one atomic counter),
// never reset; measure a stretch of code as a difference of two host_reads() calls.
#pragma once
#include <cstdint>

namespace blu {

// Host reads of tensor values so far, by every thread of the process.
uint64_t host_reads();
// Adds one: called by the functions listed above, where the value crosses to the host.
void count_host_read();

}  // namespace blu
