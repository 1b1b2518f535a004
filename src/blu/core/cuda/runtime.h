// core/cuda/runtime: the CUDA runtime as every layer uses it, below the backend — error checking
// after every call, the current device (and a guard that sets it for a scope), RAII move-only
// streams and events, and the current stream (per thread, per device). The caching allocator
// (memory/cuda_allocator) builds on this; backend/cuda/runtime.h adds the kernels' part
// (cuBLASLt, launch geometry) on top. As PyTorch's c10/cuda holds CUDAStream and CUDAGuard below
// ATen's kernels.
// Depends on core/error and the CUDA runtime (not cuBLAS). CUDA builds only. Keep: every CUDA call
// is wrapped in BLU_CUDA_CHECK; every kernel launch is followed by BLU_CUDA_CHECK_LAUNCH(); work
// is queued on current_stream(), never on the legacy default stream.
#pragma once
#include <cuda_runtime.h>

#include "blu/core/error.h"

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

// The stream kernels launch on, for the current device on this thread. Defaults to one
// per-device stream created on first use.
cudaStream_t current_stream();
void set_current_stream(cudaStream_t s);
// RAII: makes `s` current for a scope.
class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s) : prev_(current_stream()) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(prev_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t prev_;
};

}  // namespace blu::cuda
