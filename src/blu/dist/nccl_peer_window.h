// dist/nccl_peer_window: the all-reduce of a group of two ranks on one host, with the bytes moved by
// the copy engines instead of NCCL's kernels. CUDA builds only (the NCCL group uses it: NcclOptions::
// peer_window_mib, process_group_nccl.cpp).
//
// Why: a DDP bucket's all-reduce runs beside backward, and NCCL's kernels hold SMs (and their
// share of memory bandwidth) for the whole transfer; on 2×H200 backward runs 1.8 ms slower at B=16
// beside them (docs/performance.md). Here the transfer is a cudaMemcpyAsync into the peer's memory
// (NVLink, no SM), and the only kernel is the short elementwise add that follows.
//
// How: each rank allocates a window (cudaMalloc) and two flag words after it, exports it with
// cudaIpcGetMemHandle and maps the peer's (through the store, at set-up). Operation `seq` (1, 2,
// … in issue order, the same on both ranks) of n bytes gets the region [off, off + n) of the window
// — a ring, placed the same on both ranks — and enqueues, on the group's stream:
//   1. wait until the peer has consumed every earlier operation that used this region of *its*
//      window (its `consumed` word in ours ≥ that operation's seq)     cuStreamWaitValue32
//   2. copy our tensor into the peer's window at off                     cudaMemcpyAsync (P2P)
//   3. set the peer's `arrived` word to seq (a memory fence first)     cuStreamWriteValue32
//   4. wait until our `arrived` word ≥ seq (the peer's bytes are in ours)
//   5. tensor ← (tensor + window[off]) · scale                            cuda::peer_add
//   6. set the peer's `consumed` word to seq
// Both ranks add the same two operands, so both get the same bits. The stream operations use no
// SM; the waits are on local memory. A peer that dies leaves step 1 or 4 waiting: the group's
// watchdog times the operation out as any other, and release() then sets our words so the stream
// drains.
// Depends on core/tensor, dist/tcp_store, backend/cuda (peer_add) and the CUDA driver's stream
// memory operations. Keep: every rank issues the same operations in the same order (as with NCCL).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "blu/core/tensor.h"
#include "blu/dist/tcp_store.h"

namespace blu::dist {

class PeerWindow {
 public:
  // Collective over the group's two ranks (through `store`, keys under `prefix`). nullptr, on both
  // ranks, when either cannot map the other's window (no peer access between the devices, another
  // host, or no stream memory operations); `why` then says which and why.
  static std::unique_ptr<PeerWindow> open(TcpStore& store, const std::string& prefix, int rank, int device,
                                          size_t bytes, std::string* why);
  ~PeerWindow();
  PeerWindow(const PeerWindow&) = delete;
  PeerWindow& operator=(const PeerWindow&) = delete;

  size_t capacity() const { return capacity_; }
  // Whether t can go through the window: a contiguous float tensor no larger than the window.
  bool fits(const Tensor& t) const;
  // Enqueues steps 1-6 on `s` for t (on this rank's device): t ← (t + the peer's t) · scale.
  void all_reduce(const Tensor& t, double scale, cudaStream_t s);
  // After the group broke: sets this rank's words so that no wait on them blocks the stream.
  void release();

 private:
  PeerWindow() = default;
  struct Used {
    uint32_t seq;
    size_t begin, end;
  };
  int device_ = -1;
  size_t capacity_ = 0;
  char* local_ = nullptr;  // this rank's window; the words follow at capacity_
  char* peer_ = nullptr;   // the peer's, mapped
  uint32_t seq_ = 0;
  size_t head_ = 0;
  std::deque<Used> used_;  // the regions of earlier operations still standing
  bool flush_remote_writes_ = false;
};

}  // namespace blu::dist
