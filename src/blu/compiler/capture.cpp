#include "blu/compiler/capture.h"

#include <algorithm>
#include <atomic>

namespace blu::compiler {

static thread_local Capture* t_active = nullptr;

Capture* Capture::active() { return t_active; }

Capture::Capture() {
  static std::atomic<uint64_t> next{1};
  serial_ = next++;
  BLU_CHECK(!t_active, "compiler capture: a step is already being captured on this thread");
  t_active = this;
  observer_ = add_op_observer([this](const OpDef& op, std::span<const Tensor> in, std::span<const Tensor> out,
                                     const Attrs& attrs) {
    if (t_active == this) on_op(op, in, out, attrs);
  });
  meta_ = std::make_unique<MetaDispatchGuard>();
  set_ref_counter([this](const Tensor& t) { return eager_counts(t); });
}

Capture::~Capture() {
  if (!finished_) {
    meta_.reset();
    set_ref_counter({});
    remove_op_observer(observer_);
    t_active = nullptr;
  }
}

Capture::Pause::Pause(Capture& c) : c_(c) {
  t_active = nullptr;
  set_ref_counter({});
}

Capture::Pause::~Pause() {
  t_active = &c_;
  set_ref_counter([c = &c_](const Tensor& t) { return c->eager_counts(t); });
}

void Capture::notify() {
  if (!listener_) return;
  Pause pause(*this);
  listener_();
}

// What an eager step would count: an impl that only our tensors_ hold is one it would have dropped
// by now (it counts 0 towards its storage), our handles to an impl are not its, and storages_
// holds one reference to each buffer's storage.
RefCounts Capture::eager_counts(const Tensor& t) const {
  const Storage* s = t.storage().get();
  RefCounts c{t.impl_ptr().use_count(), t.storage().use_count()};
  if (buffer_ids_.find(s) == buffer_ids_.end()) return c;
  const std::vector<int>& values = values_on_[size_t(buffer_ids_.at(s))];
  // Impls on the storage and our handles to each (a few per storage: a flat list, no map nodes),
  // with one of our tensors of each impl.
  struct Ours {
    const TensorImpl* impl;
    long handles;
    const Tensor* any;
  };
  std::vector<Ours> ours;
  ours.reserve(values.size());
  for (int v : values) {
    const Tensor& held = tensors_[size_t(v)];
    auto it = std::find_if(ours.begin(), ours.end(), [&](const Ours& o) { return o.impl == held.impl_ptr().get(); });
    if (it == ours.end()) ours.push_back({held.impl_ptr().get(), 1, &held});
    else ++it->handles;
  }
  c.storage -= 1;
  for (const Ours& o : ours) {
    if (o.impl == t.impl_ptr().get()) c.impl -= o.handles;
    if (o.any->impl_ptr().use_count() == o.handles) --c.storage;
  }
  return c;
}

void Capture::classify(const Tensor& t, BufferKind kind, const std::string& name) {
  if (t.defined()) classes_[t.storage().get()] = {kind, name};
}

void Capture::reserve_like(const Graph& like) {
  graph_.ops.reserve(like.ops.size());
  graph_.values.reserve(like.values.size());
  graph_.buffers.reserve(like.buffers.size());
  tensors_.reserve(like.values.size());
  version_.reserve(like.values.size());
  value_ids_.reserve(like.values.size());
  storages_.reserve(like.buffers.size());
  values_on_.reserve(like.buffers.size());
  latest_.reserve(like.buffers.size());
  buffer_ids_.reserve(like.buffers.size());
}

int Capture::buffer_of(const Tensor& t, BufferKind kind_if_new) {
  const Storage* s = t.storage().get();
  if (auto it = buffer_ids_.find(s); it != buffer_ids_.end()) return it->second;
  Buffer b;
  b.nbytes = s->nbytes();
  b.device = s->device();
  b.kind = kind_if_new;
  if (kind_if_new != BufferKind::temporary) {
    BLU_CHECK(s->ptr() != nullptr || s->nbytes() == 0, "compiler capture: the step reads ", t.str(),
              ", which no captured op made and which has no bytes");
    if (auto c = classes_.find(s); c != classes_.end()) {
      b.kind = c->second.first;
      b.name = c->second.second;
    } else if (shared_classes_) {
      if (auto n = shared_classes_->find(s); n != shared_classes_->end()) {
        b.kind = n->second.first;
        b.name = n->second.second;
      }
    }
  }
  const int id = graph_.add_buffer(std::move(b));
  buffer_ids_.emplace(s, id);
  storages_.push_back(t.storage());
  values_on_.emplace_back();
  latest_.push_back(-1);
  return id;
}

int Capture::new_value(const Tensor& t, int buffer, int producer, bool writes) {
  Value v;
  v.buffer = buffer;
  v.shape = t.shape();
  v.strides = t.strides();
  v.offset = t.offset();
  v.dtype = t.dtype();
  v.device = t.device();
  v.producer = producer;
  const int id = graph_.add_value(std::move(v));
  tensors_.push_back(t);
  values_on_[size_t(buffer)].push_back(id);
  value_ids_[t.impl_ptr().get()] = id;
  if (writes) latest_[size_t(buffer)] = id;
  version_.push_back(latest_[size_t(buffer)]);
  return id;
}

int Capture::alias_of_current(const Tensor& t, int buf) {
  Op op;
  op.kind = OpKind::view;
  op.name = "alias";
  op.inputs = {latest_[size_t(buf)]};
  const int producer = int(graph_.ops.size());
  op.outputs = {new_value(t, buf, producer, false)};
  op.views = {{0, 0}};
  graph_.ops.push_back(std::move(op));
  return graph_.ops.back().outputs[0];
}

int Capture::value_of(const Tensor& t) {
  if (auto it = value_ids_.find(t.impl_ptr().get()); it != value_ids_.end()) {
    // A view read after its buffer was written through another view reads the new contents.
    const int buf = graph_.values[size_t(it->second)].buffer;
    if (version_[size_t(it->second)] == latest_[size_t(buf)]) return it->second;
    return alias_of_current(t, buf);
  }
  const bool known = buffer_ids_.count(t.storage().get()) > 0;
  const int buf = buffer_of(t, BufferKind::constant);
  // A view made outside dispatch (detach(), a hook's alias) of a buffer the step made or wrote:
  // an explicit alias op keeps the graph SSA.
  if (known && latest_[size_t(buf)] >= 0) return alias_of_current(t, buf);
  const int id = new_value(t, buf, -1, false);
  graph_.inputs.push_back(id);
  return id;
}

void Capture::on_op(const OpDef& def, std::span<const Tensor> in, std::span<const Tensor> out, const Attrs& attrs) {
  Op op;
  op.kind = def.view ? OpKind::view : OpKind::kernel;
  op.name = def.name;
  op.def = &def;
  op.attrs = attrs;
  op.rng = attrs.has("seed") && attrs.has("offset");
  op.inputs.reserve(in.size());
  op.outputs.reserve(out.size());
  for (const Tensor& t : in) op.inputs.push_back(t.defined() ? value_of(t) : -1);
  if (def.inplace)
    for (size_t i = 0; i < in.size(); ++i)
      if (in[i].defined() && (def.writes ? def.writes(i, attrs) : i == 0)) op.writes.push_back(int(i));
  const int producer = int(graph_.ops.size());
  bool any_new = false;
  for (size_t j = 0; j < out.size(); ++j) {
    const Tensor& t = out[j];
    const bool seen = value_ids_.count(t.impl_ptr().get()) > 0;
    const bool inplace_out = def.inplace && j == 0;
    if (seen && !inplace_out) {
      // A composite's output, made by the ops it dispatched (recorded already).
      op.outputs.push_back(value_ids_[t.impl_ptr().get()]);
      continue;
    }
    any_new = true;
    const bool known_buffer = buffer_ids_.count(t.storage().get()) > 0;
    BLU_CHECK(known_buffer || t.storage()->ptr() == nullptr || t.storage()->nbytes() == 0, "compiler capture: ",
              def.name, " made output ", j, " (", t.str(), ") outside dispatch; it cannot be captured");
    const int buf = buffer_of(t, BufferKind::temporary);
    if (known_buffer)
      for (size_t i = 0; i < in.size(); ++i)
        if (in[i].defined() && in[i].storage() == t.storage()) {
          op.views.emplace_back(int(j), int(i));
          break;
        }
    const bool is_view = !def.inplace && known_buffer;
    op.outputs.push_back(new_value(t, buf, producer, !is_view));
  }
  if (!any_new && !out.empty()) return;  // a composite whose ops are all recorded
  graph_.ops.push_back(std::move(op));
  notify();
}

int Capture::record_collective(const std::string& name, Attrs attrs, std::vector<Tensor> in, std::vector<int> writes,
                               std::function<void(std::span<const Tensor>)> call, std::function<void()> wait) {
  Op op;
  op.kind = OpKind::collective;
  op.name = name;
  op.attrs = std::move(attrs);
  for (const Tensor& t : in) op.inputs.push_back(value_of(t));
  const int producer = int(graph_.ops.size());
  for (size_t j = 0; j < writes.size(); ++j) {
    const Tensor& t = in[size_t(writes[j])];
    t.storage()->bump_version();
    op.outputs.push_back(new_value(t, graph_.values[size_t(op.inputs[size_t(writes[j])])].buffer, producer, true));
    op.views.emplace_back(int(j), writes[j]);
  }
  op.writes = std::move(writes);
  op.call = std::move(call);
  graph_.ops.push_back(std::move(op));
  if (wait) unwaited_.emplace(producer, std::move(wait));
  notify();
  return producer;
}

void Capture::record_wait(int collective) {
  const auto it = unwaited_.find(collective);
  if (it == unwaited_.end()) return;  // waited already, or a collective without a wait
  const Op& c = graph_.ops[size_t(collective)];
  Op op;
  op.kind = OpKind::collective;
  op.name = "wait";
  // The values it wrote (their newest versions) and the ones it only read.
  std::vector<int> reads = c.outputs;
  for (size_t i = 0; i < c.inputs.size(); ++i)
    if (std::find(c.writes.begin(), c.writes.end(), int(i)) == c.writes.end()) reads.push_back(c.inputs[i]);
  for (int v : reads)
    if (v >= 0 && std::find(op.inputs.begin(), op.inputs.end(), v) == op.inputs.end()) op.inputs.push_back(v);
  op.call = [w = std::move(it->second)](std::span<const Tensor>) { w(); };
  unwaited_.erase(it);
  graph_.ops.push_back(std::move(op));
  notify();
}

Graph& Capture::finish() {
  BLU_CHECK(!finished_, "compiler capture: finish() called twice");
  // A collective whose Work nobody waited for is waited for at the end of the step.
  while (!unwaited_.empty()) record_wait(unwaited_.begin()->first);
  finished_ = true;
  meta_.reset();
  set_ref_counter({});
  remove_op_observer(observer_);
  t_active = nullptr;
  // Our own references: one per buffer (storages_), one per distinct TensorImpl per storage, and
  // one handle per value on each impl. handles[i] counts the values whose tensor shares
  // tensors_[i]'s impl (a run of the values sorted by impl); impls_on[b] the distinct impls on
  // buffer b.
  const size_t n = tensors_.size();
  std::vector<std::pair<const TensorImpl*, size_t>> by_impl(n);
  for (size_t i = 0; i < n; ++i) by_impl[i] = {tensors_[i].impl_ptr().get(), i};
  std::sort(by_impl.begin(), by_impl.end());
  std::vector<long> handles(n);
  std::vector<long> impls_on(graph_.buffers.size(), 0);
  for (size_t lo = 0, hi = 0; lo < n; lo = hi) {
    while (hi < n && by_impl[hi].first == by_impl[lo].first) ++hi;
    for (size_t k = lo; k < hi; ++k) handles[by_impl[k].second] = long(hi - lo);
    ++impls_on[size_t(buffer_ids_.at(by_impl[lo].first->storage.get()))];
  }
  // A tensor only we still hold is one the eager step has dropped, and with it its autograd state.
  // Drop that state here too: otherwise its grad_fn chain outlives the step and holds what the
  // eager step freed — a recompute region's rebuilt graph, whose gradient accumulators hold the
  // region's leaves and so the activations they view, would make those activations step outputs.
  // Dropping one chain can leave more tensors held only by us: repeat until nothing changes.
  for (bool dropped = true; dropped;) {
    dropped = false;
    for (size_t i = 0; i < n; ++i) {
      TensorImpl& impl = *tensors_[i].impl_ptr();
      if (impl.autograd && tensors_[i].impl_ptr().use_count() <= handles[i]) {
        impl.autograd.reset();
        dropped = true;
      }
    }
  }
  std::vector<bool> held(graph_.buffers.size(), false);
  for (size_t i = 0; i < n; ++i)
    if (tensors_[i].impl_ptr().use_count() > handles[i]) held[size_t(buffer_ids_.at(tensors_[i].storage().get()))] = true;
  for (size_t b = 0; b < graph_.buffers.size(); ++b) {
    Buffer& buf = graph_.buffers[b];
    if (buf.kind != BufferKind::temporary) continue;
    if (held[b] || storages_[b].use_count() > 1 + impls_on[b]) {
      buf.kind = BufferKind::step_output;
      graph_.outputs.push_back(latest_[b]);
    }
  }
  return graph_;
}

// --- the capturable process group ---

namespace {

// Note [Deferred collective waits]
// A collective recorded into a step replays the way eager ran it: issued where it was issued,
// waited for where the caller waited for its Work. Each recorded collective gets a slot; its replay
// puts the issued Work there, and the "wait" op recorded at the caller's wait() (or at the end of
// the step, for a Work nobody waited for) takes it out and waits. The wait op reads every value the
// collective touches, so the memory plan keeps them in place until the collective is done; the
// compute in between overlaps the communication (DDP's buckets beside backward), as in eager.
struct IssuedSlot {
  dist::WorkPtr work;
};
// Slots issued by replays on this thread whose wait has not run (wait_issued_collectives()).
thread_local std::vector<std::shared_ptr<IssuedSlot>> t_issued;

void issue(const std::shared_ptr<IssuedSlot>& slot, dist::WorkPtr work) {
  slot->work = std::move(work);
  t_issued.push_back(slot);
}

void complete(const std::shared_ptr<IssuedSlot>& slot) {
  std::erase(t_issued, slot);
  if (dist::WorkPtr w = std::move(slot->work)) w->wait();
}

// What a capturing group returns while recording: its wait() records the wait op of the step
// (during the capture that recorded the collective; a later one has its own collectives).
class RecordedWork final : public dist::Work {
 public:
  RecordedWork(const Capture& c, int op) : capture_(c.serial()), op_(op) {}
  void wait() override {
    Capture* c = Capture::active();
    if (!waited_ && c && c->serial() == capture_) c->record_wait(op_);
    waited_ = true;
  }
  bool is_completed() const override { return true; }

 private:
  uint64_t capture_;
  int op_;
  bool waited_ = false;
};

class CapturingGroup final : public dist::ProcessGroup {
 public:
  explicit CapturingGroup(std::shared_ptr<dist::ProcessGroup> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  void set_timeout(std::chrono::milliseconds t) override { inner_->set_timeout(t); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  void set_phase(std::string phase) override { inner_->set_phase(std::move(phase)); }

  dist::WorkPtr all_reduce(const Tensor& t, dist::ReduceOp op) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "all_reduce", Attrs{{"reduce", int64_t(op)}}, {t}, {0},
                    [g, op](std::span<const Tensor> in) { return g->all_reduce(in[0], op); });
    }
    return inner_->all_reduce(t, op);
  }
  dist::WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, dist::ReduceOp op) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "reduce_scatter", Attrs{{"reduce", int64_t(op)}}, {out, in}, {0},
                    [g, op](std::span<const Tensor> t) { return g->reduce_scatter(t[0], t[1], op); });
    }
    return inner_->reduce_scatter(out, in, op);
  }
  dist::WorkPtr all_gather(const Tensor& out, const Tensor& in) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "all_gather", Attrs{}, {out, in}, {0},
                    [g](std::span<const Tensor> t) { return g->all_gather(t[0], t[1]); });
    }
    return inner_->all_gather(out, in);
  }
  dist::WorkPtr broadcast(const Tensor& t, int root) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "broadcast", Attrs{{"root", int64_t(root)}}, {t}, {0},
                    [g, root](std::span<const Tensor> in) { return g->broadcast(in[0], root); });
    }
    return inner_->broadcast(t, root);
  }
  dist::WorkPtr send(const Tensor& t, int dst, int tag) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "send", Attrs{{"peer", int64_t(dst)}, {"tag", int64_t(tag)}}, {t}, {},
                    [g, dst, tag](std::span<const Tensor> in) { return g->send(in[0], dst, tag); });
    }
    return inner_->send(t, dst, tag);
  }
  dist::WorkPtr recv(const Tensor& t, int src, int tag) override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "recv", Attrs{{"peer", int64_t(src)}, {"tag", int64_t(tag)}}, {t}, {0},
                    [g, src, tag](std::span<const Tensor> in) { return g->recv(in[0], src, tag); });
    }
    return inner_->recv(t, src, tag);
  }
  dist::WorkPtr barrier() override {
    if (Capture* c = Capture::active()) {
      auto g = inner_;
      return record(c, "barrier", Attrs{}, {}, {}, [g](std::span<const Tensor>) { return g->barrier(); });
    }
    return inner_->barrier();
  }

 private:
  // Records the collective `issue_fn` replays (Note [Deferred collective waits]).
  template <typename F>
  static dist::WorkPtr record(Capture* c, const std::string& name, Attrs attrs, std::vector<Tensor> in,
                              std::vector<int> writes, F issue_fn) {
    auto slot = std::make_shared<IssuedSlot>();
    const int op = c->record_collective(
        name, std::move(attrs), std::move(in), std::move(writes),
        [slot, issue_fn](std::span<const Tensor> t) { issue(slot, issue_fn(t)); }, [slot] { complete(slot); });
    return std::make_shared<RecordedWork>(*c, op);
  }
  std::shared_ptr<dist::ProcessGroup> inner_;
};

}  // namespace

void wait_issued_collectives() {
  while (!t_issued.empty()) complete(t_issued.back());
}

std::shared_ptr<dist::ProcessGroup> capturable(std::shared_ptr<dist::ProcessGroup> inner) {
  if (!inner) return inner;
  return std::make_shared<CapturingGroup>(std::move(inner));
}

}  // namespace blu::compiler
