// backend/cuda/runtime: the CUDA runtime as BluTrain uses it — error checking after every call
// and launch, RAII move-only streams and events, the current device and stream (per thread), and
// the per-device cuBLASLt handle with its workspace.
// Depends on core/error and the CUDA runtime. Keep: every CUDA call is wrapped in
// BLU_CUDA_CHECK; every kernel launch is followed by BLU_CUDA_CHECK_LAUNCH(); kernels launch on
// current_stream(), never on the legacy default stream.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "blu/core/error.h"

namespace blu::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line);

}  // namespace blu::cuda

#define BLU_CUDA_CHECK(expr)                                                                        \
  do {                                                                                              \
    const cudaError_t blu_err_ = (expr);                                                            \
    if (blu_err_ != cudaSuccess) [[unlikely]] ::blu::cuda::throw_cuda_error(blu_err_, #expr, __FILE__, __LINE__); \
  } while (0)
#define BLU_CUDA_CHECK_LAUNCH() BLU_CUDA_CHECK(cudaGetLastError())
#define BLU_CUBLAS_CHECK(expr)                                                                      \
  do {                                                                                              \
    const cublasStatus_t blu_st_ = (expr);                                                          \
    if (blu_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                              \
      ::blu::cuda::throw_cublas_error(blu_st_, #expr, __FILE__, __LINE__);                          \
  } while (0)

namespace blu::cuda {

int device_count();  // 0 when no driver/device (never throws)
int current_device();
void set_device(int index);

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

// Per-device cuBLASLt handle and a 32 MiB workspace (allocated once).
cublasLtHandle_t cublaslt_handle();
void* cublaslt_workspace(size_t* bytes);

// Launch geometry helper: blocks of `threads` covering n elements, capped for grid-stride loops.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

}  // namespace blu::cuda
