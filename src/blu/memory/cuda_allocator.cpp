#include "blu/memory/cuda_allocator.h"

#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "blu/core/cuda/runtime.h"

namespace blu::cuda {

namespace {

constexpr int kMaxDevices = 64;

class CudaMallocSource final : public DeviceMemorySource {
 public:
  explicit CudaMallocSource(int device) : device_(device) {}
  void* raw_alloc(size_t bytes) override {
    DeviceGuard g(device_);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky, but clear it so the next check does not see it
      return nullptr;
    }
    BLU_CUDA_CHECK(e);
    return p;
  }
  void raw_free(void* ptr) override {
    DeviceGuard g(device_);
    BLU_CUDA_CHECK(cudaFree(ptr));
  }

 private:
  int device_;
};

class HostAllocSource final : public DeviceMemorySource {
 public:
  void* raw_alloc(size_t bytes) override {
    void* p = nullptr;
    // Portable: pinned for every device's context, so any GPU can DMA from it.
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    BLU_CUDA_CHECK(e);
    return p;
  }
  void raw_free(void* ptr) override { BLU_CUDA_CHECK(cudaFreeHost(ptr)); }
};

// cudaEvents, pooled per device (creating one is cheap but not free). An event is recorded on the
// stream's own device.
class CudaEvents final : public EventSource {
 public:
  struct Handle {
    cudaEvent_t event = nullptr;
    int device = 0;
  };
  Event record(StreamId stream) override {
    const auto s = reinterpret_cast<cudaStream_t>(stream);
    int device = 0;
    BLU_CUDA_CHECK(cudaStreamGetDevice(s, &device));
    Handle* h = take(device);
    DeviceGuard g(device);
    BLU_CUDA_CHECK(cudaEventRecord(h->event, s));
    return h;
  }
  bool query(Event e) override {
    const cudaError_t r = cudaEventQuery(static_cast<Handle*>(e)->event);
    if (r == cudaErrorNotReady) return false;
    BLU_CUDA_CHECK(r);
    return true;
  }
  void wait(Event e) override { BLU_CUDA_CHECK(cudaEventSynchronize(static_cast<Handle*>(e)->event)); }
  void release(Event e) override {
    std::lock_guard lock(mu_);
    auto* h = static_cast<Handle*>(e);
    pool_[h->device].push_back(h);
  }

 private:
  Handle* take(int device) {
    {
      std::lock_guard lock(mu_);
      auto& v = pool_[device];
      if (!v.empty()) {
        Handle* h = v.back();
        v.pop_back();
        return h;
      }
    }
    auto* h = new Handle;
    h->device = device;
    DeviceGuard g(device);
    BLU_CUDA_CHECK(cudaEventCreateWithFlags(&h->event, cudaEventDisableTiming));
    return h;
  }
  std::mutex mu_;
  std::unordered_map<int, std::vector<Handle*>> pool_;
};

// Lives for the process, like everything here: destroying CUDA objects at exit races the driver.
CudaEvents& events() {
  static auto* e = new CudaEvents;
  return *e;
}

class CudaDeviceAllocator final : public Allocator {
 public:
  explicit CudaDeviceAllocator(int device)
      : device_(device), source_(device), caching_(source_, events(), config_for(device)) {}
  DataPtr allocate(size_t nbytes) override {
    DeviceGuard g(device_);
    const auto stream = reinterpret_cast<StreamId>(current_stream());
    void* p = caching_.malloc(nbytes, stream);
    return DataPtr(p, nbytes, Device(DeviceType::cuda, device_), &CudaDeviceAllocator::release, this);
  }
  AllocatorStats stats() const override {
    const CachingAllocatorStats s = caching_.stats();
    AllocatorStats a;
    a.current_bytes = s.requested_bytes;
    a.peak_bytes = s.requested_peak;
    a.allocs = s.allocs;
    a.frees = s.frees;
    a.reserved_bytes = s.reserved_bytes;
  a.peak_reserved_bytes = s.reserved_peak;
    return a;
  }
  void reset_peak() override { caching_.reset_peak(); }
  Device device() const override { return Device(DeviceType::cuda, device_); }
  void tag(void* ptr, MemoryTag tag) override { caching_.tag(ptr, std::move(tag)); }
  void release_cached() override {
    DeviceGuard g(device_);
    // cudaFree is not allowed while the stream records a CUDA graph: the cache stays then.
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(current_stream(), &capturing) == cudaSuccess && capturing != cudaStreamCaptureStatusNone)
      return;
    caching_.empty_cache();
  }
  CachingAllocator& caching() { return caching_; }

 private:
  static CachingAllocatorConfig config_for(int device) {
    CachingAllocatorConfig c;
    c.name = "cuda:" + std::to_string(device);
    return c;
  }
  static void release(void* ctx, void* ptr, size_t) { static_cast<CudaDeviceAllocator*>(ctx)->caching_.free(ptr); }

  int device_;
  CudaMallocSource source_;
  CachingAllocator caching_;
};

std::array<std::atomic<CudaDeviceAllocator*>, kMaxDevices> g_devices{};
std::mutex g_devices_mu;

CudaDeviceAllocator& device_allocator(int index) {
  BLU_CHECK(index >= 0 && index < kMaxDevices, "cuda:", index, " is not a valid device index");
  if (CudaDeviceAllocator* a = g_devices[index].load(std::memory_order_acquire)) return *a;
  std::lock_guard lock(g_devices_mu);
  if (CudaDeviceAllocator* a = g_devices[index].load(std::memory_order_acquire)) return *a;
  const int n = device_count();
  BLU_CHECK(index < n, "cuda:", index, " does not exist (", n, " CUDA devices)");
  auto* a = new CudaDeviceAllocator(index);
  g_devices[index].store(a, std::memory_order_release);
  return *a;
}

Allocator* get_device_allocator(int index) { return &device_allocator(index); }

// No CUDA call here: registration only stores a function pointer.
const bool g_registered = [] {
  register_allocator(DeviceType::cuda, &get_device_allocator);
  return true;
}();

// Pinned blocks are not bound to a stream (the host uses them): all share one pseudo-stream that
// no real stream can equal, so every GPU use must be recorded with record_stream.
constexpr StreamId kPinnedStream = ~StreamId(0);

struct PinnedState {
  HostAllocSource source;
  CachingAllocator caching{source, events(), [] {
                             CachingAllocatorConfig c;
                             c.name = "pinned";
                             return c;
                           }()};
};
PinnedState& pinned_state() {
  static auto* s = new PinnedState;
  return *s;
}

int resolve(int device) { return device < 0 ? current_device() : device; }

}  // namespace

CachingAllocatorStats memory_stats(int device) { return device_allocator(resolve(device)).caching().stats(); }
void reset_peak_memory_stats(int device) { device_allocator(resolve(device)).caching().reset_peak(); }

void empty_cache() {
  for (auto& slot : g_devices)
    if (CudaDeviceAllocator* a = slot.load(std::memory_order_acquire)) a->caching().empty_cache();
  pinned_state().caching.empty_cache();
}

std::string memory_snapshot() {
  nlohmann::json j = nlohmann::json::object();
  for (int d = 0; d < kMaxDevices; ++d)
    if (CudaDeviceAllocator* a = g_devices[d].load(std::memory_order_acquire))
      j["cuda:" + std::to_string(d)] = nlohmann::json::parse(snapshot_json(a->caching().snapshot()));
  j["pinned"] = nlohmann::json::parse(snapshot_json(pinned_state().caching.snapshot()));
  return j.dump();
}

void record_stream(const Tensor& t, cudaStream_t stream) {
  BLU_CHECK(t.device().is_cuda(), "record_stream: expected a CUDA tensor, got ", t.str());
  device_allocator(t.device().index).caching().record_stream(t.storage()->ptr(), reinterpret_cast<StreamId>(stream));
}

PinnedAllocator::PinnedAllocator() = default;

DataPtr PinnedAllocator::allocate(size_t nbytes) {
  void* p = pinned_state().caching.malloc(nbytes, kPinnedStream);
  return DataPtr(p, nbytes, kCPU, &PinnedAllocator::release, this);
}
void PinnedAllocator::release(void*, void* ptr, size_t) { pinned_state().caching.free(ptr); }

AllocatorStats PinnedAllocator::stats() const {
  const CachingAllocatorStats s = pinned_state().caching.stats();
  AllocatorStats a;
  a.current_bytes = s.requested_bytes;
  a.peak_bytes = s.requested_peak;
  a.allocs = s.allocs;
  a.frees = s.frees;
  a.reserved_bytes = s.reserved_bytes;
  a.peak_reserved_bytes = s.reserved_peak;
  return a;
}
void PinnedAllocator::reset_peak() { pinned_state().caching.reset_peak(); }
void PinnedAllocator::record_stream(void* ptr, cudaStream_t stream) {
  pinned_state().caching.record_stream(ptr, reinterpret_cast<StreamId>(stream));
}
CachingAllocator& PinnedAllocator::caching() { return pinned_state().caching; }

PinnedAllocator& pinned_allocator() {
  static auto* a = new PinnedAllocator;
  return *a;
}
CachingAllocatorStats pinned_memory_stats() { return pinned_state().caching.stats(); }

}  // namespace blu::cuda
