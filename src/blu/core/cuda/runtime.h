// core/cuda/runtime: the CUDA runtime as every layer uses it, below the backend — error checking
// after every call, the current device (and a guard that sets it for a scope), RAII move-only
// streams and events, and the current stream: the stream of the current execution context
// (core/exec_context.h, per thread, per device). The caching allocator
// (memory/cuda_allocator) builds on this; backend/cuda/runtime.h adds the kernels' part
// (cuBLASLt, launch geometry) on top. As PyTorch's c10/cuda holds CUDAStream and CUDAGuard below
// ATen's kernels.
// Depends on core/error, core/exec_context and the CUDA runtime (not cuBLAS). CUDA builds only.
// Keep: every CUDA call is wrapped in BLU_CUDA_CHECK; every kernel launch is followed by
// BLU_CUDA_CHECK_LAUNCH(); kernels queue work on their call's context stream (stream_of), code
// outside a kernel on current_stream(), never on the legacy default stream.
#pragma once
#include <string>
#include <cuda_runtime.h>

#include "blu/core/error.h"
#include "blu/core/exec_context.h"

namespace blu::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);

}  // namespace blu::cuda

#define BLU_CUDA_CHECK(expr)                                                                        \
  do {                                                                                              \
    const cudaError_t blu_err_ = (expr);                                                            \
    if (blu_err_ != cudaSuccess) [[unlikely]] ::blu::cuda::throw_cuda_error(blu_err_, #expr, __FILE__, __LINE__); \
  } while (0)
#define BLU_CUDA_CHECK_LAUNCH() BLU_CUDA_CHECK(cudaGetLastError())

namespace blu::cuda {

int device_count();  // 0 when no driver/device (never throws)
std::string device_name(int index);  // e.g. "NVIDIA H100 80GB HBM3"
int current_device();
void set_device(int index);

// RAII: makes `device` current for a scope (a no-op when it already is) and restores the previous
// device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    BLU_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) BLU_CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);  // no throw from a destructor
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// The current device's greatest stream priority (numerically the lowest; 0 is the default).
int highest_stream_priority();

// A stream owned by this object (non-blocking w.r.t. the legacy default stream).
class Stream {
 public:
  Stream();
  explicit Stream(int priority);  // see highest_stream_priority()
  Stream(Stream&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream();
  cudaStream_t get() const { return s_; }
  void synchronize() const;

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  explicit Event(bool timing = false);
  Event(Event&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();
  void record(cudaStream_t s);
  bool query() const;  // true when the recorded work is done
  void synchronize() const;
  float elapsed_ms(const Event& since) const;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

// The device's default stream: one non-blocking stream per device, created on first use (work
// never goes to the legacy default stream). A context with a null stream means this one.
cudaStream_t default_stream(int device);
// The stream of an execution context on a CUDA device (what a kernel launches on).
inline cudaStream_t stream_of(const ExecContext& ctx) {
  return ctx.stream ? static_cast<cudaStream_t>(ctx.stream) : default_stream(ctx.device.index);
}
// The current context's stream for the current device on this thread.
cudaStream_t current_stream();
// Sets the stream of the current device's context on this thread (its workspace stays).
void set_current_stream(cudaStream_t s);
// RAII: makes `s` the current device's context stream for a scope (the workspace stays; see Note
// [Execution context] for when a second stream needs its own).
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s) : guard_(ExecContext{Device(DeviceType::cuda, current_device()), s, nullptr}) {}
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  ExecContextGuard guard_;
};

}  // namespace blu::cuda
