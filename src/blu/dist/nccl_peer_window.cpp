// dist/nccl_peer_window: see nccl_peer_window.h.
#include "blu/dist/nccl_peer_window.h"

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "blu/backend/cuda/peer_add.h"
#include "blu/backend/cuda/runtime.h"

namespace blu::dist {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kArrived = 0, kConsumed = 4;  // byte offsets of the words after the window

struct Driver {
  CUresult (*wait_value)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*write_value)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*get_device)(CUdevice*, int) = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    bool ok = true;
    auto get = [&ok](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
      ok &= e == cudaSuccess && q == cudaDriverEntryPointSuccess && p;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuStreamWaitValue32", x.wait_value);
    get("cuStreamWriteValue32", x.write_value);
    get("cuDeviceGetAttribute", x.get_attribute);
    get("cuDeviceGet", x.get_device);
    x.ok = ok;
    return x;
  }();
  return d;
}

void cu_check(CUresult r, const char* what) {
  BLU_CHECK(r == CUDA_SUCCESS, "peer window: ", what, " failed (CUresult ", int(r), ")");
}

std::string host_name() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

}  // namespace

std::unique_ptr<PeerWindow> PeerWindow::open(TcpStore& store, const std::string& prefix, int rank, int device,
                                             size_t bytes, std::string* why) {
  BLU_CHECK(rank == 0 || rank == 1, "peer window: rank ", rank, " of a two-rank group");
  const std::string key = prefix + "/peer_window/";
  const int peer = 1 - rank;
  std::unique_ptr<PeerWindow> w(new PeerWindow());
  w->device_ = device;
  w->capacity_ = (bytes + kAlign - 1) / kAlign * kAlign;
  std::string problem;
  cuda::set_device(device);
  if (!driver().ok) problem = "the driver has no stream memory operations";
  if (problem.empty() && cudaMalloc(&w->local_, w->capacity_ + kAlign) != cudaSuccess) {
    cudaGetLastError();
    w->local_ = nullptr;
    problem = "cudaMalloc of " + std::to_string(w->capacity_) + " bytes failed";
  }
  cudaIpcMemHandle_t mine{};
  if (problem.empty()) {
    BLU_CUDA_CHECK(cudaMemset(w->local_ + w->capacity_, 0, kAlign));
    BLU_CUDA_CHECK(cudaDeviceSynchronize());
    if (cudaIpcGetMemHandle(&mine, w->local_) != cudaSuccess) {
      cudaGetLastError();
      problem = "cudaIpcGetMemHandle failed";
    }
  }
  // Round 1: the handle (or nothing) and the host; round 2: whether the peer's window mapped.
  store.set(key + "handle/" + std::to_string(rank),
            problem.empty() ? host_name() + '\n' + std::string(reinterpret_cast<const char*>(&mine), sizeof mine) : "");
  const std::string theirs = store.get(key + "handle/" + std::to_string(peer));
  if (problem.empty()) {
    const size_t nl = theirs.find('\n');
    if (theirs.empty()) problem = "rank " + std::to_string(peer) + " has no window";
    else if (nl == std::string::npos || theirs.size() - nl - 1 != sizeof(cudaIpcMemHandle_t))
      problem = "rank " + std::to_string(peer) + "'s handle is malformed";
    else if (theirs.substr(0, nl) != host_name())
      problem = "rank " + std::to_string(peer) + " is on host '" + theirs.substr(0, nl) + "'";
    else {
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, theirs.data() + nl + 1, sizeof h);
      void* p = nullptr;
      if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        problem = std::string("cudaIpcOpenMemHandle failed: ") + cudaGetErrorString(cudaGetLastError());
      } else {
        w->peer_ = static_cast<char*>(p);
      }
    }
  }
  if (problem.empty()) {
    CUdevice dev{};
    int flush = 0;
    cu_check(driver().get_device(&dev, device), "cuDeviceGet");
    cu_check(driver().get_attribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev), "cuDeviceGetAttribute");
    w->flush_remote_writes_ = flush != 0;
  }
  store.set(key + "mapped/" + std::to_string(rank), problem.empty() ? "1" : "0");
  const bool both = problem.empty() && store.get(key + "mapped/" + std::to_string(peer)) == "1";
  if (problem.empty() && !both) problem = "rank " + std::to_string(peer) + " could not map this rank's window";
  if (!problem.empty()) {
    if (why) *why = problem;
    return nullptr;  // the destructor frees what was made
  }
  return w;
}

PeerWindow::~PeerWindow() {
  if (device_ >= 0) cudaSetDevice(device_);
  if (peer_) cudaIpcCloseMemHandle(peer_);
  if (local_) cudaFree(local_);
}

bool PeerWindow::fits(const Tensor& t) const {
  const DType dt = t.dtype();
  return t.is_contiguous() && (dt == DType::f32 || dt == DType::f64 || dt == DType::bf16 || dt == DType::f16) &&
         t.nbytes() <= capacity_;
}

void PeerWindow::all_reduce(const Tensor& t, double scale, cudaStream_t s) {
  BLU_ASSERT(fits(t), "peer window: ", t.str(), " does not fit a window of ", capacity_, " bytes");
  const size_t n = (t.nbytes() + kAlign - 1) / kAlign * kAlign;
  if (n == 0) return;
  if (head_ + n > capacity_) head_ = 0;
  const size_t begin = head_, end = head_ + n;
  head_ = end;
  const uint32_t seq = ++seq_;
  // The latest earlier operation whose region overlaps this one; those inside it are superseded.
  uint32_t fence = 0;
  for (const Used& u : used_)
    if (u.begin < end && begin < u.end) fence = std::max(fence, u.seq);
  std::erase_if(used_, [&](const Used& u) { return u.begin >= begin && u.end <= end; });
  used_.push_back({seq, begin, end});

  const Driver& d = driver();
  const auto word = [](char* base, size_t cap, size_t off) { return CUdeviceptr(base + cap + off); };
  const CUstream cs = reinterpret_cast<CUstream>(s);
  const unsigned geq =
      unsigned(CU_STREAM_WAIT_VALUE_GEQ) | (flush_remote_writes_ ? unsigned(CU_STREAM_WAIT_VALUE_FLUSH) : 0u);
  if (fence > 0) cu_check(d.wait_value(cs, word(local_, capacity_, kConsumed), fence, geq), "cuStreamWaitValue32");
  BLU_CUDA_CHECK(cudaMemcpyAsync(peer_ + begin, t.raw_data(), t.nbytes(), cudaMemcpyDefault, s));
  cu_check(d.write_value(cs, word(peer_, capacity_, kArrived), seq, CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32");
  cu_check(d.wait_value(cs, word(local_, capacity_, kArrived), seq, geq), "cuStreamWaitValue32");
  cuda::peer_add(t.raw_data(), local_ + begin, t.numel(), t.dtype(), scale, s);
  cu_check(d.write_value(cs, word(peer_, capacity_, kConsumed), seq, CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32");
}

void PeerWindow::release() {
  // 0x7f7f7f7f is ahead of every seq a wait compares it with ((int32)(word - seq) >= 0).
  cudaSetDevice(device_);
  cudaStream_t side = nullptr;
  if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess) return;
  cudaMemsetAsync(local_ + capacity_, 0x7f, 8, side);
  cudaStreamSynchronize(side);
  cudaStreamDestroy(side);
}

}  // namespace blu::dist
