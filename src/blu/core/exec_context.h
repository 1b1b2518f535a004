// core/exec_context: where a kernel runs — the execution context (device, stream, scratch
// workspace) that ops/dispatch reads once per call and hands to the kernel in KernelCall::ctx
// (Note [Execution context]), and the Workspace, the caller-owned scratch arena kernels take
// their temporary buffers from.
// Depends on core/device, core/storage, core/error; not on CUDA (a stream is an opaque pointer
// here; backends cast it) and not on memory/ (a Workspace grows through the function memory/
// installs with set_workspace_allocate). Keep: kernels never pick their own stream or allocate
// their own scratch; one current context per (thread, device); reading it is a thread-local
// read, nothing more.
#pragma once
#include <cstddef>
#include <vector>

#include "blu/core/device.h"
#include "blu/core/storage.h"

namespace blu {

// Note [Execution context]
// Every dispatch call runs its kernel in an execution context: the device, the stream its work is
// queued on (opaque; null means the device's default stream, and is what the CPU has) and the
// Workspace its scratch comes from. Each thread has one current context per device; a thread that
// never set one gets {device, null stream, the thread's own default workspace for the device}.
// ExecContextGuard sets a context for a scope; cuda::StreamGuard and cuda::set_current_stream
// (core/cuda/runtime.h) change the same context's stream, and the CUDA caching allocator binds
// its blocks to that stream, so tensors, scratch and kernels of a scope share one stream.
// ops/dispatch reads the context of the kernel's device once per call, resets its workspace (a
// call's slices start at the arena's beginning) and passes it in KernelCall::ctx; launchers take
// their stream and scratch from there and pass them on to the helpers they call. This is what
// CUDA-graph capture needs: under a context whose stream is being captured, with its workspace
// pre-sized and frozen, nothing launches on another stream and no scratch is allocated.
// A workspace serves one stream at a time: the next call's slices reuse the same bytes, ordered
// after the previous call's kernels only by the stream. A context for a second stream that runs
// concurrently with the first needs its own Workspace.

// A caller-owned scratch arena on one device. A kernel call takes aligned slices with take();
// reset() (ops/dispatch, before each kernel) makes the next call's slices start at the beginning.
// While not frozen, a take() beyond the arena grows it through the device allocator (the slices
// already taken in this call stay valid: the old block is kept until the next reset()). Frozen — as
// under CUDA-graph capture, where an allocation would be recorded into the graph — a take()
// beyond the arena is a BLU_CHECK error naming the bytes asked and held. high_water() is the most
// bytes one call has used: reserve() that much and freeze() before a capture.
class Workspace {
 public:
  static constexpr size_t kAlignment = 256;  // every slice starts on this boundary (cuBLASLt's need)
  explicit Workspace(Device device, size_t bytes = 0);
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // A slice of `bytes` (rounded up to kAlignment), valid until the next reset().
  void* take(size_t bytes);
  template <typename T>
  T* take(size_t count) {
    return static_cast<T*>(take(count * sizeof(T)));
  }
  // The next take() starts at the beginning again; blocks outgrown in the last call are released.
  void reset() {
    used_ = 0;
    if (!retired_.empty()) [[unlikely]] retired_.clear();
  }
  // Grows the arena to at least `bytes` (BLU_CHECK when frozen and it would have to grow).
  void reserve(size_t bytes);
  void freeze() { frozen_ = true; }
  void unfreeze() { frozen_ = false; }
  bool frozen() const { return frozen_; }

  Device device() const { return device_; }
  size_t capacity() const { return capacity_; }
  // Bytes of the device block it holds (the capacity and one alignment unit; 0 before it grew).
  size_t block_bytes() const { return block_.get() ? capacity_ + kAlignment : 0; }
  size_t used() const { return used_; }          // bytes taken since the last reset()
  size_t high_water() const { return high_; }    // the most bytes taken between two resets
  void reset_high_water() { high_ = used_; }

 private:
  void grow(size_t bytes);
  Device device_;
  DataPtr block_;
  char* base_ = nullptr;  // block_'s first kAlignment-aligned byte; slices are offsets from it
  std::vector<DataPtr> retired_;  // outgrown in this call; slices in them live until reset()
  size_t capacity_ = 0, used_ = 0, high_ = 0;
  bool frozen_ = false;
};

// memory/ installs how a Workspace gets device bytes (allocator_for(device).allocate).
using WorkspaceAllocate = DataPtr (*)(Device device, size_t nbytes);
void set_workspace_allocate(WorkspaceAllocate fn);

struct ExecContext {
  Device device;
  void* stream = nullptr;         // the backend's stream (cudaStream_t); null: the default / CPU
  Workspace* scratch = nullptr;   // never null in a context read through current_context()
};

// This thread's current context for `device`.
const ExecContext& current_context(Device device);
// Makes `ctx` current for ctx.device on this thread; a null scratch keeps the current one.
void set_current_context(ExecContext ctx);

// RAII: makes `ctx` current for ctx.device for a scope (a null scratch keeps the current
// workspace), and restores the previous context after it.
class ExecContextGuard {
 public:
  explicit ExecContextGuard(ExecContext ctx) : prev_(current_context(ctx.device)) { set_current_context(ctx); }
  ~ExecContextGuard() { set_current_context(prev_); }
  ExecContextGuard(const ExecContextGuard&) = delete;
  ExecContextGuard& operator=(const ExecContextGuard&) = delete;

 private:
  ExecContext prev_;
};

}  // namespace blu
