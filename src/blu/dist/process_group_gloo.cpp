// dist/process_group_gloo: ProcessGroup over Gloo's TCP transport for CPU f32/f64 tensors.
// Each group owns one worker thread fed by a FIFO queue: a call checks its arguments on the
// caller's thread, queues a task and returns its Work at once; the worker runs the tasks in
// order (so every rank issues the same sequence of Gloo operations) and records a failure in the
// Work. all_reduce, all_gather, broadcast and barrier are Gloo's algorithms; reduce_scatter is a
// ring over Gloo's unbound buffers (size-1 steps, each rank sending and receiving one chunk per
// step: the same traffic as NCCL's, half an all-reduce's). Every Gloo wait carries the group's
// timeout, so a dead peer (connection reset) or a stalled one (timeout) ends as blu::Error.
// Every operation is recorded in the flight recorder (dist/flight_recorder.h): enqueued when
// issued, started and completed (or failed) on the worker — point to point: started when issued,
// completed when waited for; the group's first failure dumps the recorder.
// Note [Roll call]: a failed collective says which peer is gone. On the group's first failure the
// worker closes the group's connections (a survivor blocked on this rank, not on the lost one,
// fails at once too instead of after this process exits), connects to the job's store (a fresh
// client: the group keeps only its address and options), writes its own key under the group's
// prefix and waits a short window (a quarter of the timeout, 0.25–2 s) for every other member's;
// the members whose key did not come — a dead process cannot write one, a stalled one does not —
// are named by their job rank in the error.
// A store that cannot be reached names rank 0's process, which serves it, as possibly lost.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <csignal>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <signal.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>

#include "blu/dist/flight_recorder.h"
#include "blu/dist/gloo_store.h"
#include "blu/dist/process_group.h"

namespace blu::dist {

// Gloo's algorithms are templates over the element type: f32, f64 and the index types (i32, i64:
// token ids gathered by DDP's row exchange; summed, never averaged).
#define BLU_DISPATCH_GLOO(dtype, ...)                       \
  switch (dtype) {                                          \
    case DType::f32: { using scalar_t = float; __VA_ARGS__; break; }  \
    case DType::f64: { using scalar_t = double; __VA_ARGS__; break; } \
    case DType::i32: { using scalar_t = int32_t; __VA_ARGS__; break; } \
    case DType::i64: { using scalar_t = int64_t; __VA_ARGS__; break; } \
    default: BLU_ASSERT(false, "gloo: unchecked dtype ", dtype);      \
  }

// Collectives that only move data (all-gather, broadcast) take 16-bit floats as their bits.
#define BLU_DISPATCH_GLOO_MOVE(dtype, ...)                                                     \
  switch (dtype) {                                                                            \
    case DType::bf16:                                                                         \
    case DType::f16: { using scalar_t = uint16_t; __VA_ARGS__; break; }                       \
    default: BLU_DISPATCH_GLOO(dtype, __VA_ARGS__);                                           \
  }

// A 16-bit float tensor's values widened to f32 (reductions add in f32, as NCCL does for bf16,
// and round once when written back), and written back.
std::vector<float> widened(const Tensor& t) {
  std::vector<float> out(size_t(t.numel()));
  if (t.dtype() == DType::bf16) {
    const bf16* p = static_cast<const bf16*>(t.raw_data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = float(p[i]);
  } else {
    const f16* p = static_cast<const f16*>(t.raw_data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = float(p[i]);
  }
  return out;
}
void narrowed(const std::vector<float>& v, const Tensor& t) {
  if (t.dtype() == DType::bf16) {
    bf16* p = static_cast<bf16*>(t.raw_data());
    for (size_t i = 0; i < v.size(); ++i) p[i] = bf16(v[i]);
  } else {
    f16* p = static_cast<f16*>(t.raw_data());
    for (size_t i = 0; i < v.size(); ++i) p[i] = f16(v[i]);
  }
}
bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

namespace {

class GlooWork final : public Work {
 public:
  void wait() override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (!error_.empty()) throw Error(error_);
  }
  bool is_completed() const override {
    std::lock_guard lock(mu_);
    return done_;
  }
  void finish(std::string error) {
    {
      std::lock_guard lock(mu_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};

class P2PWork final : public Work {
 public:
  P2PWork(std::unique_ptr<gloo::transport::UnboundBuffer> buf, Tensor t, bool is_send,
          std::chrono::milliseconds timeout, int rank, int peer, uint64_t flight_id)
      : buf_(std::move(buf)), tensor_(std::move(t)), send_(is_send), timeout_(timeout), rank_(rank), peer_(peer),
        flight_id_(flight_id) {}
  void wait() override {
    std::lock_guard lock(mu_);
    if (!done_) {
      try {
        const bool ok = send_ ? buf_->waitSend(timeout_) : buf_->waitRecv(timeout_);
        if (!ok) error_ = "aborted";
      } catch (const std::exception& e) {
        error_ = e.what();
      }
      done_ = true;
      if (!error_.empty()) error_ = std::string("gloo ") + (send_ ? "send to rank " : "recv from rank ") +
                                    std::to_string(peer_) + " failed on rank " + std::to_string(rank_) + " (timeout " +
                                    std::to_string(timeout_.count()) + " ms): " + error_;
      FlightRecorder::global().update(flight_id_, error_.empty() ? OpState::completed : OpState::failed);
      if (!error_.empty()) FlightRecorder::global().dump(error_);
    }
    if (!error_.empty()) throw Error(error_);
  }
  bool is_completed() const override {  // known only once waited for
    std::lock_guard lock(mu_);
    return done_;
  }

 private:
  mutable std::mutex mu_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  Tensor tensor_;  // kept alive until the transfer is done
  bool send_;
  std::chrono::milliseconds timeout_;
  int rank_, peer_;
  uint64_t flight_id_;
  bool done_ = false;
  std::string error_;
};

constexpr uint8_t kReduceScatterSlot = 0xB0, kP2PSlot = 0xB1;

class GlooGroup final : public ProcessGroup {
 public:
  GlooGroup(TcpStore& store, int rank, int size, const GlooOptions& options)
      : rank_(rank), size_(size), timeout_(options.timeout.count()), name_(options.prefix) {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname.empty() ? default_hostname(store.host()) : options.hostname;
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
      ctx->setTimeout(options.timeout);
      GlooStore adapter(store);
      gloo::rendezvous::PrefixStore prefixed(options.prefix, adapter);
      ctx->connectFullMesh(prefixed, device);
      ctx_ = std::move(ctx);
    } catch (const std::exception& e) {
      BLU_CHECK(false, "gloo: rank ", rank, " of ", size, " could not connect to its peers within ",
                options.timeout.count(), " ms: ", e.what());
    }
    // Each member's rank in the job (RANK; the group rank without a launcher), for the roll call.
    store_host_ = store.host(), store_port_ = store.port(), store_options_ = store.options();
    const char* job_rank = std::getenv("RANK");
    store.set(name_ + "/job_rank/" + std::to_string(rank), job_rank && *job_rank ? job_rank : std::to_string(rank));
    for (int r = 0; r < size; ++r) job_ranks_.push_back(store.get(name_ + "/job_rank/" + std::to_string(r)));
    worker_ = std::thread([this] { run(); });
  }

  ~GlooGroup() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }
  void set_timeout(std::chrono::milliseconds t) override {
    BLU_CHECK(t.count() > 0, "gloo: timeout must be > 0 ms, got ", t.count());
    timeout_ = t.count();
  }
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(timeout_.load()); }
  void set_phase(std::string phase) override {
    std::lock_guard lock(mu_);
    phase_ = std::move(phase);
  }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override {
    check_tensor(t, "all_reduce");
    check_avg(t, op, "all_reduce");
    t.storage()->bump_version();  // Note [Storage versions]
    return enqueue("all_reduce", t, -1, [this, t, op](uint32_t tag) {
      if (is_half(t.dtype())) {
        std::vector<float> f = widened(t);
        gloo::AllreduceOptions o(ctx_);
        o.setOutput<float>(f.data(), f.size());
        using ReduceFn = void (*)(void*, const void*, const void*, size_t);
        o.setReduceFunction(op == ReduceOp::max ? ReduceFn(&gloo::max<float>) : ReduceFn(&gloo::sum<float>));
        o.setTag(tag);
        o.setTimeout(op_timeout_);
        gloo::allreduce(o);
        if (op == ReduceOp::avg) scale(f.data(), int64_t(f.size()), 1.0f / float(size_));
        narrowed(f, t);
        return;
      }
      BLU_DISPATCH_GLOO(t.dtype(), {
        gloo::AllreduceOptions o(ctx_);
        o.setOutput<scalar_t>(t.data<scalar_t>(), size_t(t.numel()));
        using ReduceFn = void (*)(void*, const void*, const void*, size_t);
        o.setReduceFunction(op == ReduceOp::max ? ReduceFn(&gloo::max<scalar_t>) : ReduceFn(&gloo::sum<scalar_t>));
        o.setTag(tag);
        o.setTimeout(op_timeout_);
        gloo::allreduce(o);
        if (op == ReduceOp::avg) scale(t.data<scalar_t>(), t.numel(), scalar_t(1) / scalar_t(size_));
      });
    });
  }

  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    check_tensor(out, "reduce_scatter");
    check_tensor(in, "reduce_scatter");
    BLU_CHECK(in.dtype() == out.dtype(), "reduce_scatter: input is ", in.dtype(), " but output is ", out.dtype());
    check_avg(in, op, "reduce_scatter");
    BLU_CHECK(in.numel() == out.numel() * size_, "reduce_scatter: input must hold size (", size_,
              ") × output elements (", out.numel(), " → ", out.numel() * size_, "), got ", in.numel());
    out.storage()->bump_version();  // Note [Storage versions]
    return enqueue("reduce_scatter", in, -1, [this, out, in, op](uint32_t tag) {
      if (is_half(in.dtype())) {
        const std::vector<float> fin = widened(in);
        std::vector<float> fout(size_t(out.numel()));
        ring_reduce_scatter_raw<float>(fout.data(), fin.data(), fout.size(), op, tag);
        narrowed(fout, out);
        return;
      }
      BLU_DISPATCH_GLOO(in.dtype(), { ring_reduce_scatter<scalar_t>(out, in, op, tag); });
    });
  }

  WorkPtr all_gather(const Tensor& out, const Tensor& in) override {
    check_tensor(out, "all_gather");
    check_tensor(in, "all_gather");
    BLU_CHECK(in.dtype() == out.dtype(), "all_gather: input is ", in.dtype(), " but output is ", out.dtype());
    BLU_CHECK(out.numel() == in.numel() * size_, "all_gather: output must hold size (", size_,
              ") × input elements (", in.numel(), " → ", in.numel() * size_, "), got ", out.numel());
    out.storage()->bump_version();  // Note [Storage versions]
    return enqueue("all_gather", out, -1, [this, out, in](uint32_t tag) {
      BLU_DISPATCH_GLOO_MOVE(in.dtype(), {
        gloo::AllgatherOptions o(ctx_);
        o.setInput<scalar_t>(static_cast<scalar_t*>(in.raw_data()), size_t(in.numel()));
        o.setOutput<scalar_t>(static_cast<scalar_t*>(out.raw_data()), size_t(out.numel()));
        o.setTag(tag);
        o.setTimeout(op_timeout_);
        gloo::allgather(o);
      });
    });
  }

  WorkPtr broadcast(const Tensor& t, int root) override {
    check_tensor(t, "broadcast");
    check_rank(root, "broadcast root");
    t.storage()->bump_version();  // Note [Storage versions]
    return enqueue("broadcast", t, root, [this, t, root](uint32_t tag) {
      BLU_DISPATCH_GLOO_MOVE(t.dtype(), {
        gloo::BroadcastOptions o(ctx_);
        o.setOutput<scalar_t>(static_cast<scalar_t*>(t.raw_data()), size_t(t.numel()));
        o.setRoot(root);
        o.setTag(tag);
        o.setTimeout(op_timeout_);
        gloo::broadcast(o);
      });
    });
  }

  // Point to point goes straight to Gloo on the caller's thread (an unbound buffer's send/recv
  // is itself asynchronous); the Work's wait() waits for it. So a send and a recv between two
  // ranks never wait for each other's turn in the queue.
  WorkPtr send(const Tensor& t, int dst, int tag) override {
    check_p2p(t, dst, tag, "send");
    const uint64_t id = record_p2p("send", t, dst);
    auto buf = ctx_->createUnboundBuffer(t.raw_data(), t.nbytes());
    buf->send(dst, gloo::Slot::build(kP2PSlot, uint32_t(tag)));
    return std::make_shared<P2PWork>(std::move(buf), t, true, timeout(), rank_, dst, id);
  }

  WorkPtr recv(const Tensor& t, int src, int tag) override {
    check_p2p(t, src, tag, "recv");
    t.storage()->bump_version();  // Note [Storage versions]
    const uint64_t id = record_p2p("recv", t, src);
    auto buf = ctx_->createUnboundBuffer(t.raw_data(), t.nbytes());
    buf->recv(src, gloo::Slot::build(kP2PSlot, uint32_t(tag)));
    return std::make_shared<P2PWork>(std::move(buf), t, false, timeout(), rank_, src, id);
  }

  WorkPtr barrier() override {
    return enqueue("barrier", Tensor(), -1, [this](uint32_t tag) {
      gloo::BarrierOptions o(ctx_);
      o.setTag(tag);
      o.setTimeout(op_timeout_);
      gloo::barrier(o);
    });
  }

 private:
  struct Task {
    std::function<void(uint32_t)> fn;
    std::shared_ptr<GlooWork> work;
    const char* name;
    std::chrono::milliseconds timeout;  // the group's when issued
    std::string phase;
    uint64_t flight_id;
  };

  static std::string default_hostname(const std::string& master) {
    return master == "localhost" || master.rfind("127.", 0) == 0 ? "127.0.0.1" : gloo_default_host();
  }
  static std::string gloo_default_host() {
    char buf[256] = {};
    ::gethostname(buf, sizeof buf - 1);
    return buf;
  }

  void check_tensor(const Tensor& t, const char* op) const {
    BLU_CHECK(t.defined(), "gloo ", op, ": undefined tensor");
    BLU_CHECK(t.device().is_cpu(), "gloo ", op, ": expected a CPU tensor, got ", t.str(),
              " (CUDA tensors need the NCCL process group)");
    BLU_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64 || is_half(t.dtype()) || t.dtype() == DType::i32 ||
                  t.dtype() == DType::i64,
              "gloo ", op, ": expected dtype f32, f64, bf16, f16, i32 or i64, got ", t.dtype());
    BLU_CHECK(t.is_contiguous(), "gloo ", op, ": expected a contiguous tensor, got ", t.str(), " with strides ",
              t.strides());
  }
  static void check_avg(const Tensor& t, ReduceOp op, const char* what) {
    BLU_CHECK(op != ReduceOp::avg || is_floating(t.dtype()), "gloo ", what, ": avg needs a floating dtype, got ",
              t.dtype());
  }
  void check_p2p(const Tensor& t, int peer, int tag, const char* op) const {
    check_tensor(t, op);
    check_rank(peer, op);
    BLU_CHECK(peer != rank_, op, ": the peer is this rank (", rank_, ")");
    BLU_CHECK(tag >= 0, op, ": tag must be >= 0, got ", tag);
  }
  void check_rank(int r, const char* what) const {
    BLU_CHECK(r >= 0 && r < size_, "gloo: ", what, " must be a rank in [0, ", size_, "), got ", r);
  }

  template <typename T>
  static void scale(T* p, int64_t n, T s) {
    for (int64_t i = 0; i < n; ++i) p[i] *= s;
  }

  void wait_send(gloo::transport::UnboundBuffer& buf, const char* what) {
    if (!buf.waitSend(op_timeout_)) throw Error(std::string("gloo ") + what + ": send aborted");
  }
  void wait_recv(gloo::transport::UnboundBuffer& buf, const char* what) {
    if (!buf.waitRecv(op_timeout_)) throw Error(std::string("gloo ") + what + ": receive aborted");
  }

  // Ring reduce-scatter. Chunk c is in[c·n, (c+1)·n). At step s rank r sends its running sum of
  // chunk (r-s-1) mod size to rank r+1 and adds what rank r-1 sends — chunk (r-s-2) mod size —
  // into its own; after size-1 steps chunk r holds every rank's contribution.
  template <typename T>
  void ring_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, uint32_t tag) {
    ring_reduce_scatter_raw<T>(out.data<T>(), in.data<T>(), size_t(out.numel()), op, tag);
  }
  // dst[n] ← this rank's chunk of the reduction of every rank's src[n · size].
  template <typename T>
  void ring_reduce_scatter_raw(T* dst, const T* src, size_t n, ReduceOp op, uint32_t tag) {
    if (size_ == 1) {
      std::copy(src, src + n, dst);
      return;
    }
    std::vector<T> acc(src, src + n * size_t(size_)), incoming(n);
    auto acc_buf = ctx_->createUnboundBuffer(acc.data(), acc.size() * sizeof(T));
    auto in_buf = ctx_->createUnboundBuffer(incoming.data(), n * sizeof(T));
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    auto mod = [&](int x) { return size_t(((x % size_) + size_) % size_); };
    for (int s = 0; s < size_ - 1; ++s) {
      const size_t send_c = mod(rank_ - s - 1), recv_c = mod(rank_ - s - 2);
      const auto slot = gloo::Slot::build(kReduceScatterSlot, tag) + uint8_t(s);
      acc_buf->send(right, slot, send_c * n * sizeof(T), n * sizeof(T));
      in_buf->recv(left, slot, 0, n * sizeof(T));
      wait_recv(*in_buf, "reduce_scatter");
      T* a = acc.data() + recv_c * n;
      if (op == ReduceOp::max) {
        for (size_t i = 0; i < n; ++i) a[i] = std::max(a[i], incoming[i]);
      } else {
        for (size_t i = 0; i < n; ++i) a[i] += incoming[i];
      }
      wait_send(*acc_buf, "reduce_scatter");
    }
    const T* mine = acc.data() + size_t(rank_) * n;
    std::copy(mine, mine + n, dst);
    if (op == ReduceOp::avg) scale(dst, int64_t(n), T(1) / T(size_));
  }

  // `t`: the tensor whose bytes and dtype the flight recorder notes (undefined: none).
  WorkPtr enqueue(const char* name, const Tensor& t, int peer, std::function<void(uint32_t)> fn) {
    auto work = std::make_shared<GlooWork>();
    {
      std::lock_guard lock(mu_);
      const uint64_t id = FlightRecorder::global().record(flight_op(name, t, peer));
      queue_.push_back({std::move(fn), work, name, timeout(), phase_, id});
    }
    cv_.notify_all();
    return work;
  }

  // Under mu_ (reads phase_); the sequence number counts every operation of the group.
  FlightOp flight_op(const char* kind, const Tensor& t, int peer) {
    FlightOp op{.group = name_, .backend = "gloo", .kind = kind, .seq = ++seq_, .peer = peer, .phase = phase_};
    op.has_dtype = t.defined();
    if (t.defined()) {
      op.dtype = t.dtype();
      op.bytes = int64_t(t.nbytes());
    }
    return op;
  }
  uint64_t record_p2p(const char* kind, const Tensor& t, int peer) {
    std::lock_guard lock(mu_);
    const uint64_t id = FlightRecorder::global().record(flight_op(kind, t, peer));
    FlightRecorder::global().update(id, OpState::started);  // under way as soon as issued
    return id;
  }

  void run() {
    uint32_t tag = 0;
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to run
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string error;
      FlightRecorder& fr = FlightRecorder::global();
      if (!broken_.empty()) {
        error = "gloo " + std::string(task.name) + " on rank " + std::to_string(rank_) +
                ": the process group failed earlier: " + broken_;
        fr.update(task.flight_id, OpState::failed);
      } else {
        fr.update(task.flight_id, OpState::started);
        try {
          op_timeout_ = task.timeout;
          task.fn(tag++);
          fr.update(task.flight_id, OpState::completed);
        } catch (const std::exception& e) {
          // This rank's connections close first, so that a peer blocked on it fails now and joins the
          // roll call, rather than when this process ends (Note [Roll call]).
          try {
            ctx_->closeConnections();
          } catch (const std::exception&) {
          }
          error = "gloo " + std::string(task.name) + " failed on rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + (task.phase.empty() ? "" : " during " + task.phase) + " (timeout " +
                  std::to_string(task.timeout.count()) + " ms; a peer exited or stalled?): " + e.what() +
                  roll_call(task.timeout);
          broken_ = error;
          fr.update(task.flight_id, OpState::failed);
          fr.dump(error);  // before the caller sees the error (and perhaps exits)
        }
      }
      // The task's tensors go before its waiter wakes: once wait() returns, the group holds no
      // reference to them (reference counts decide ownership: Note [Donated buffers]).
      task.fn = nullptr;
      task.work->finish(std::move(error));
    }
  }
#undef BLU_DISPATCH_GLOO

  // Note [Roll call]: "" when every member answered (the failure is not a lost peer's).
  std::string roll_call(std::chrono::milliseconds timeout) {
    using namespace std::chrono;
    const milliseconds window = std::clamp<milliseconds>(timeout / 4, milliseconds(250), milliseconds(2000));
    std::vector<int> missing;  // as of the last complete look at the keys
    bool looked = false;
    // One roll call at a time in a process (a mesh's groups can fail together): one connection to
    // the store each, within its connection limit.
    static std::mutex one_at_a_time;
    std::lock_guard lock(one_at_a_time);
    try {
      StoreOptions o = store_options_;
      o.timeout = window;
      TcpStore store(store_host_, store_port_, false, o);
      const std::string prefix = name_ + "/roll_call/";
      store.set(prefix + std::to_string(rank_), "1");
      const auto deadline = steady_clock::now() + window;
      for (;;) {
        std::vector<int> now;
        for (int r = 0; r < size_; ++r)
          if (r != rank_ && !store.check({prefix + std::to_string(r)})) now.push_back(r);
        missing = std::move(now), looked = true;
        if (missing.empty() || steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(milliseconds(20));
      }
    } catch (const std::exception& e) {
      // Once the keys were read, a store that goes away is its host's process ending after its
      // own roll call: what the last look saw stands.
      if (!looked)
        return "; the roll call could not reach the job's store at " + store_host_ + ":" +
               std::to_string(store_port_) + ", so rank 0's process, which serves it, may be lost (" + e.what() + ")";
    }
    if (missing.empty()) return "";
    std::string who;
    for (size_t i = 0; i < missing.size(); ++i)
      who += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + job_ranks_[size_t(missing[i])];
    return (missing.size() == 1 ? "; rank " : "; ranks ") + who + (missing.size() == 1 ? " is" : " are") + " lost: " +
           (missing.size() == 1 ? "it" : "they") + " did not answer the group's roll call within " +
           std::to_string(window.count()) + " ms (exited or stalled)";
  }

  int rank_, size_;
  std::atomic<int64_t> timeout_;         // ms, for operations issued from now on
  std::chrono::milliseconds op_timeout_{0};  // the running operation's (worker thread only)
  std::string phase_;                     // guarded by mu_
  std::string name_;                      // the group's store prefix: its name in the flight recorder
  uint64_t seq_ = 0;                      // operations issued (guarded by mu_)
  std::shared_ptr<gloo::Context> ctx_;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  std::string broken_;  // worker thread only
  // The roll call's (Note [Roll call]): where the store is, and each member's job rank.
  std::string store_host_;
  int store_port_ = 0;
  StoreOptions store_options_;
  std::vector<std::string> job_ranks_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(TcpStore& store, int rank, int size, GlooOptions options) {
  BLU_CHECK(size >= 1, "make_gloo_group: size must be >= 1, got ", size);
  BLU_CHECK(rank >= 0 && rank < size, "make_gloo_group: rank must be in [0, ", size, "), got ", rank);
  BLU_CHECK(options.timeout.count() > 0, "make_gloo_group: timeout must be > 0 ms, got ", options.timeout.count());
  // Gloo's TCP pairs write to sockets without MSG_NOSIGNAL: a write to a peer that has just exited
  // raises SIGPIPE, whose default action kills this rank silently instead of letting the write
  // fail with EPIPE and surface as the error the failure contract promises. (Python ignores
  // SIGPIPE at start-up, which is why PyTorch's Gloo never meets this.) Left alone if the program
  // installed its own handler.
  if (struct sigaction sa{}; ::sigaction(SIGPIPE, nullptr, &sa) == 0 && sa.sa_handler == SIG_DFL)
    ::signal(SIGPIPE, SIG_IGN);
  return std::make_shared<GlooGroup>(store, rank, size, options);
}

}  // namespace blu::dist
