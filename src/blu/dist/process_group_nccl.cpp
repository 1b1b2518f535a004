// dist/process_group_nccl: ProcessGroup over NCCL for CUDA tensors. CUDA builds only.
//
// Set-up: the constructor makes `device` current, rank 0 creates the ncclUniqueId and publishes
// it in the TcpStore under "<prefix>/nccl_id"; the other ranks read it (waiting up to the store's
// timeout) and every rank calls ncclCommInitRank.
//
// Streams. Every operation runs on the group's own communication stream (of the device's highest
// priority unless NcclOptions::high_priority_stream is off: a collective issued during backward
// must not queue behind the compute kernels' blocks for SMs), so a collective overlaps the compute
// the caller queues after it:
//   caller's current stream  ──record(ready)──▶ comm stream waits(ready) ─▶ NCCL op ─▶ record(done)
// The comm stream first waits on an event recorded on the caller's current stream (the inputs
// are written there). The tensors are recorded on the comm stream (cuda::record_stream), so the
// caching allocator does not hand their blocks out again before the NCCL kernel has finished with
// them, even if the caller drops them at once. Work::wait() makes the caller's *current* stream
// wait on `done` — no host synchronisation — so work queued after wait() sees the result;
// is_completed() queries `done`.
//
// Failure. NCCL kernels spin until their peers arrive, so a dead or stalled peer is a hang unless
// something watches. A watchdog thread per group polls, every few milliseconds, the pending
// operations' `done` events and ncclCommGetAsyncError. An asynchronous NCCL error, or an operation
// pending longer than the timeout, aborts the communicator (ncclCommAbort makes the spinning
// kernels return, so queued streams drain) and breaks the group: every later wait() and every
// later call throws blu::Error naming the rank, the operation and the timeout. With
// blocking_wait, wait() itself also blocks the host until the operation is done (or the group
// breaks) — barrier() always does.
// Point to point: NCCL has no tags; a send and its recv pair by issue order, so `tag` is checked
// and otherwise ignored.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "blu/backend/cuda/runtime.h"
#include "blu/dist/env.h"
#include "blu/dist/process_group.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/ops/factory.h"

#define BLU_NCCL_CHECK(expr, what)                                                                   \
  do {                                                                                               \
    const ncclResult_t blu_nr_ = (expr);                                                             \
    if (blu_nr_ != ncclSuccess && blu_nr_ != ncclInProgress) [[unlikely]]                            \
      throw ::blu::Error(std::string("nccl ") + (what) + " failed on rank " + std::to_string(rank_) + \
                         ": " + ncclGetErrorString(blu_nr_) + " (" + #expr + ")");                 \
  } while (0)

namespace blu::dist {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    default: break;
  }
  BLU_ASSERT(false, "nccl: unchecked dtype ", dt);
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

// What the group's operations and its watchdog share. `error` is set once, when the group breaks.
struct NcclShared {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 0;
  std::chrono::milliseconds timeout{0};
  std::mutex mu;
  std::string error;
  bool aborted = false;

  std::string failure() {
    std::lock_guard lock(mu);
    return error;
  }
  // Breaks the group (first reason wins) and aborts the communicator so spinning kernels return.
  void fail(const std::string& why) {
    std::lock_guard lock(mu);
    if (error.empty()) error = why;
    if (!aborted && comm) {
      aborted = true;
      ncclCommAbort(comm);  // no check: the group is broken either way
    }
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclShared> sh, std::shared_ptr<cuda::Event> done, std::string what, bool blocking)
      : sh_(std::move(sh)), done_(std::move(done)), what_(std::move(what)), blocking_(blocking) {}

  void wait() override {
    if (blocking_) {
      // Host-side wait, bounded: the watchdog breaks the group when the timeout passes.
      while (!done_->query()) {
        if (const std::string e = sh_->failure(); !e.empty()) break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    if (const std::string e = sh_->failure(); !e.empty()) throw Error(e + " (while waiting for " + what_ + ")");
    // The waiter's stream (its current context's) is ordered after the collective.
    BLU_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(), done_->get(), 0));
  }
  bool is_completed() const override { return !sh_->failure().empty() || done_->query(); }

 private:
  std::shared_ptr<NcclShared> sh_;
  std::shared_ptr<cuda::Event> done_;
  std::string what_;
  bool blocking_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(TcpStore& store, int rank, int size, const NcclOptions& o)
      : rank_(rank), size_(size), device_(o.device), blocking_wait_(o.blocking_wait),
        sh_(std::make_shared<NcclShared>()) {
    BLU_CHECK(device_ >= 0 && device_ < cuda::device_count(), "make_nccl_group: rank ", rank, " asks for CUDA device ",
              device_, " but ", cuda::device_count(), " are visible");
    cuda::set_device(device_);
    stream_ = std::make_unique<cuda::Stream>(o.high_priority_stream ? cuda::highest_stream_priority() : 0);
    ncclUniqueId id;
    const std::string key = o.prefix + "/nccl_id";
    if (rank == 0) {
      BLU_NCCL_CHECK(ncclGetUniqueId(&id), "get unique id");
      store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      const std::string v = store.get(key);
      BLU_CHECK(v.size() == sizeof id, "make_nccl_group: '", key, "' holds ", v.size(), " bytes, expected ", sizeof id);
      std::copy(v.begin(), v.end(), reinterpret_cast<char*>(&id));
    }
    BLU_NCCL_CHECK(ncclCommInitRank(&sh_->comm, size, id, rank), "init (rank " + std::to_string(rank) + " of " +
                                                                       std::to_string(size) + ")");
    sh_->rank = rank;
    sh_->size = size;
    sh_->timeout = o.timeout;
    timeout_ms_ = o.timeout.count();
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclProcessGroup() override {
    {
      std::lock_guard lock(pending_mu_);
      stop_ = true;
    }
    pending_cv_.notify_all();
    watchdog_.join();
    // Let queued operations finish (a broken group's were aborted) before the comm goes away.
    try {
      stream_->synchronize();
    } catch (const std::exception&) {
    }
    std::lock_guard lock(sh_->mu);
    if (!sh_->aborted && sh_->comm) ncclCommDestroy(sh_->comm);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  // 0 turns the watchdog off for the operations issued afterwards.
  void set_timeout(std::chrono::milliseconds t) override {
    BLU_CHECK(t.count() >= 0, "nccl: timeout must be >= 0 ms, got ", t.count());
    timeout_ms_ = t.count();
  }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(timeout_ms_.load()); }
  void set_phase(std::string phase) override { phase_ = std::move(phase); }  // the issuing thread's

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override {
    check_tensor(t, "all_reduce");
    t.storage()->bump_version();  // Note [Storage versions]
    return launch("all_reduce", {t}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()),
                                   nccl_op(op), sh_->comm, s),
                     "all_reduce");
    });
  }

  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_tensor(out, "reduce_scatter");
    check_tensor(in, "reduce_scatter");
    BLU_CHECK(in.dtype() == out.dtype(), "reduce_scatter: input is ", in.dtype(), " but output is ", out.dtype());
    BLU_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input must hold size (", size_,
              ") × output elements (", out.numel(), "), got ", in.numel());
    out.storage()->bump_version();  // Note [Storage versions]
    return launch("reduce_scatter", {out, in}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclReduceScatter(in.raw_data(), out.raw_data(), size_t(out.numel()), nccl_dtype(in.dtype()),
                                       nccl_op(op), sh_->comm, s),
                     "reduce_scatter");
    });
  }

  WorkPtr all_gather(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "all_gather");
    check_tensor(in, "all_gather");
    BLU_CHECK(in.dtype() == out.dtype(), "all_gather: input is ", in.dtype(), " but output is ", out.dtype());
    BLU_CHECK(out.numel() == in.numel() * size_, "all_gather: output must hold size (", size_,
              ") × input elements (", in.numel(), "), got ", out.numel());
    out.storage()->bump_version();  // Note [Storage versions]
    return launch("all_gather", {out, in}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclAllGather(in.raw_data(), out.raw_data(), size_t(in.numel()), nccl_dtype(in.dtype()),
                                   sh_->comm, s),
                     "all_gather");
    });
  }

  WorkPtr broadcast(const Tensor& t, int root) override {
    check_tensor(t, "broadcast");
    check_rank(root, "broadcast root");
    t.storage()->bump_version();  // Note [Storage versions]
    return launch("broadcast", {t}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), root,
                                   sh_->comm, s),
                     "broadcast");
    });
  }

  WorkPtr send(const Tensor& t, int dst, int tag) override {
    check_tensor(t, "send");
    check_peer(dst, tag, "send");
    return launch("send", {t}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclSend(t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), dst, sh_->comm, s), "send");
    });
  }

  WorkPtr recv(const Tensor& t, int src, int tag) override {
    check_tensor(t, "recv");
    check_peer(src, tag, "recv");
    t.storage()->bump_version();  // Note [Storage versions]
    return launch("recv", {t}, [&](cudaStream_t s) {
      BLU_NCCL_CHECK(ncclRecv(t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), src, sh_->comm, s), "recv");
    });
  }

  // An all-reduce of one element whose wait() blocks the host: returns once every rank entered.
  WorkPtr barrier() override {
    cuda::set_device(device_);
    Tensor t = zeros({1}, DType::f32, Device(DeviceType::cuda, device_));
    return launch(
        "barrier", {t},
        [&](cudaStream_t s) {
          BLU_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), 1, ncclFloat32, ncclSum, sh_->comm, s), "barrier");
        },
        /*blocking=*/true);
  }

 private:
  struct Pending {
    std::shared_ptr<cuda::Event> done;
    Clock::time_point start;
    std::string what;
    std::chrono::milliseconds timeout;  // the group's when issued
  };

  template <typename F>
  WorkPtr launch(const char* what, std::initializer_list<Tensor> tensors, F&& enqueue, bool blocking = false) {
    if (const std::string e = sh_->failure(); !e.empty()) throw Error(e + " (refusing new " + what + ")");
    const int prev = cuda::current_device();
    if (prev != device_) cuda::set_device(device_);
    // The caller's stream: its execution context's for this device (Note [Execution context]).
    const cudaStream_t caller = cuda::stream_of(current_context(Device(DeviceType::cuda, device_)));
    const cudaStream_t comm = stream_->get();
    ready_.record(caller);
    BLU_CUDA_CHECK(cudaStreamWaitEvent(comm, ready_.get(), 0));
    enqueue(comm);
    for (const Tensor& t : tensors)
      if (t.numel() > 0) cuda::record_stream(t, comm);
    auto done = std::make_shared<cuda::Event>();
    done->record(comm);
    std::string desc = std::string(what) + " #" + std::to_string(++seq_);
    if (!phase_.empty()) desc += " during " + phase_;
    const std::chrono::milliseconds timeout(timeout_ms_.load());
    if (timeout.count() > 0) {
      std::lock_guard lock(pending_mu_);
      pending_.push_back({done, Clock::now(), desc, timeout});
    }
    pending_cv_.notify_one();
    if (prev != device_) cuda::set_device(prev);
    return std::make_shared<NcclWork>(sh_, std::move(done), desc, blocking || blocking_wait_);
  }

  // The watchdog: retires finished operations, breaks the group on an asynchronous NCCL error or
  // an operation older than the timeout.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock lock(pending_mu_);
    while (!stop_) {
      pending_cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 2));
      if (!sh_->failure().empty()) continue;
      while (!pending_.empty() && pending_.front().done->query()) pending_.pop_front();
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard g(sh_->mu);
        if (!sh_->aborted) ncclCommGetAsyncError(sh_->comm, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        sh_->fail("nccl: rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                  ": asynchronous error: " + ncclGetErrorString(async) + "; the communicator was aborted");
        continue;
      }
      if (!pending_.empty() && Clock::now() - pending_.front().start > pending_.front().timeout) {
        sh_->fail("nccl: rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": " +
                  pending_.front().what + " did not complete within the timeout of " +
                  std::to_string(pending_.front().timeout.count()) +
                  " ms (a peer died or stalled); the communicator was aborted");
      }
    }
  }

  void check_tensor(const Tensor& t, const char* op) const {
    BLU_CHECK(t.defined(), "nccl ", op, ": undefined tensor");
    BLU_CHECK(t.device().is_cuda() && t.device().index == device_, "nccl ", op, ": expected a tensor on cuda:", device_,
              " (this rank's device), got ", t.str());
    const DType dt = t.dtype();
    BLU_CHECK(dt == DType::f32 || dt == DType::f64 || dt == DType::bf16 || dt == DType::f16 || dt == DType::i32 ||
                  dt == DType::i64,
              "nccl ", op, ": expected dtype bf16, f16, f32, f64, i32 or i64, got ", dt);
    BLU_CHECK(t.is_contiguous(), "nccl ", op, ": expected a contiguous tensor, got ", t.str());
  }
  void check_rank(int r, const char* what) const {
    BLU_CHECK(r >= 0 && r < size_, "nccl: ", what, " must be a rank in [0, ", size_, "), got ", r);
  }
  void check_peer(int peer, int tag, const char* op) const {
    check_rank(peer, op);
    BLU_CHECK(peer != rank_, op, ": the peer is this rank (", rank_, ")");
    BLU_CHECK(tag >= 0, op, ": tag must be >= 0, got ", tag);
  }

  int rank_, size_, device_;
  bool blocking_wait_;
  std::shared_ptr<NcclShared> sh_;
  std::unique_ptr<cuda::Stream> stream_;
  cuda::Event ready_;  // reused: recorded and waited on within one launch()
  uint64_t seq_ = 0;
  std::atomic<int64_t> timeout_ms_{0};  // for operations issued from now on
  std::string phase_;
  std::mutex pending_mu_;
  std::condition_variable pending_cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(TcpStore& store, int rank, int size, NcclOptions options) {
  BLU_CHECK(size >= 1, "make_nccl_group: size must be >= 1, got ", size);
  BLU_CHECK(rank >= 0 && rank < size, "make_nccl_group: rank must be in [0, ", size, "), got ", rank);
  BLU_CHECK(options.timeout.count() >= 0, "make_nccl_group: timeout must be >= 0 ms, got ", options.timeout.count());
  if (options.device < 0) options.device = detect_env().local_rank;
  return std::make_shared<NcclProcessGroup>(store, rank, size, options);
}

}  // namespace blu::dist
