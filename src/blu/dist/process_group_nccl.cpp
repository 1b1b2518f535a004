// dist/process_group_nccl: ProcessGroup over NCCL for CUDA tensors. CUDA builds only.
//
// Set-up: the constructor makes `device` current, rank 0 creates the ncclUniqueId and publishes
// it in the TcpStore under "<prefix>/nccl_id"; the other ranks read it (waiting up to the store's
// timeout) and every rank calls ncclCommInitRank — already watched (below): an initialisation
// that is not done within the init timeout ends the process with a message naming the rank and
// the timeout (a blocking ncclCommInitRank cannot be aborted: there is no communicator yet).
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
// Note [NCCL abort and enqueue]: every use of the communicator — an operation's enqueue, the
// watchdog's ncclCommGetAsyncError, ncclCommAbort, ncclCommDestroy — holds NcclShared::comm_mu,
// and an enqueue first checks `aborted` under it, so nothing is ever enqueued on an aborted
// communicator and abort never runs beside an enqueue. The watchdog only try-locks it: for its
// polls, and to abort (waiting up to 2 s). An enqueue that does not return within the timeout
// (NCCL blocked in the host call, e.g. its work queue full behind a collective whose peer stalled)
// holds the lock abort would need, so then the watchdog ends the process.
// Heartbeat: the watchdog bumps a counter on every pass; a monitor thread ends the process with a
// message when the counter stands still for heartbeat_timeout (the watchdog itself stuck in CUDA
// or NCCL), since then nothing else would end the hang.
// Flight recorder (dist/flight_recorder.h): the initialisation and every operation are recorded
// — enqueued at issue, started when an event recorded before the NCCL call completes, completed
// when `done` does (the watchdog polls both) — and dumped when the group breaks or the process is
// ended by the init watchdog or the heartbeat monitor.
// Point to point: NCCL has no tags; a send and its recv pair by issue order, so `tag` is checked
// and otherwise ignored.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "blu/backend/cuda/runtime.h"
#include "blu/dist/env.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/nccl_peer_window.h"
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

// Ends the process after a hang nothing else can end: prints `why`, dumps the flight recorder (on
// a thread of its own, waited for at most a few seconds: the dump must not become the next hang)
// and exits with status 1.
[[noreturn]] void end_process(const std::string& why) {
  std::fprintf(stderr, "%s\n", why.c_str());
  std::fflush(nullptr);
  std::atomic<bool> dumped{false};
  std::thread([&dumped, why] {
    FlightRecorder::global().dump(why);
    dumped = true;
  }).detach();
  for (int i = 0; i < 300 && !dumped.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::fflush(nullptr);
  std::_Exit(1);
}

// What the group's operations and its watchdog share. `error` is set once, when the group breaks.
struct NcclShared {
  ncclComm_t comm = nullptr;
  int rank = 0, size = 0;
  std::mutex mu;  // guards `error`
  std::string error;
  std::mutex comm_mu;    // Note [NCCL abort and enqueue]
  bool aborted = false;  // guarded by comm_mu

  std::string failure() {
    std::lock_guard lock(mu);
    return error;
  }
  // Breaks the group (first reason wins) and aborts the communicator so spinning kernels return.
  // False when the communicator could not be had within `wait` (an enqueue blocked in NCCL holds
  // it: Note [NCCL abort and enqueue]) and so was not aborted.
  bool fail(const std::string& why, std::chrono::milliseconds wait) {
    {
      std::lock_guard lock(mu);
      if (error.empty()) error = why;
    }
    std::unique_lock lock(comm_mu, std::try_to_lock);
    for (auto until = Clock::now() + wait; !lock.owns_lock() && Clock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.try_lock();
    }
    if (!lock.owns_lock()) return false;
    if (!aborted && comm) {
      aborted = true;
      ncclCommAbort(comm);  // no check: the group is broken either way
    }
    return true;
  }
};

class NcclWork final : public Work {
 public:
  // in_graph: enqueued while the caller's stream records a CUDA graph (the compiled step's
  // replay): the collective runs when the graph does, so the host can neither query nor wait for
  // its event; the waiter's stream still joins it.
  NcclWork(std::shared_ptr<NcclShared> sh, std::shared_ptr<cuda::Event> done, std::string what, bool blocking,
           bool in_graph = false)
      : sh_(std::move(sh)), done_(std::move(done)), what_(std::move(what)), blocking_(blocking && !in_graph),
        in_graph_(in_graph) {}

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
  bool is_completed() const override { return in_graph_ || !sh_->failure().empty() || done_->query(); }

 private:
  std::shared_ptr<NcclShared> sh_;
  std::shared_ptr<cuda::Event> done_;
  std::string what_;
  bool blocking_, in_graph_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(TcpStore& store, int rank, int size, const NcclOptions& o)
      : rank_(rank), size_(size), device_(o.device), blocking_wait_(o.blocking_wait), name_(o.prefix),
        heartbeat_timeout_(o.heartbeat_timeout), sh_(std::make_shared<NcclShared>()) {
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
    sh_->rank = rank;
    sh_->size = size;
    timeout_ms_ = o.timeout.count();
    // The watchdog (and its heartbeat monitor) run from before ncclCommInitRank: a peer that never
    // joins ends this process after the init timeout instead of hanging it.
    const std::chrono::milliseconds init_timeout = o.init_timeout.count() > 0 ? o.init_timeout : o.timeout;
    init_id_ = FlightRecorder::global().record(
        {.group = name_, .backend = "nccl", .kind = "comm_init", .seq = 0, .has_dtype = false, .phase = phase_});
    FlightRecorder::global().update(init_id_, OpState::started);
    if (init_timeout.count() > 0) init_deadline_ns_ = (Clock::now() + init_timeout).time_since_epoch().count();
    init_timeout_ = init_timeout;
    if (const char* v = std::getenv("BLU_TEST_NCCL_WATCHDOG_SLEEP_MS"); v && *v) test_watchdog_sleep_ms_ = std::atoll(v);
    watchdog_ = std::thread([this] { watch(); });
    if (heartbeat_timeout_.count() > 0) monitor_ = std::thread([this] { monitor(); });
    try {
      BLU_NCCL_CHECK(ncclCommInitRank(&sh_->comm, size, id, rank), "init (rank " + std::to_string(rank) + " of " +
                                                                         std::to_string(size) + ")");
    } catch (...) {
      FlightRecorder::global().update(init_id_, OpState::failed);
      stop_threads();
      throw;
    }
    FlightRecorder::global().update(init_id_, OpState::completed);
    initialized_ = true;
    if (size == 2 && o.peer_window_mib > 0) {
      std::string why;
      window_ = PeerWindow::open(store, o.prefix, rank, device_, size_t(o.peer_window_mib * 1048576.0), &why);
      if (!window_ && rank == 0)
        std::fprintf(stderr, "nccl %s: no peer window (%s); all-reduces go through NCCL\n", name_.c_str(),
                     why.c_str());
    }
  }

  ~NcclProcessGroup() override {
    stop_threads();
    // Let queued operations finish (a broken group's were aborted) before the comm goes away.
    try {
      stream_->synchronize();
    } catch (const std::exception&) {
    }
    if (window_) close_window();
    std::lock_guard lock(sh_->comm_mu);
    if (!sh_->aborted && sh_->comm) ncclCommDestroy(sh_->comm);
    // The stream outlives the group, on purpose: the caching allocator bound every tensor a
    // collective touched to it (record_stream) and records an event on it when such a block is
    // freed — which can be after the group is gone (a model's parameters, broadcast at start-up,
    // die with the model). One stream per group, and a process makes few groups.
    (void)stream_.release();
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
    if (window_ && op != ReduceOp::max && window_->fits(t))
      return launch("all_reduce", {t},
                    [&](cudaStream_t s) { window_->all_reduce(t, op == ReduceOp::avg ? 0.5 : 1.0, s); });
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
    return launch(
        "broadcast", {t},
        [&](cudaStream_t s) {
          BLU_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), root,
                                       sh_->comm, s),
                         "broadcast");
        },
        false, root);
  }

  WorkPtr send(const Tensor& t, int dst, int tag) override {
    check_tensor(t, "send");
    check_peer(dst, tag, "send");
    return launch(
        "send", {t},
        [&](cudaStream_t s) {
          BLU_NCCL_CHECK(ncclSend(t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), dst, sh_->comm, s), "send");
        },
        false, dst);
  }

  WorkPtr recv(const Tensor& t, int src, int tag) override {
    check_tensor(t, "recv");
    check_peer(src, tag, "recv");
    t.storage()->bump_version();  // Note [Storage versions]
    return launch(
        "recv", {t},
        [&](cudaStream_t s) {
          BLU_NCCL_CHECK(ncclRecv(t.raw_data(), size_t(t.numel()), nccl_dtype(t.dtype()), src, sh_->comm, s), "recv");
        },
        false, src);
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
    std::shared_ptr<cuda::Event> started, done;
    uint64_t flight_id;
    bool seen_started;
    Clock::time_point start;
    std::string what;
    std::chrono::milliseconds timeout;  // the group's when issued (0: never times out)
  };

  // `tensors`' first is the one whose bytes and dtype the flight recorder notes.
  template <typename F>
  WorkPtr launch(const char* what, std::initializer_list<Tensor> tensors, F&& enqueue, bool blocking = false,
                 int peer = -1) {
    if (const std::string e = sh_->failure(); !e.empty()) throw Error(e + " (refusing new " + what + ")");
    const Tensor& first = *tensors.begin();
    FlightRecorder& fr = FlightRecorder::global();
    const uint64_t fid = fr.record({.group = name_, .backend = "nccl", .kind = what, .seq = ++seq_,
                                    .dtype = first.dtype(), .bytes = int64_t(first.nbytes()), .peer = peer,
                                    .phase = phase_});
    std::string desc = std::string(what) + " #" + std::to_string(seq_);
    if (!phase_.empty()) desc += " during " + phase_;
    const int prev = cuda::current_device();
    if (prev != device_) cuda::set_device(device_);
    // The caller's stream: its execution context's for this device (Note [Execution context]).
    const cudaStream_t caller = cuda::stream_of(current_context(Device(DeviceType::cuda, device_)));
    // Recorded into a CUDA graph (the compiled step): the events below become the graph's fork and
    // join, which no host call may query, so the watchdog does not track it and the allocator is
    // not asked to (the graph's buffers live as long as the graph).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    BLU_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
    const bool in_graph = capture != cudaStreamCaptureStatusNone;
    const cudaStream_t comm = stream_->get();
    auto started = std::make_shared<cuda::Event>();
    auto done = std::make_shared<cuda::Event>();
    try {
      std::lock_guard lock(sh_->comm_mu);  // Note [NCCL abort and enqueue]
      if (sh_->aborted) throw Error(sh_->failure() + " (refusing new " + what + ")");
      std::snprintf(enqueue_what_, sizeof enqueue_what_, "%s", desc.c_str());
      enqueue_since_ns_ = Clock::now().time_since_epoch().count();
      ready_.record(caller);
      BLU_CUDA_CHECK(cudaStreamWaitEvent(comm, ready_.get(), 0));
      started->record(comm);
      enqueue(comm);
      if (!in_graph)
        for (const Tensor& t : tensors)
          if (t.numel() > 0) cuda::record_stream(t, comm);
      done->record(comm);
      enqueue_since_ns_ = 0;
    } catch (...) {
      enqueue_since_ns_ = 0;
      fr.update(fid, OpState::failed);
      if (prev != device_) cuda::set_device(prev);
      throw;
    }
    if (in_graph) fr.update(fid, OpState::captured);
    if (!in_graph) {
      {
        std::lock_guard lock(pending_mu_);
        pending_.push_back(
            {started, done, fid, false, Clock::now(), desc, std::chrono::milliseconds(timeout_ms_.load())});
      }
      pending_cv_.notify_one();
    }
    if (prev != device_) cuda::set_device(prev);
    return std::make_shared<NcclWork>(sh_, std::move(done), desc, blocking || blocking_wait_, in_graph);
  }

  // A rank's last operation through the window writes into the peer's window after the peer's
  // own last operation may have finished: one more all-reduce, after which both streams are past
  // every such write, comes before either frees its window. A peer that does not take part within
  // the timeout leaves the window mapped (leaked) rather than freed under a late write.
  void close_window() {
    bool safe = false;
    if (sh_->failure().empty()) {
      try {
        cuda::set_device(device_);
        Tensor t = zeros({1}, DType::f32, Device(DeviceType::cuda, device_));
        std::lock_guard lock(sh_->comm_mu);
        if (!sh_->aborted && ncclAllReduce(t.raw_data(), t.raw_data(), 1, ncclFloat32, ncclSum, sh_->comm,
                                           stream_->get()) == ncclSuccess) {
          cuda::Event done;
          done.record(stream_->get());
          const auto until = Clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms_.load(), 1000));
          while (!(safe = done.query()) && Clock::now() < until)
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      } catch (const std::exception&) {
      }
    }
    if (!safe) {
      (void)window_.release();
      sh_->fail(who() + ": the peer did not close the window", std::chrono::milliseconds(2000));  // aborts
    }
    window_.reset();
  }

  std::string who() const { return "nccl: rank " + std::to_string(rank_) + " of " + std::to_string(size_); }

  // The watchdog: watches the initialisation, notes started and finished operations in the flight
  // recorder, breaks the group on an asynchronous NCCL error or an operation older than its
  // timeout, and ends the process when an enqueue does not return (Note [NCCL abort and enqueue]).
  void watch() {
    cudaSetDevice(device_);
    FlightRecorder& fr = FlightRecorder::global();
    std::unique_lock lock(pending_mu_);
    while (!stop_) {
      heartbeat_.fetch_add(1, std::memory_order_relaxed);
      pending_cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 2));
      if (test_watchdog_sleep_ms_ > 0 && initialized_)  // a stuck watchdog, for the heartbeat's test
        std::this_thread::sleep_for(std::chrono::milliseconds(std::exchange(test_watchdog_sleep_ms_, 0)));
      if (!initialized_) {
        const int64_t deadline = init_deadline_ns_;
        if (deadline > 0 && Clock::now().time_since_epoch().count() > deadline) {
          fr.update(init_id_, OpState::failed);
          end_process(who() + ": ncclCommInitRank did not complete within the timeout of " +
                      std::to_string(init_timeout_.count()) +
                      " ms (a rank did not start or cannot reach this one); ending the process");
        }
        continue;
      }
      if (!sh_->failure().empty()) continue;
      for (Pending& p : pending_) {  // one stream: they start in order
        if (p.seen_started) continue;
        if (!p.started->query()) break;
        p.seen_started = true;
        fr.update(p.flight_id, OpState::started);
      }
      while (!pending_.empty() && pending_.front().done->query()) {
        fr.update(pending_.front().flight_id, OpState::completed);
        pending_.pop_front();
      }
      ncclResult_t async = ncclSuccess;
      {
        std::unique_lock g(sh_->comm_mu, std::try_to_lock);  // an enqueue holds it: poll next time
        if (g.owns_lock() && !sh_->aborted) ncclCommGetAsyncError(sh_->comm, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        break_group(who() + ": asynchronous error: " + ncclGetErrorString(async) + "; the communicator was aborted");
        continue;
      }
      const int64_t since = enqueue_since_ns_, limit_ms = timeout_ms_.load();
      if (since > 0 && limit_ms > 0 && Clock::now().time_since_epoch().count() - since > limit_ms * 1000000)
        end_process(who() + ": enqueueing " + enqueue_what_ + " did not return within the timeout of " +
                    std::to_string(limit_ms) + " ms (NCCL blocked in the host call); ending the process");
      if (!pending_.empty() && pending_.front().timeout.count() > 0 &&
          Clock::now() - pending_.front().start > pending_.front().timeout) {
        fr.update(pending_.front().flight_id, OpState::failed);
        break_group(who() + ": " + pending_.front().what + " did not complete within the timeout of " +
                    std::to_string(pending_.front().timeout.count()) +
                    " ms (a peer died or stalled); the communicator was aborted");
      }
    }
  }

  // Dumps the flight recorder (the failed operation still the oldest in flight), then aborts; an
  // enqueue stuck inside NCCL (typically behind the very operation that timed out) keeps the
  // communicator from being aborted, and then only ending the process ends the hang.
  void break_group(const std::string& why) {
    FlightRecorder::global().dump(why);
    if (window_) window_->release();  // its waits would hold the stream after the abort
    if (!sh_->fail(why, std::chrono::milliseconds(2000)))
      end_process(why + "; but an enqueue on the communicator has not returned for 2 s, so it cannot be aborted: "
                        "ending the process");
  }

  // The heartbeat monitor: ends the process when the watchdog stops making passes.
  void monitor() {
    const auto poll = std::clamp<std::chrono::milliseconds>(heartbeat_timeout_ / 4, std::chrono::milliseconds(1),
                                                            std::chrono::milliseconds(1000));
    std::unique_lock lock(monitor_mu_);
    uint64_t last = heartbeat_.load();
    auto last_change = Clock::now();
    while (!stop_monitor_) {
      monitor_cv_.wait_for(lock, poll);
      const uint64_t hb = heartbeat_.load();
      if (hb != last) {
        last = hb;
        last_change = Clock::now();
      } else if (Clock::now() - last_change > heartbeat_timeout_) {
        end_process(who() + ": the watchdog made no progress for " + std::to_string(heartbeat_timeout_.count()) +
                    " ms (stuck in a CUDA or NCCL call); ending the process");
      }
    }
  }

  void stop_threads() {
    {
      std::lock_guard lock(pending_mu_);
      stop_ = true;
    }
    pending_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    {
      std::lock_guard lock(monitor_mu_);
      stop_monitor_ = true;
    }
    monitor_cv_.notify_all();
    if (monitor_.joinable()) monitor_.join();
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
  std::string name_;  // the store prefix: the group's name in the flight recorder
  std::chrono::milliseconds heartbeat_timeout_;
  std::shared_ptr<NcclShared> sh_;
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<PeerWindow> window_;  // two ranks on one host with NcclOptions::peer_window_mib
  cuda::Event ready_;  // reused: recorded and waited on within one launch()
  uint64_t seq_ = 0;
  std::atomic<int64_t> timeout_ms_{0};  // for operations issued from now on
  std::string phase_;
  std::mutex pending_mu_;
  std::condition_variable pending_cv_;
  std::deque<Pending> pending_;
  bool stop_ = false;
  // Initialisation, watched by the watchdog until initialized_.
  uint64_t init_id_ = 0;
  std::atomic<int64_t> init_deadline_ns_{0};  // steady clock; 0: not watched
  std::chrono::milliseconds init_timeout_{0};
  std::atomic<bool> initialized_{false};
  // The enqueue in progress (Note [NCCL abort and enqueue]): since when (steady clock, 0: none).
  std::atomic<int64_t> enqueue_since_ns_{0};
  char enqueue_what_[160] = {};  // written before enqueue_since_ns_ is set, read after it is seen
  int64_t test_watchdog_sleep_ms_ = 0;  // BLU_TEST_NCCL_WATCHDOG_SLEEP_MS: the heartbeat's test
  std::atomic<uint64_t> heartbeat_{0};
  std::mutex monitor_mu_;
  std::condition_variable monitor_cv_;
  bool stop_monitor_ = false;
  std::thread watchdog_, monitor_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(TcpStore& store, int rank, int size, NcclOptions options) {
  BLU_CHECK(size >= 1, "make_nccl_group: size must be >= 1, got ", size);
  BLU_CHECK(rank >= 0 && rank < size, "make_nccl_group: rank must be in [0, ", size, "), got ", rank);
  BLU_CHECK(options.timeout.count() >= 0, "make_nccl_group: timeout must be >= 0 ms, got ", options.timeout.count());
  BLU_CHECK(options.init_timeout.count() >= 0, "make_nccl_group: init_timeout must be >= 0 ms, got ",
            options.init_timeout.count());
  BLU_CHECK(options.heartbeat_timeout.count() >= 0, "make_nccl_group: heartbeat_timeout must be >= 0 ms, got ",
            options.heartbeat_timeout.count());
  if (options.device < 0) options.device = detect_env().local_rank;
  if (options.peer_window_mib == 0)
    if (const char* v = std::getenv("BLU_NCCL_PEER_WINDOW_MIB"); v && *v) {
      char* end = nullptr;
      options.peer_window_mib = std::strtod(v, &end);
      BLU_CHECK(end && *end == 0 && options.peer_window_mib >= 0, "BLU_NCCL_PEER_WINDOW_MIB: expected MiB >= 0, got '",
                v, "'");
    }
  BLU_CHECK(options.peer_window_mib >= 0, "make_nccl_group: peer_window_mib must be >= 0, got ",
            options.peer_window_mib);
  return std::make_shared<NcclProcessGroup>(store, rank, size, options);
}

}  // namespace blu::dist
