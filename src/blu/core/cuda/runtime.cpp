#include "blu/core/cuda/runtime.h"

#include <mutex>

namespace blu::cuda {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  throw Error(detail::concat("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", expr,
                             " at ", file, ":", line));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

int current_device() {
  int d = 0;
  BLU_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int index) {
  const int n = device_count();
  BLU_CHECK(index >= 0 && index < n, "cuda:", index, " does not exist (", n, " CUDA devices)");
  BLU_CUDA_CHECK(cudaSetDevice(index));
}

int highest_stream_priority() {
  int least = 0, greatest = 0;
  BLU_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

Stream::Stream() { BLU_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
Stream::Stream(int priority) { BLU_CUDA_CHECK(cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, priority)); }
Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (s_) cudaStreamDestroy(s_);
    s_ = o.s_;
    o.s_ = nullptr;
  }
  return *this;
}
Stream::~Stream() {
  if (s_) cudaStreamDestroy(s_);
}
void Stream::synchronize() const { BLU_CUDA_CHECK(cudaStreamSynchronize(s_)); }

Event::Event(bool timing) {
  BLU_CUDA_CHECK(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
}
Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (e_) cudaEventDestroy(e_);
    e_ = o.e_;
    o.e_ = nullptr;
  }
  return *this;
}
Event::~Event() {
  if (e_) cudaEventDestroy(e_);
}
void Event::record(cudaStream_t s) { BLU_CUDA_CHECK(cudaEventRecord(e_, s)); }
bool Event::query() const {
  const cudaError_t r = cudaEventQuery(e_);
  if (r == cudaErrorNotReady) return false;
  BLU_CUDA_CHECK(r);
  return true;
}
void Event::synchronize() const { BLU_CUDA_CHECK(cudaEventSynchronize(e_)); }
float Event::elapsed_ms(const Event& since) const {
  float ms = 0;
  BLU_CUDA_CHECK(cudaEventElapsedTime(&ms, since.e_, e_));
  return ms;
}

namespace {
constexpr int kMaxDevices = 64;
struct DefaultStream {
  std::once_flag once;
  cudaStream_t stream = nullptr;
};
cudaStream_t default_stream(int d) {
  static DefaultStream devices[kMaxDevices];
  BLU_ASSERT(d >= 0 && d < kMaxDevices, "device index ", d);
  DefaultStream& p = devices[d];
  // Lives for the process: freeing CUDA objects during static destruction races the driver.
  std::call_once(p.once, [&] { BLU_CUDA_CHECK(cudaStreamCreateWithFlags(&p.stream, cudaStreamNonBlocking)); });
  return p.stream;
}
thread_local cudaStream_t t_stream[kMaxDevices] = {};
}  // namespace

cudaStream_t current_stream() {
  const int d = current_device();
  return t_stream[d] ? t_stream[d] : default_stream(d);
}
void set_current_stream(cudaStream_t s) { t_stream[current_device()] = s; }

}  // namespace blu::cuda
