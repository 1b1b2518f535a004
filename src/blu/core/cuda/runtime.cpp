#include "blu/core/cuda/runtime.h"

#include <atomic>
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

std::string device_name(int index) {
  cudaDeviceProp prop{};
  BLU_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
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
  std::atomic<cudaStream_t> stream{nullptr};
};
DefaultStream g_default[kMaxDevices];
}  // namespace

cudaStream_t default_stream(int d) {
  BLU_ASSERT(d >= 0 && d < kMaxDevices, "device index ", d);
  DefaultStream& p = g_default[d];
  if (cudaStream_t s = p.stream.load(std::memory_order_acquire)) [[likely]] return s;
  // Lives for the process: freeing CUDA objects during static destruction races the driver.
  std::call_once(p.once, [&] {
    DeviceGuard g(d);
    cudaStream_t s = nullptr;
    BLU_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    p.stream.store(s, std::memory_order_release);
  });
  return p.stream.load(std::memory_order_acquire);
}

cudaStream_t current_stream() { return stream_of(current_context(Device(DeviceType::cuda, current_device()))); }

void set_current_stream(cudaStream_t s) {
  ExecContext ctx = current_context(Device(DeviceType::cuda, current_device()));
  ctx.stream = s;
  set_current_context(ctx);
}

}  // namespace blu::cuda
