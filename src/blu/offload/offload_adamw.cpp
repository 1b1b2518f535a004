// offload/offload_adamw: AdamW over host-held state (header).
#include "blu/offload/offload_adamw.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "blu/core/grad_mode.h"
#include "blu/memory/memory_report.h"
#include "blu/nn/compute_copy.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace blu::offload {

namespace {
constexpr const char* kName = "OffloadAdamW";

Tensor flat(const Tensor& t) { return view(t, {t.numel()}); }
Tensor piece(const Tensor& t, int64_t off, int64_t len) { return narrow(flat(t), 0, off, len); }
}  // namespace

const char* update_name(UpdateOn u) { return u == UpdateOn::cpu ? "cpu" : "gpu"; }
UpdateOn parse_update(const std::string& name) {
  if (name == "cpu") return UpdateOn::cpu;
  if (name == "gpu" || name == "device") return UpdateOn::device;
  BLU_CHECK(false, "--offload-update: expected cpu, gpu or auto, got '", name, "'");
  return UpdateOn::cpu;
}

struct OffloadAdamW::State {
  Tensor exp_avg, exp_avg_sq;  // host, f32, the parameter's shape
  Tensor master;  // host update only: the fp32 master weights
  Tensor grad;    // gradients on the host (released parameters): the step's accumulator
  int64_t step = 0;
  std::weak_ptr<Storage> uploaded;  // the device storage master was last copied to / from ...
  uint64_t version = 0;             // ... and its version then (released: when a host view began)
  // Masters on the host: the parameter's device bytes are released and master is its value.
  bool released = false;
  // Gradients on the host: grad accumulates the step's micro-batches (micro of them so far); the
  // first lands there (grad_landed: null on a CPU pool, whose copies are done when queued), each
  // later one in a slot of the down ring (landing: its index, -1 none) until added in.
  EventPtr grad_landed;
  int64_t landing = -1;
  int64_t micro = 0;
};

// One step of the host update: its pieces (at most chunk_elements each) in the order they are
// updated, and the progress of its staging ring (Note [Gradient staging]).
struct OffloadAdamW::HostJob {
  struct Piece {
    size_t param;
    int64_t offset, length;
    bool staged;   // its gradient comes through the staging ring (else: the host accumulator)
    Tensor grad;   // staged: the device gradient, taken from the parameter by step()
    int64_t block; // the first block that reads the parameter (-1: none, or no overlap)
  };
  std::vector<Piece> pieces;
  std::vector<size_t> staged;  // indices into pieces, in ring order
  size_t issued = 0;           // staged pieces whose copy down is queued
  size_t next_staged = 0;      // the next staged piece to update
  GateDecision decision;
  double lr = 0;
  int threads = 0;  // the host AdamW's (0: OpenMP's default)
};

// Note [Update behind the forward]: the worker and what it shares with the calling thread.
struct OffloadAdamW::Overlap {
  std::vector<int64_t> block_of;  // per parameter: the first block that reads it, -1 none
  size_t blocks = 0;
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  // Under mu: the job handed over (empty once taken), whether it has finished, what it threw, and
  // how many blocks have their uploads queued (block_in[b]: the in lane after block b's).
  std::function<void()> job;
  bool finished = false, quit = false;
  std::exception_ptr error;
  size_t ready = 0;
  std::vector<EventPtr> block_in;
  std::function<void(size_t)> hook;  // set_worker_hook
  // The calling thread's: a job handed over and not yet joined, and its pieces, whose gradients
  // this thread lets go of block by block as the forward passes them (released: the pieces let go).
  bool active = false;
  std::shared_ptr<HostJob> running;
  size_t released = 0;
  void release_until(int64_t block) {  // the gradients of the pieces up to `block`, whose copies are done
    for (; released < running->pieces.size() && running->pieces[released].block <= block; ++released)
      running->pieces[released].grad = Tensor();
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return quit || job; });
      if (quit) return;
      std::function<void()> f = std::move(job);
      job = nullptr;
      lock.unlock();
      std::exception_ptr err;
      try {
        f();
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      error = err;
      finished = true;
      cv.notify_all();
    }
  }
  void publish(size_t b, EventPtr e) {
    std::lock_guard<std::mutex> lock(mu);
    block_in[b] = std::move(e);
    ready = b + 1;
    cv.notify_all();
  }
};

OffloadAdamW::OffloadAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt, OffloadOptions options)
    : opt_(opt), options_(options) {
  BLU_CHECK(opt.lr >= 0 && opt.beta1 >= 0 && opt.beta1 < 1 && opt.beta2 >= 0 && opt.beta2 < 1 && opt.eps >= 0, kName,
            ": lr >= 0, beta1 and beta2 in [0, 1), eps >= 0 expected, got lr ", opt.lr, ", betas ", opt.beta1, ", ",
            opt.beta2, ", eps ", opt.eps);
  BLU_CHECK(options.chunk_elements >= 1, kName, ": chunk_elements must be >= 1, got ", options.chunk_elements);
  BLU_CHECK(opt.state_dtype == DType::f32, kName, ": offloaded moments are f32; bf16 moments (--adamw-state bf16) ",
            "are held on the device only, got ", opt.state_dtype);
  BLU_CHECK(!options.masters_on_host || options.update == UpdateOn::cpu, kName,
            ": fp32 masters on the host need the host update (--offload-update cpu), got ", update_name(options.update));
  BLU_CHECK(!options.grads_on_host || options.masters_on_host, kName,
            ": gradients on the host need the masters there too (masters_on_host)");
  BLU_CHECK(options.grad_window_bytes >= 0, kName, ": grad_window_bytes must be >= 0, got ", options.grad_window_bytes);
  self_ = std::make_shared<OffloadAdamW*>(this);
  groups_ = std::move(groups);
  lr_ = opt.lr;
  for (const optim::detail::ParamRef& p : optim::detail::flatten_groups(groups_, kName)) {
    names_.push_back(p.name);
    params_.push_back(p.param);
    decay_.push_back(p.weight_decay);
  }
  BLU_CHECK(!params_.empty(), kName, ": no parameters");
  device_ = params_.front().device();
  for (size_t i = 0; i < params_.size(); ++i) {
    BLU_CHECK(params_[i].device() == device_, kName, ": every parameter must be on one device: '", names_[i], "' is on ",
              params_[i].device(), ", '", names_.front(), "' on ", device_);
    BLU_CHECK(params_[i].is_contiguous(), kName, ": parameter '", names_[i], "' is not contiguous");
    state_.push_back(std::make_unique<State>());
  }
  engine_ = make_copy_engine(device_);
  copies_.resize(params_.size());
  if (options_.update == UpdateOn::device) {
    int64_t total = 0;
    for (const Tensor& p : params_) total += p.numel();
    const int64_t chunk = std::min(options_.chunk_elements, total);
    for (int b = 0; b < 2; ++b) {
      stage_m_[b] = empty({chunk}, DType::f32, device_);
      stage_v_[b] = empty({chunk}, DType::f32, device_);
      tag_memory(stage_m_[b], MemoryCategory::optimizer_state, "offload staging (exp_avg)");
      tag_memory(stage_v_[b], MemoryCategory::optimizer_state, "offload staging (exp_avg_sq)");
    }
    // The caching allocator hands back a block freed by the current stream at once, though work
    // that stream has queued may still write it: the first uploads into the staging buffers, on
    // the in lane, wait for that work.
    pending_out_ = engine_->record(Lane::compute);
  }
}

OffloadAdamW::~OffloadAdamW() {
  if (overlap_) {
    try {
      finish_update();
    } catch (...) {  // a destructor does not throw; the error was the step's to report
    }
    {
      std::lock_guard<std::mutex> lock(overlap_->mu);
      overlap_->quit = true;
    }
    overlap_->cv.notify_all();
    overlap_->worker.join();
  }
  self_.reset();
  if (engine_) engine_->host_wait(nullptr);
  // Released parameters keep their values: each takes over its master's host bytes (it is on the
  // CPU from now on; nothing is allocated on the device here).
  for (size_t i = 0; i < state_.size(); ++i)
    if (state_[i]->released) params_[i].storage()->data = std::move(state_[i]->master.storage()->data);
}

bool OffloadAdamW::released(size_t i) const { return state_.at(i)->released; }

void OffloadAdamW::overlap_with_forward(const std::vector<std::vector<std::string>>& blocks) {
  BLU_CHECK(options_.update == UpdateOn::cpu, kName, ": the update runs behind the forward only on the host ",
            "(--offload-update cpu), got ", update_name(options_.update));
  BLU_CHECK(!overlap_, kName, ": overlap_with_forward called twice");
  auto ov = std::make_unique<Overlap>();
  ov->blocks = blocks.size();
  ov->block_in.resize(blocks.size());
  ov->block_of.assign(params_.size(), -1);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < names_.size(); ++i) index[names_[i]] = i;
  for (size_t b = 0; b < blocks.size(); ++b)
    for (const std::string& name : blocks[b]) {
      const auto it = index.find(name);
      BLU_CHECK(it != index.end(), kName, ": block ", b, " reads '", name, "', which is not one of its parameters");
      if (ov->block_of[it->second] < 0) ov->block_of[it->second] = int64_t(b);
    }
  overlap_ = std::move(ov);
  overlap_->worker = std::thread([ov = overlap_.get()] { ov->loop(); });
}

void OffloadAdamW::wait_block(size_t b) {
  Overlap* ov = overlap_.get();
  if (!ov || !ov->active) return;
  BLU_CHECK(b < ov->blocks, kName, ": wait_block(", b, ") of ", ov->blocks, " blocks");
  EventPtr e;
  bool failed = false;
  {
    std::unique_lock<std::mutex> lock(ov->mu);
    ov->cv.wait(lock, [&] { return ov->ready > b || ov->finished; });
    failed = ov->ready <= b;  // finished early: it threw
    if (!failed) e = ov->block_in[b];
  }
  if (failed) {
    finish_update();  // rethrows
    return;
  }
  engine_->wait(Lane::compute, e);
  ov->release_until(int64_t(b));  // the forward's activations may take their bytes
}

void OffloadAdamW::set_worker_hook(std::function<void(size_t)> hook) {
  BLU_CHECK(overlap_, kName, ": set_worker_hook needs overlap_with_forward first");
  finish_update();
  overlap_->hook = std::move(hook);
}

void OffloadAdamW::finish_update() const {
  Overlap* ov = overlap_.get();
  if (!ov || !ov->active) return;
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(ov->mu);
    ov->cv.wait(lock, [&] { return ov->finished; });
    err = ov->error;
    ov->error = nullptr;
    ov->finished = false;
    ov->ready = 0;
    for (EventPtr& e : ov->block_in) e = nullptr;
  }
  ov->active = false;
  ov->running.reset();  // the rest of the step's device gradients go back to the allocator
  ov->released = 0;
  if (err) std::rethrow_exception(err);
  engine_->wait(Lane::compute, pending_in_);  // whatever reads a parameter next, after its upload
}

int64_t OffloadAdamW::release_parameters(const std::function<bool(const std::string&, const Tensor&)>& release) {
  BLU_CHECK(options_.masters_on_host, kName, ": release_parameters needs masters_on_host");
  finish_update();
  NoGradGuard no_grad;
  std::map<const Storage*, int> views;  // parameter handles per storage: only a storage's sole view leaves
  for (const Tensor& p : params_) ++views[p.storage().get()];
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    State& s = *state_[i];
    const Tensor copy = copies_[i] ? copies_[i]->target(p) : Tensor();
    if (s.released || !copy.defined() || !copies_[i]->current(p) || views[p.storage().get()] != 1 ||
        p.offset() != 0 || int64_t(p.storage()->nbytes()) != p.numel() * int64_t(sizeof(float)) ||
        !release(names_[i], p))
      continue;
    ensure_state(i);
    refresh_master(i);  // waits for the copy: the device bytes can go
    BLU_ASSERT(up_.empty() || up_.front().buf.dtype() == copy.dtype(), kName, ": compute copies of two dtypes");
    if (up_.empty()) up_.resize(kRingSlots);
    const int64_t slot_elements = std::min(p.numel(), options_.chunk_elements);
    for (Slot& slot : up_)
      if (!slot.buf.defined() || slot.buf.numel() < slot_elements)
        slot.buf = empty_from(host_allocator_for(device_), {slot_elements}, copy.dtype());
    if (options_.grads_on_host) s.grad = empty_from(host_allocator_for(device_), p.shape(), DType::f32);
    s.released = true;
    p.storage()->data = DataPtr(nullptr, 0, device_, nullptr, nullptr);
    if (options_.grads_on_host) {
      params_[i].register_grad_hook([weak = std::weak_ptr<OffloadAdamW*>(self_), i](Tensor& g) {
        if (const auto self = weak.lock()) (*self)->land_gradient(i, g);
      });
    }
    n += p.numel();
  }
  return n;
}

void OffloadAdamW::land_gradient(size_t i, const Tensor& g) {
  NoGradGuard no_grad;
  State& s = *state_[i];
  BLU_CHECK(g.dtype() == DType::f32 && g.shape() == params_[i].shape() && g.is_contiguous() && g.device() == device_,
            kName, ": gradient of '", names_[i], "' is ", g.str(), ", expected a contiguous f32 tensor of the ",
            "parameter's shape on ", device_);
  engine_->wait(Lane::out, engine_->record(Lane::compute));  // after the backward that made it
  EventPtr landed;
  if (s.micro == 0) {
    engine_->copy(s.grad, g, Lane::out);
    landed = s.grad_landed = engine_->record(Lane::out);
  } else {
    add_landed(i);  // this parameter's previous micro-batch first: the sum keeps their order
    if (down_.empty()) {  // the first accumulation: slots of the largest released parameter's size
      int64_t largest = 0;
      for (size_t j = 0; j < params_.size(); ++j)
        if (state_[j]->released) largest = std::max(largest, params_[j].numel());
      for (int k = 0; k < kRingSlots; ++k)
        down_.push_back({.buf = empty_from(host_allocator_for(device_), {largest}, DType::f32)});
    }
    const size_t k = down_next_;
    down_next_ = (k + 1) % down_.size();
    complete_landing(k);  // another parameter's micro-batch still in it: added in now
    engine_->copy(view(narrow(down_[k].buf, 0, 0, g.numel()), g.shape()), g, Lane::out);
    landed = down_[k].done = engine_->record(Lane::out);
    down_[k].param = int64_t(i);
    s.landing = int64_t(k);
  }
  ++s.micro;
  if (landed) {  // an asynchronous copy (a CPU pool's is done when queued)
    in_flight_bytes_ += int64_t(g.nbytes());
    in_flight_.push_back({g, landed});
  }
  // The parameter holds no device gradient; the next micro-batch's starts afresh. (g is the
  // parameter's gradient slot: not used after this.)
  params_[i].zero_grad();
  while (in_flight_bytes_ > options_.grad_window_bytes && !in_flight_.empty()) {
    engine_->wait(Lane::compute, in_flight_.front().copied);  // later kernels may reuse its bytes
    in_flight_bytes_ -= int64_t(in_flight_.front().grad.nbytes());
    in_flight_.pop_front();
  }
}

void OffloadAdamW::add_landed(size_t i) {
  if (state_[i]->landing >= 0) complete_landing(size_t(state_[i]->landing));
}

void OffloadAdamW::complete_landing(size_t k) {
  Slot& slot = down_[k];
  if (slot.param < 0) return;
  State& s = *state_[size_t(slot.param)];
  if (s.grad_landed) engine_->host_wait(s.grad_landed);  // (a null event would wait for every lane)
  if (slot.done) engine_->host_wait(slot.done);
  add_host(s.grad.data<float>(), slot.buf.data<float>(), s.grad.numel(), options_.threads);
  s.landing = -1;
  slot.param = -1;
}

size_t OffloadAdamW::next_up_slot() {
  const size_t k = up_next_;
  up_next_ = (k + 1) % up_.size();
  if (up_[k].done) engine_->host_wait(up_[k].done);  // its last upload has read it
  up_[k].done = nullptr;
  return k;
}

void OffloadAdamW::drain_in_flight() {
  for (const InFlight& f : in_flight_) engine_->host_wait(f.copied);  // never null: only async copies wait here
  in_flight_.clear();
  in_flight_bytes_ = 0;
}

double OffloadAdamW::finish_host_gradients() {
  finish_update();
  double total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    State& s = *state_[i];
    if (!s.released || s.micro == 0) continue;
    if (s.grad_landed) engine_->host_wait(s.grad_landed);
    add_landed(i);
    total += sum_squares_host(s.grad.data<float>(), s.grad.numel(), options_.threads);
  }
  drain_in_flight();
  return total;
}

void OffloadAdamW::zero_host_gradients() {
  drain_in_flight();
  for (Slot& slot : down_) {
    if (slot.done) engine_->host_wait(slot.done);
    slot.param = -1;
  }
  for (auto& s : state_) {
    s->micro = 0;
    s->landing = -1;
  }
}

void OffloadAdamW::upload_copy(size_t i, size_t k, int64_t offset, int64_t length) {
  const Tensor copy = copies_[i]->target(params_[i]);
  BLU_ASSERT(copy.defined(), kName, ": released parameter '", names_[i], "' lost its compute copy");
  engine_->copy(piece(copy, offset, length), narrow(up_[k].buf, 0, 0, length), Lane::in);
  up_[k].done = engine_->record(Lane::in);
  if (offset + length == copy.numel()) copies_[i]->mark_written(params_[i]);
}

OffloadAdamW::HostView::HostView(OffloadAdamW* opt) : opt_(opt) {
  if (opt_) opt_->view_masters();
}
OffloadAdamW::HostView::~HostView() {
  if (opt_) opt_->end_view();
}

void OffloadAdamW::view_masters() {
  finish_update();
  engine_->host_wait(nullptr);
  for (size_t i = 0; i < params_.size(); ++i) {
    State& s = *state_[i];
    if (!s.released) continue;
    Storage& st = *params_[i].storage();
    st.data = DataPtr(s.master.raw_data(), s.master.nbytes(), s.master.device(), nullptr, nullptr);
    s.version = st.version();
  }
}

// A master written through the view (a checkpoint load) goes into its compute copy: the host's
// to_dtype, which rounds as the device's does.
void OffloadAdamW::end_view() {
  NoGradGuard no_grad;
  bool uploaded = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    State& s = *state_[i];
    if (!s.released) continue;
    Storage& st = *params_[i].storage();
    const bool written = st.version() != s.version;
    st.data = DataPtr(nullptr, 0, device_, nullptr, nullptr);
    if (!written) continue;
    const int64_t n = s.master.numel(), cap = up_.front().buf.numel();
    for (int64_t off = 0; off < n; off += cap) {
      const int64_t len = std::min(cap, n - off);
      const size_t k = next_up_slot();
      const Tensor staged = narrow(up_[k].buf, 0, 0, len);
      copy_(staged, to_dtype(piece(s.master, off, len), staged.dtype()));
      upload_copy(i, k, off, len);
    }
    uploaded = true;
  }
  if (!uploaded) return;
  pending_in_ = engine_->record(Lane::in);
  engine_->wait(Lane::compute, pending_in_);
}

int64_t OffloadAdamW::staging_bytes(const OffloadOptions& o, int64_t total_elements) {
  if (o.update != UpdateOn::device) return 0;
  return 2 * 2 * int64_t(sizeof(float)) * std::min(o.chunk_elements, total_elements);
}

void OffloadAdamW::attach_compute_copies(const nn::ComputeCopies& copies) {
  finish_update();
  for (size_t i = 0; i < params_.size(); ++i)
    for (const auto& [t, c] : copies)
      if (t.is_same(params_[i])) copies_[i] = c;
}

void OffloadAdamW::ensure_state(size_t i) {
  State& s = *state_[i];
  Allocator& host = host_allocator_for(device_);
  const Tensor& p = params_[i];
  if (!s.exp_avg.defined()) {
    s.exp_avg = empty_from(host, p.shape(), DType::f32);
    s.exp_avg_sq = empty_from(host, p.shape(), DType::f32);
    std::memset(s.exp_avg.raw_data(), 0, s.exp_avg.nbytes());
    std::memset(s.exp_avg_sq.raw_data(), 0, s.exp_avg_sq.nbytes());
  }
  if (options_.update == UpdateOn::cpu && !s.master.defined()) s.master = empty_from(host, p.shape(), DType::f32);
}

// The master must equal the device parameter: re-read it when anyone else wrote the parameter
// since the last upload (its storage or version moved).
void OffloadAdamW::refresh_master(size_t i) {
  State& s = *state_[i];
  const Tensor& p = params_[i];
  if (s.uploaded.lock() == p.storage() && s.version == p.storage()->version()) return;
  engine_->copy(s.master, p, Lane::out);
  engine_->host_wait(engine_->record(Lane::out));
  s.uploaded = p.storage();
  s.version = p.storage()->version();
}

void OffloadAdamW::step(const NormGate& gate) {
  NoGradGuard no_grad;
  finish_update();
  if (options_.update == UpdateOn::cpu)
    step_on_host(gate);
  else
    step_on_device(gate);
  ++steps_;
}

void OffloadAdamW::step_on_host(const NormGate& gate) {
  // The host rewrites the masters the last step's uploads read.
  engine_->host_wait(pending_in_);
  const EventPtr grads_ready = engine_->record(Lane::compute);
  engine_->wait(Lane::out, grads_ready);
  // The update runs piece by piece (at most chunk_elements each). A piece whose gradient is on the
  // device comes down into a slot of the staging ring (kRingSlots ahead of the update), so the
  // host holds no gradient of its own for it (Note [Gradient staging]).
  auto job = std::make_shared<HostJob>();
  job->lr = lr_;
  job->threads = options_.threads;
  std::vector<HostJob::Piece>& pieces = job->pieces;
  int64_t stage_elements = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    State& s = *state_[i];
    const bool on_host = s.released && options_.grads_on_host;
    Tensor g;
    if (on_host) {  // on the host already (finish_host_gradients)
      if (s.micro == 0) continue;
    } else {
      g = params_[i].grad();
      if (!g.defined()) continue;
      BLU_CHECK(g.dtype() == DType::f32 && g.shape() == params_[i].shape() && g.is_contiguous(), kName,
                ": gradient of '", names_[i], "' is ", g.str(), ", expected a contiguous f32 tensor of the ",
                "parameter's shape");
      ensure_state(i);
      if (!s.released) refresh_master(i);
    }
    if (params_[i].numel() > 0) {
      ++s.step;  // counted even when the gate skips the update, as AdamW counts it
      s.micro = 0;
    }
    const int64_t block = overlap_ ? overlap_->block_of[i] : -1;
    for (int64_t off = 0, n = params_[i].numel(); off < n; off += options_.chunk_elements) {
      const int64_t len = std::min(options_.chunk_elements, n - off);
      if (!on_host) stage_elements = std::max(stage_elements, len);
      pieces.push_back({i, off, len, !on_host, on_host ? Tensor() : piece(g, off, len), block});
    }
  }
  // The parameters no block reads first, then block by block (the order the forward reads them);
  // the update is elementwise, so the order changes no bit.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const HostJob::Piece& a, const HostJob::Piece& b) { return a.block < b.block; });
  for (size_t t = 0; t < pieces.size(); ++t)
    if (pieces[t].staged) job->staged.push_back(t);
  if (stage_.empty() && stage_elements > 0) stage_.resize(kRingSlots);
  for (Slot& slot : stage_)
    if (!slot.buf.defined() || slot.buf.numel() < stage_elements) {
      if (slot.done) engine_->host_wait(slot.done);
      slot.buf = empty_from(host_allocator_for(device_), {stage_elements}, DType::f32);
      slot.done = nullptr;
    }
  issue_staged(*job, stage_.size());
  // The gate's total, read once (the host decides the clip as the kernels do on the device).
  double total = -1;
  if (gate.defined()) {
    const Tensor t = to_device(gate.sum_squares, kCPU);
    total = t.dtype() == DType::f64 ? *t.data<double>() : double(*t.data<float>());
  }
  job->decision = GateDecision::from_total(total, gate.max_norm);
  const size_t rest = size_t(std::find_if(pieces.begin(), pieces.end(), [](const HostJob::Piece& p) {
                               return p.block >= 0;
                             }) - pieces.begin());
  run_pieces(*job, 0, rest);
  if (rest == pieces.size()) {
    pending_in_ = engine_->record(Lane::in);
    engine_->wait(Lane::compute, pending_in_);  // the next forward reads the new parameters
    return;
  }
  // Note [Update behind the forward]: the blocks' pieces on the worker; the next forward's block
  // hooks wait for them.
  engine_->wait(Lane::compute, engine_->record(Lane::in));  // the embedding and the head's uploads
  // The worker's update leaves a core to the thread that queues the forward.
  if (options_.threads <= 0) job->threads = threads_beside_one();
  Overlap& ov = *overlap_;
  ov.running = job;
  ov.active = true;
  ov.released = 0;
  ov.release_until(-1);
  {
    std::lock_guard<std::mutex> lock(ov.mu);
    ov.job = [this, job = job.get(), rest] {
      size_t begin = rest;
      for (size_t b = 0; b < overlap_->blocks; ++b) {
        size_t end = begin;
        while (end < job->pieces.size() && job->pieces[end].block == int64_t(b)) ++end;
        if (overlap_->hook) overlap_->hook(b);
        run_pieces(*job, begin, end);
        overlap_->publish(b, engine_->record(Lane::in));
        begin = end;
      }
      pending_in_ = engine_->record(Lane::in);
    };
  }
  ov.cv.notify_all();
}

// Staged piece t goes into slot t % kRingSlots once piece t - kRingSlots has been updated.
void OffloadAdamW::issue_staged(HostJob& job, size_t until) {
  for (; job.issued < std::min(until, job.staged.size()); ++job.issued) {
    const HostJob::Piece& pc = job.pieces[job.staged[job.issued]];
    Slot& slot = stage_[job.issued % stage_.size()];
    engine_->copy(narrow(slot.buf, 0, 0, pc.length), pc.grad, Lane::out);
    slot.done = engine_->record(Lane::out);
  }
}

void OffloadAdamW::run_pieces(HostJob& job, size_t begin, size_t end) {
  const GateDecision& decision = job.decision;
  for (size_t t = begin; t < end; ++t) {
    const HostJob::Piece& pc = job.pieces[t];
    const size_t i = pc.param;
    State& s = *state_[i];
    const float* g = nullptr;
    if (pc.staged) {
      issue_staged(job, job.next_staged + stage_.size());
      Slot& slot = stage_[job.next_staged % stage_.size()];
      if (slot.done) engine_->host_wait(slot.done);
      g = slot.buf.data<float>();
      ++job.next_staged;
    } else {
      g = s.grad.data<float>() + pc.offset;
    }
    if (decision.skip) continue;
    const auto k = AdamWCoefficients::make(job.lr, opt_.beta1, opt_.beta2, opt_.eps, decay_[i], s.step);
    float* const master = s.master.data<float>() + pc.offset;
    float* const m = s.exp_avg.data<float>() + pc.offset;
    float* const v = s.exp_avg_sq.data<float>() + pc.offset;
    if (s.released) {  // the master is the parameter; its rounding goes up into the compute copy
      const size_t slot = next_up_slot();
      adamw_host_update(master, g, m, v, static_cast<uint16_t*>(up_[slot].buf.raw_data()), up_[slot].buf.dtype(),
                        pc.length, k, decision, job.threads);
      upload_copy(i, slot, pc.offset, pc.length);
      continue;
    }
    adamw_host_update(master, g, m, v, nullptr, DType::bf16, pc.length, k, decision, job.threads);
    engine_->copy(piece(params_[i], pc.offset, pc.length), piece(s.master, pc.offset, pc.length), Lane::in);
    if (pc.offset + pc.length == params_[i].numel()) {
      s.uploaded = params_[i].storage();
      s.version = params_[i].storage()->version();
    }
  }
}

void OffloadAdamW::step_on_device(const NormGate& gate) {
  struct Piece {
    size_t param;
    int64_t offset, length, at;  // at: offset in the chunk's staging buffer
  };
  // Pieces of the parameters that have gradients, cut into chunks of at most chunk_elements.
  const int64_t chunk_cap = stage_m_[0].numel();
  std::vector<std::vector<Piece>> chunks(1);
  int64_t used = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    BLU_CHECK(g.dtype() == DType::f32 && g.shape() == params_[i].shape() && g.is_contiguous(), kName, ": gradient of '",
              names_[i], "' is ", g.str(), ", expected a contiguous f32 tensor of the parameter's shape");
    ensure_state(i);
    ++state_[i]->step;
    for (int64_t off = 0, n = params_[i].numel(); off < n;) {
      if (used == chunk_cap) {
        chunks.emplace_back();
        used = 0;
      }
      const int64_t len = std::min(n - off, chunk_cap - used);
      chunks.back().push_back({i, off, len, used});
      used += len;
      off += len;
    }
  }
  stream_through_slots(
      *engine_, chunks.size(), pending_out_,
      [&](size_t c, int b) {
        for (const Piece& pc : chunks[c]) {
          const State& s = *state_[pc.param];
          engine_->copy(narrow(stage_m_[b], 0, pc.at, pc.length), piece(s.exp_avg, pc.offset, pc.length), Lane::in);
          engine_->copy(narrow(stage_v_[b], 0, pc.at, pc.length), piece(s.exp_avg_sq, pc.offset, pc.length), Lane::in);
        }
      },
      [&](size_t c, int b) {
        // One adamw_step op per (weight decay, step count, compute-copy dtype), as AdamW batches them.
        std::map<std::tuple<double, int64_t, DType>, std::vector<AdamWTensors>> batches;
        for (const Piece& pc : chunks[c]) {
          const size_t i = pc.param;
          const Tensor copy = copies_[i] ? copies_[i]->target(params_[i]) : Tensor();
          batches[{decay_[i], state_[i]->step, copy.defined() ? copy.dtype() : DType::f32}].push_back(
              {piece(params_[i], pc.offset, pc.length), piece(params_[i].grad(), pc.offset, pc.length),
               narrow(stage_m_[b], 0, pc.at, pc.length), narrow(stage_v_[b], 0, pc.at, pc.length),
               copy.defined() ? piece(copy, pc.offset, pc.length) : Tensor()});
        }
        for (const auto& [key, tensors] : batches)
          adamw_step_(tensors,
                      {.lr = lr_, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps,
                       .weight_decay = std::get<0>(key), .step = std::get<1>(key)},
                      gate);
      },
      [&](size_t c, int b) {
        for (const Piece& pc : chunks[c]) {
          const State& s = *state_[pc.param];
          engine_->copy(piece(s.exp_avg, pc.offset, pc.length), narrow(stage_m_[b], 0, pc.at, pc.length), Lane::out);
          engine_->copy(piece(s.exp_avg_sq, pc.offset, pc.length), narrow(stage_v_[b], 0, pc.at, pc.length), Lane::out);
        }
      });
  // Every parameter with a copy was written together with it, by the ops above.
  for (size_t i = 0; i < params_.size(); ++i)
    if (copies_[i] && params_[i].grad().defined() && copies_[i]->target(params_[i]).defined())
      copies_[i]->mark_written(params_[i]);
}

nn::NamedTensors OffloadAdamW::state() const {
  finish_update();
  engine_->host_wait(nullptr);  // the downloads of the last step have landed
  nn::NamedTensors out;
  out.emplace_back("step", optim::detail::count_tensor(steps_));
  for (size_t i = 0; i < params_.size(); ++i) {
    const State& s = *state_[i];
    if (s.step == 0) continue;
    out.emplace_back("exp_avg." + names_[i], s.exp_avg);
    out.emplace_back("exp_avg_sq." + names_[i], s.exp_avg_sq);
    out.emplace_back("step." + names_[i], optim::detail::count_tensor(s.step));
  }
  return out;
}

void OffloadAdamW::load_state(const nn::NamedTensors& state) {
  NoGradGuard no_grad;
  std::vector<optim::detail::ParamRef> refs;
  for (size_t i = 0; i < params_.size(); ++i) refs.push_back({names_[i], params_[i], decay_[i]});
  optim::detail::ParsedState parsed = optim::detail::parse_state(
      state, refs, {{"exp_avg", false}, {"exp_avg_sq", false}, {"step", true}}, kName);
  finish_update();
  engine_->host_wait(nullptr);
  std::vector<std::unique_ptr<State>> next;
  Allocator& host = host_allocator_for(device_);
  for (size_t i = 0; i < params_.size(); ++i) {
    next.push_back(std::make_unique<State>());
    State& s = *next.back();
    if (State& old = *state_[i]; old.released) {  // the master is the parameter: it stays
      s.released = true;
      s.master = old.master;
      s.grad = old.grad;
      s.version = old.version;
    }
    const auto& t = parsed.per_param[i];
    if (t.empty()) continue;
    s.step = optim::detail::read_count(t[2], "step." + names_[i]);
    BLU_CHECK(s.step > 0, kName, " state: 'step.", names_[i], "' is 0 but moments are present");
    s.exp_avg = empty_from(host, params_[i].shape(), DType::f32);
    s.exp_avg_sq = empty_from(host, params_[i].shape(), DType::f32);
    copy_(s.exp_avg, to_device(t[0], kCPU));
    copy_(s.exp_avg_sq, to_device(t[1], kCPU));
  }
  state_ = std::move(next);  // masters of resident parameters are re-read from them at the next step
  steps_ = parsed.step;
}

}  // namespace blu::offload
