#include "blu/dist/pipeline.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/io/checksum.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "blu/memory/allocator.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu::dist {

namespace fs = std::filesystem;

namespace {

constexpr int kActivation = 0, kGradient = 1;
constexpr int kTiedTag = 1 << 30;  // above every (micro, virtual stage, kind) tag of a step
constexpr const char* kCommit = "COMMIT";
constexpr const char* kMeta = "pipeline";

std::string stage_file_name(int r, int p) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "stage_%03d_of_%03d.safetensors", r, p);
  return buf;
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "ckpt_%08lld", static_cast<long long>(step));
  return buf;
}

// The names of the parameters that get a gradient from `f` (run once, without changing any
// parameter's .grad or the model's training flag).
std::set<std::string> touched_by(models::CausalLM& model, const std::function<Tensor()>& f) {
  const nn::NamedTensors params = model.named_parameters();
  std::vector<Tensor> saved;
  for (const auto& [name, p] : params) {
    saved.push_back(p.grad());
    Tensor(p).zero_grad();
  }
  const bool training = model.is_training();
  model.eval();  // no dropout draw
  sum(to_dtype(f(), DType::f32)).backward();
  model.train(training);
  std::set<std::string> out;
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor p = params[i].second;
    if (p.grad().defined()) out.insert(params[i].first);
    p.set_grad(saved[i]);
  }
  return out;
}

nlohmann::json train_state_json(const TrainState& s) {
  return {{"step", s.step}, {"rng_seed", s.rng_seed}, {"rng_offset", s.rng_offset},
          {"loader", s.loader}, {"model_config", s.model_config}, {"run", s.run}};
}

// pg.send / pg.recv, whose start can already fail when the peer is gone (Gloo throws its own
// exception on the caller's thread then): as blu::Error naming the peer.
WorkPtr p2p(ProcessGroup& pg, bool is_send, const Tensor& t, int peer, int tag) {
  try {
    return is_send ? pg.send(t, peer, tag) : pg.recv(t, peer, tag);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("pipeline: ") + (is_send ? "send to rank " : "recv from rank ") + std::to_string(peer) +
                " failed on rank " + std::to_string(pg.rank()) + ": " + e.what());
  }
}

Tensor tensor_from(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

// One micro-batch chunk between its forward and its backward.
struct PipelineStage::InFlight {
  Tensor input;   // the received activation, a leaf whose gradient goes back (virtual stage > 0)
  Tensor output;  // the block output sent on, or the last stage's scaled loss
};

// Receives (posted remote ones, or hand-offs between chunks of this rank) and outstanding sends
// of one step. A posted receive has a waiter thread that waits for it and signals the mailbox, so
// the stage can sleep until either of its posted receives has arrived.
class PipelineStage::Mailbox {
 public:
  using Key = std::tuple<int, int, int64_t>;  // (kind, receiving virtual stage, micro-batch)

  // Activations travel on `pg`, gradients on `gradients` (null: `pg`; PipelineOptions::gradients).
  Mailbox(ProcessGroup* pg, ProcessGroup* gradients, const StageLayout& layout, int64_t micro, int64_t send_slots)
      : pg_(pg), grad_pg_(gradients ? gradients : pg), layout_(layout), micro_(micro), slots_(send_slots) {}
  ~Mailbox() {
    for (auto& [k, p] : posted_)
      if (p->waiter.joinable()) p->waiter.join();
  }

  int tag(const Key& k) const {
    const auto& [kind, vs, m] = k;
    return int((m * layout_.virtual_stages() + vs) * 2 + kind);
  }
  // The rank a message for (kind, vs) comes from.
  int source(const Key& k) const {
    const auto& [kind, vs, m] = k;
    return layout_.rank_of(kind == kActivation ? vs - 1 : vs + 1);
  }
  bool local(const Key& k) const { return source(k) == pg_rank(); }
  int pg_rank() const { return pg_ ? pg_->rank() : 0; }
  ProcessGroup& group_of(const Key& k) const { return std::get<0>(k) == kGradient ? *grad_pg_ : *pg_; }

  // Posts the receive of `k` into a new buffer of `shape` (no-op for local or already posted).
  void post(const Key& k, const Shape& shape, DType dtype, Device device) {
    if (local(k) || posted_.count(k)) return;
    auto p = std::make_unique<Posted>();
    p->buffer = empty(shape, dtype, device);
    p->work = p2p(group_of(k), false, p->buffer, source(k), tag(k));
    Posted* raw = p.get();
    p->waiter = std::thread([this, raw] {
      try {
        raw->work->wait();
      } catch (...) {  // take() waits again and throws it
      }
      {
        std::lock_guard lock(mu_);
        raw->arrived = true;
      }
      cv_.notify_all();
    });
    posted_.emplace(k, std::move(p));
  }
  bool arrived(const Key& k) {
    if (local(k)) return local_.count(k) > 0;
    auto it = posted_.find(k);
    if (it == posted_.end()) return false;
    std::lock_guard lock(mu_);
    return it->second->arrived;
  }
  // Sleeps until one of the posted receives in `keys` has arrived.
  void wait_any(const std::vector<Key>& keys) {
    std::vector<Posted*> ps;
    for (const Key& k : keys) {
      auto it = posted_.find(k);
      BLU_ASSERT(it != posted_.end() || (local(k) && local_.count(k)), "pipeline: waiting for a receive never posted");
      if (it != posted_.end()) ps.push_back(it->second.get());
    }
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return std::any_of(ps.begin(), ps.end(), [](Posted* p) { return p->arrived; }); });
  }
  // The message of `k`: blocks until it is there; a failed receive throws (naming the peer).
  Tensor take(const Key& k) {
    if (local(k)) {
      auto it = local_.find(k);
      BLU_ASSERT(it != local_.end(), "pipeline: a local hand-off was taken before it was put");
      Tensor t = it->second;
      local_.erase(it);
      return t;
    }
    auto it = posted_.find(k);
    BLU_ASSERT(it != posted_.end(), "pipeline: a receive was taken before it was posted");
    std::unique_ptr<Posted> p = std::move(it->second);
    posted_.erase(it);
    p->waiter.join();
    p->work->wait();
    return p->buffer;
  }
  // Sends `t` as message `k` (to the rank that owns k's virtual stage), or hands it over locally.
  void send(const Key& k, const Tensor& t) {
    const auto& [kind, vs, m] = k;
    const int dst = layout_.rank_of(vs);
    if (dst == pg_rank()) {
      local_[k] = t;
      return;
    }
    while (slots_ > 0 && int64_t(sends_.size()) >= slots_) {
      sends_.front()->wait();
      sends_.pop_front();
    }
    sends_.push_back(p2p(group_of(k), true, t, dst, tag(k)));
  }
  void finish_sends() {
    for (auto& w : sends_) w->wait();
    sends_.clear();
  }

 private:
  struct Posted {
    Tensor buffer;
    WorkPtr work;
    std::thread waiter;
    bool arrived = false;  // under mu_
  };
  ProcessGroup* pg_;
  ProcessGroup* grad_pg_;
  const StageLayout& layout_;
  int64_t micro_, slots_;
  std::map<Key, std::unique_ptr<Posted>> posted_;
  std::map<Key, Tensor> local_;
  std::deque<WorkPtr> sends_;
  std::mutex mu_;
  std::condition_variable cv_;
};

PipelineStage::PipelineStage(models::CausalLM& model, std::shared_ptr<ProcessGroup> pg, PipelineOptions options)
    : model_(model), pg_(std::move(pg)), options_(std::move(options)) {
  const int stages = pg_ ? pg_->size() : 1;
  rank_ = pg_ ? pg_->rank() : 0;
  layout_ = split_blocks(int64_t(model_.num_blocks()), stages, options_.chunks, options_.layers);
  if (options_.schedule_override) {
    schedule_ = *options_.schedule_override;
    BLU_CHECK(schedule_.stages == stages && schedule_.chunks == options_.chunks &&
                  schedule_.micro_batches == options_.micro_batches,
              "pipeline: the given schedule is for ", schedule_.stages, " stages × ", schedule_.chunks, " chunks, ",
              schedule_.micro_batches, " micro-batches; the pipeline has ", stages, " × ", options_.chunks, ", ",
              options_.micro_batches);
  } else {
    schedule_ = make_schedule(options_.schedule, stages, options_.chunks, options_.micro_batches);
  }
  send_slots_ = std::max<int64_t>(1, schedule_.max_in_flight());
  check_schedule(schedule_, send_slots_);

  const std::set<std::string> mine = stage_parameter_names(model_, layout_, rank_);
  for (const auto& [name, p] : model_.named_parameters())
    if (mine.count(name)) owned_.emplace_back(name, p);
  for (const auto& [name, p] : owned_) owned_sharded_.push_back(options_.tp && shard_info(model_, p).sharded());
  if (model_.tied_embeddings() && stages > 1 && (owns_first() || owns_last()))
    tied_ = model_.token_embedding().weight;
  in_flight_.resize(size_t(options_.chunks * options_.micro_batches));

  // The other stages' parameters keep their place in the model (names, shapes: checkpoints and
  // share_parameters() need them) but not their bytes. A storage an owned parameter shares stays.
  // (The trainer may have placed only the owned ones already: place_stage_parameters.)
  std::set<const Storage*> kept;
  std::map<const Storage*, size_t> at;  // a storage's entry in unowned_
  for (const auto& [name, p] : owned_) kept.insert(p.storage().get());
  for (const auto& [name, p] : model_.named_parameters()) {
    const std::shared_ptr<Storage>& st = p.storage();
    if (kept.count(st.get())) continue;
    const size_t bytes = std::max(st->nbytes(), size_t(p.offset() + p.numel()) * dtype_size(p.dtype()));
    if (auto it = at.find(st.get()); it != at.end()) {
      unowned_[it->second].bytes = std::max(unowned_[it->second].bytes, bytes);
    } else {
      at.emplace(st.get(), unowned_.size());
      unowned_.push_back({st, bytes});
    }
  }
  drop_unowned();
}

std::set<std::string> stage_parameter_names(models::CausalLM& model, const StageLayout& layout, int rank) {
  // The blocks of this rank's virtual stages, the embedding's parameters on the first stage, the
  // head's on the last (whatever one token's embed or head gives a gradient: dist/ names no model).
  std::set<std::string> mine;
  const std::vector<models::BlockRef> blocks = model.blocks();
  for (int c = 0; c < layout.chunks; ++c) {
    const int vs = layout.virtual_stage(rank, c);
    for (int64_t b = layout.first[size_t(vs)]; b < layout.first[size_t(vs)] + layout.count[size_t(vs)]; ++b)
      for (const auto& [name, p] : blocks[size_t(b)].module->named_parameters())
        mine.insert(blocks[size_t(b)].name + "." + name);
  }
  const Device dev = model.token_embedding().weight.device();
  if (rank == 0) {
    const std::set<std::string> e = touched_by(model, [&] { return model.embed(zeros({1, 1}, DType::i64, dev)); });
    mine.insert(e.begin(), e.end());
  }
  if (layout.rank_of(layout.virtual_stages() - 1) == rank) {
    const int64_t C = model.token_embedding().weight.size(1);
    const std::set<std::string> h = touched_by(model, [&] {
      Tensor x = zeros({1, 1, C}, model.compute_dtype(), dev);
      x.set_requires_grad(true);
      return model.head(x).logits;
    });
    mine.insert(h.begin(), h.end());
  }
  return mine;
}

int64_t place_stage_parameters(models::CausalLM& model, const std::set<std::string>& owned, Device device) {
  NoGradGuard no_grad;
  std::set<const Storage*> kept;
  for (const auto& [name, p] : model.named_parameters())
    if (owned.count(name)) kept.insert(p.storage().get());
  int64_t placed = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    const std::shared_ptr<Storage>& st = p.storage();
    if (kept.count(st.get())) {
      if (st->device() != device) placed += int64_t(st->nbytes());
      continue;
    }
    if (st->device() != device) st->data = DataPtr(nullptr, 0, device, nullptr, nullptr);
  }
  model.to(device);  // the owned parameters (and every buffer); the others are there already, byte-less
  return placed;
}

void PipelineStage::drop_unowned() {
  std::set<const Storage*> unowned;
  for (const Unowned& u : unowned_) unowned.insert(u.storage.get());
  for (const auto& [p, copy] : model_.compute_copies())  // a 16-bit copy made while they were shared
    if (copy && unowned.count(p.storage().get())) copy->reset();
  for (Unowned& u : unowned_) u.storage->data = DataPtr(nullptr, 0, u.storage->device(), nullptr, nullptr);
}

int64_t PipelineStage::resident_parameter_bytes() const {
  std::set<const Storage*> seen;
  int64_t n = 0;
  for (const auto& [name, p] : model_.named_parameters())
    if (seen.insert(p.storage().get()).second) n += int64_t(p.storage()->nbytes());
  return n;
}

PipelineStage::~PipelineStage() = default;

std::vector<int64_t> PipelineStage::owned_blocks() const {
  std::vector<int64_t> out;
  for (int c = 0; c < layout_.chunks; ++c) {
    const int vs = layout_.virtual_stage(rank_, c);
    for (int64_t b = 0; b < layout_.count[size_t(vs)]; ++b) out.push_back(layout_.first[size_t(vs)] + b);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string PipelineStage::describe() const {
  std::string s = std::string("pipeline ") + schedule_.name + ", " + std::to_string(layout_.stages) + " stages × " +
                  std::to_string(layout_.chunks) + (layout_.chunks == 1 ? " chunk, " : " chunks, ") +
                  std::to_string(schedule_.micro_batches) + " micro-batches, " +
                  (options_.execution == PipelineExecution::message_driven ? "message-driven" : "scheduled") +
                  ", blocks [";
  for (size_t i = 0; i < layout_.count.size(); ++i) s += (i ? "," : "") + std::to_string(layout_.count[i]);
  return s + "]";
}

void PipelineStage::run_forward(const PipelineAction& a, int64_t n, const BatchFn& batch_of, Mailbox& box) {
  const int vs = layout_.virtual_stage(rank_, a.chunk);
  auto rec = std::make_unique<InFlight>();
  Tensor x;
  std::pair<Tensor, Tensor> batch;
  if (layout_.is_first(vs) || layout_.is_last(vs)) batch = batch_of(a.micro);
  if (layout_.is_first(vs)) {
    x = model_.embed(batch.first);
  } else {
    x = box.take({kActivation, vs, a.micro});
    x.set_requires_grad(true);
    rec->input = x;
  }
  for (int64_t b = 0; b < layout_.count[size_t(vs)]; ++b) x = model_.block(size_t(layout_.first[size_t(vs)] + b), x);
  if (layout_.is_last(vs)) {
    const Tensor loss = model_.head(x, batch.second).loss;
    BLU_CHECK(loss.defined() && loss.numel() == 1, "pipeline: the head gave no scalar loss for micro-batch ", a.micro);
    {
      NoGradGuard no_grad;
      const Tensor l = to_dtype(loss.detach(), DType::f64);
      loss_sum_ = loss_sum_.defined() ? add(loss_sum_, l) : l;
    }
    const double factor = 1.0 / double(n);
    rec->output = factor != 1.0 ? mul(loss, factor) : loss;
  } else {
    rec->output = x;
    box.send({kActivation, vs + 1, a.micro}, contiguous(x.detach()));
  }
  in_flight_[size_t(a.chunk * n + a.micro)] = std::move(rec);
}

void PipelineStage::run_backward(const PipelineAction& a, int64_t n, Mailbox& box) {
  const int vs = layout_.virtual_stage(rank_, a.chunk);
  std::unique_ptr<InFlight> rec = std::move(in_flight_[size_t(a.chunk * n + a.micro)]);
  BLU_ASSERT(rec, "pipeline: backward of ", to_string(a), " before its forward");
  if (layout_.is_last(vs)) {
    rec->output.backward();
  } else {
    rec->output.backward(box.take({kGradient, vs, a.micro}));
  }
  if (!layout_.is_first(vs)) {
    const Tensor g = rec->input.grad();
    BLU_ASSERT(g.defined(), "pipeline: no gradient reached the input of ", to_string(a));
    box.send({kGradient, vs - 1, a.micro}, contiguous(g));
  }
}

PipelineStepValues PipelineStage::forward_backward(int64_t n, const BatchFn& batch_of, double max_norm) {
  BLU_CHECK(n == schedule_.micro_batches, "pipeline: step with ", n, " micro-batches, but the schedule was built for ",
            schedule_.micro_batches);
  const Device dev = model_.token_embedding().weight.device();
  const int64_t C = model_.token_embedding().weight.size(1);
  const DType dt = model_.compute_dtype();
  loss_sum_ = Tensor();
  order_.clear();
  std::vector<Shape> shapes;  // each micro-batch's token shape, for the receive buffers
  for (int64_t m = 0; m < n; ++m) {
    const Tensor idx = batch_of(m).first;
    BLU_CHECK(idx.dim() == 2, "pipeline: micro-batch ", m, " has token ids ", idx.shape(), ", expected [B, T]");
    shapes.push_back({idx.size(0), idx.size(1), C});
  }
  const auto key_of = [&](const PipelineAction& a) -> Mailbox::Key {
    const int vs = layout_.virtual_stage(rank_, a.chunk);
    return a.op == PipelineAction::forward ? Mailbox::Key{kActivation, vs, a.micro}
                                           : Mailbox::Key{kGradient, vs, a.micro};
  };
  const auto needs_recv = [&](const PipelineAction& a) {
    const int vs = layout_.virtual_stage(rank_, a.chunk);
    return a.op == PipelineAction::forward ? !layout_.is_first(vs) : !layout_.is_last(vs);
  };
  Mailbox box(pg_.get(), options_.gradients.get(), layout_, n, send_slots_);
  const auto run = [&](const PipelineAction& a) {
    if (options_.before_action) options_.before_action(a);
    if (a.op == PipelineAction::forward) {
      run_forward(a, n, batch_of, box);
    } else {
      run_backward(a, n, box);
    }
    order_.push_back(a);
  };
  const auto post = [&](const PipelineAction& a) {
    if (needs_recv(a)) box.post(key_of(a), shapes[size_t(a.micro)], dt, dev);
  };
  const std::vector<PipelineAction>& list = schedule_.ranks[size_t(rank_)];
  if (options_.execution == PipelineExecution::scheduled) {
    for (const PipelineAction& a : list) {
      post(a);
      run(a);
    }
  } else {
    // Message-driven: the next forward and the next backward of the list, each with its receive
    // posted; run a backward when its gradient is there, else a forward when its activation is
    // there and the in-flight bound allows, else sleep until one of them arrives.
    std::vector<PipelineAction> fwd, bwd;
    for (const PipelineAction& a : list) (a.op == PipelineAction::forward ? fwd : bwd).push_back(a);
    const int64_t bound = schedule_.max_in_flight(rank_);
    size_t fi = 0, bi = 0;
    int64_t in_flight = 0;
    std::set<std::pair<int, int64_t>> forwarded;
    while (fi < fwd.size() || bi < bwd.size()) {
      const bool f_open = fi < fwd.size() && in_flight < bound;
      const bool b_open = bi < bwd.size() && forwarded.count({bwd[bi].chunk, bwd[bi].micro});
      if (f_open) post(fwd[fi]);
      if (b_open) post(bwd[bi]);
      const bool b_ready = b_open && (!needs_recv(bwd[bi]) || box.arrived(key_of(bwd[bi])));
      const bool f_ready = f_open && (!needs_recv(fwd[fi]) || box.arrived(key_of(fwd[fi])));
      if (b_ready) {
        run(bwd[bi++]);
        --in_flight;
      } else if (f_ready) {
        forwarded.insert({fwd[fi].chunk, fwd[fi].micro});
        run(fwd[fi++]);
        ++in_flight;
      } else {
        std::vector<Mailbox::Key> waits;
        if (f_open) waits.push_back(key_of(fwd[fi]));
        if (b_open) waits.push_back(key_of(bwd[bi]));
        BLU_CHECK(!waits.empty(), "pipeline: rank ", rank_, " can run neither its next forward nor its next "
                  "backward (in-flight bound ", bound, ")");
        box.wait_any(waits);
      }
    }
  }
  box.finish_sends();
  sync_tied();
  if (options_.reduce_gradients) options_.reduce_gradients();

  PipelineStepValues v;
  {
    NoGradGuard no_grad;
    v.loss_sum = loss_sum_.defined() ? loss_sum_ : zeros({}, DType::f64, dev);
    // The norm: each gradient once (the tied weight counted on the first stage; under tensor
    // parallelism the shards' squares summed over the TP group first), every stage's sum of
    // squares added by one all-reduce.
    std::vector<Tensor> grads, shards;
    for (size_t i = 0; i < owned_.size(); ++i) {
      const Tensor& p = owned_[i].second;
      if (!p.grad().defined() || (tied_.defined() && p.is_same(tied_) && !owns_first())) continue;
      (owned_sharded_[i] ? shards : grads).push_back(p.grad());
    }
    Tensor total = grads.empty() ? zeros({}, DType::f32, dev) : sum_squares(grads);
    if (options_.tp) {
      Tensor sh = contiguous(reshape(to_dtype(shards.empty() ? zeros({}, DType::f32, dev) : sum_squares(shards),
                                              DType::f64), {1}));
      options_.tp->all_reduce(sh, ReduceOp::sum)->wait();
      total = add(to_dtype(total, DType::f64), reshape(sh, {}));
    }
    if (pg_ && pg_->size() > 1) {
      total = contiguous(reshape(to_dtype(total, DType::f64), {1}));
      pg_->all_reduce(total, ReduceOp::sum)->wait();
    }
    v.gate = {.sum_squares = total, .max_norm = max_norm > 0 ? max_norm : INFINITY};
  }
  return v;
}

// The tied weight's two partial gradients (the embedding's on the first stage, the head's on the
// last) exchanged and added in one order on both ends: first + last.
void PipelineStage::sync_tied() {
  if (!tied_.defined()) return;
  NoGradGuard no_grad;
  Tensor mine = tied_.grad();
  if (!mine.defined()) mine = zeros(tied_.shape(), tied_.dtype(), tied_.device());
  mine = contiguous(mine);
  Tensor theirs = empty_like(mine);
  const int peer = owns_first() ? layout_.rank_of(layout_.virtual_stages() - 1) : 0;
  // Opposite orders on the two ends: NCCL runs a communicator's operations in enqueue order, so two
  // sends first would each wait for a receive queued behind the other's.
  WorkPtr s, r;
  if (owns_first()) {
    s = p2p(*pg_, true, mine, peer, kTiedTag);
    r = p2p(*pg_, false, theirs, peer, kTiedTag);
  } else {
    r = p2p(*pg_, false, theirs, peer, kTiedTag);
    s = p2p(*pg_, true, mine, peer, kTiedTag);
  }
  s->wait();
  r->wait();
  tied_.set_grad(owns_first() ? add(mine, theirs) : add(theirs, mine));
}

namespace {

// The step of a "ckpt_<step>" directory (-1 when the name holds no number).
int64_t checkpoint_dir_step(const fs::path& p) {
  const std::string n = p.filename().string().substr(5);
  return !n.empty() && n.size() <= 18 && std::all_of(n.begin(), n.end(), ::isdigit) ? std::stoll(n) : -1;
}

}  // namespace

std::string PipelineStage::save(const std::string& dir, const optim::Optimizer& opt, const TrainState& st,
                                int keep_last) {
  const fs::path step_dir = fs::path(dir) / step_dir_name(st.step);
  fs::create_directories(step_dir);
  const int P = layout_.stages;
  if (rank_ == 0) fs::remove(step_dir / kCommit);  // re-saving a step: not committed until done
  if (pg_) pg_->barrier()->wait();
  SafeTensorsWriter w;
  std::vector<Tensor> keep;  // the writer holds views of these bytes until write()
  const auto add_all = [&](const std::string& prefix, const nn::NamedTensors& ts) {
    for (const auto& [name, t] : ts) {
      keep.push_back(contiguous(to_device(t.detach(), kCPU)));
      const Tensor& c = keep.back();
      w.add(prefix + name, c.dtype(), c.shape(), {static_cast<const std::byte*>(c.raw_data()), c.nbytes()});
    }
  };
  add_all("model.", owned_);
  add_all("optim.", opt.state());
  std::vector<int64_t> blocks = owned_blocks();
  w.set_metadata("train_state", train_state_json(st).dump());
  w.set_metadata(kMeta, nlohmann::json{{"rank", rank_}, {"stages", P}, {"blocks", blocks}}.dump());
  w.write((step_dir / stage_file_name(rank_, P)).string());
  if (pg_) pg_->barrier()->wait();  // every stage's file is on disk
  if (rank_ == 0) {
    // COMMIT names every stage file with its size and checksum, written atomically (temp, fsync,
    // rename, directory fsync); older checkpoints go only once it is durable.
    nlohmann::json files = nlohmann::json::array();
    for (int q = 0; q < P; ++q) {
      const io::FileDigest d = io::digest_file(step_dir / stage_file_name(q, P));
      files.push_back({{"name", stage_file_name(q, P)}, {"bytes", d.bytes}, {"checksum", d.checksum}});
    }
    io::write_json_file(step_dir / kCommit,
                        {{"format_version", kPipelineFormatVersion}, {"stages", P}, {"step", st.step}, {"files", files}});
    if (keep_last > 0) {
      std::vector<std::pair<int64_t, fs::path>> committed;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_directory() && e.path().filename().string().rfind("ckpt_", 0) == 0 && fs::exists(e.path() / kCommit))
          committed.emplace_back(checkpoint_dir_step(e.path()), e.path());
      std::sort(committed.begin(), committed.end());
      for (size_t i = 0; i + size_t(keep_last) < committed.size(); ++i)
        if (committed[i].second != step_dir) fs::remove_all(committed[i].second);
    }
  }
  if (pg_) pg_->barrier()->wait();  // nobody reads the checkpoint before it is committed
  return step_dir.string();
}

void PipelineStage::verify_checkpoint(const std::string& ckpt_dir) {
  const fs::path d(ckpt_dir), commit_path = d / kCommit;
  BLU_CHECK(fs::exists(commit_path), "pipeline checkpoint: ", commit_path.string(),
            " is missing: the checkpoint was not committed (a save was interrupted?)");
  const nlohmann::json commit = io::read_json_file(commit_path);
  BLU_CHECK(commit.is_object() && commit.contains("stages") && commit["stages"].is_number_integer(),
            commit_path.string(), ": expected a JSON object with an integer \"stages\"");
  BLU_CHECK(!commit.contains("format_version") || commit["format_version"].is_number_integer(), commit_path.string(),
            ": expected an integer \"format_version\", got ", commit.value("format_version", nlohmann::json()).dump());
  const int64_t version = commit.value("format_version", int64_t(1));
  BLU_CHECK(version >= 1 && version <= kPipelineFormatVersion, "pipeline checkpoint ", ckpt_dir,
            " has format version ", version, "; this build reads versions 1 to ", kPipelineFormatVersion);
  const int64_t P = commit["stages"].get<int64_t>();
  BLU_CHECK(P >= 1 && P <= (1 << 20), commit_path.string(), ": stages must be in [1, 2^20], got ", P);
  if (version == 1) {  // no digests: the files must exist
    for (int q = 0; q < P; ++q)
      BLU_CHECK(fs::exists(d / stage_file_name(q, int(P))), "pipeline checkpoint: stage file ",
                (d / stage_file_name(q, int(P))).string(), " is missing (", P, " expected)");
    return;
  }
  BLU_CHECK(commit.contains("files") && commit["files"].is_array() && commit["files"].size() == size_t(P),
            commit_path.string(), ": expected \"files\" to list ", P, " stage files");
  verify_listed_files(ckpt_dir, commit["files"], "pipeline checkpoint");
}

std::string PipelineStage::latest_checkpoint(const std::string& dir, const CheckpointWarning& warn) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";
  std::vector<std::pair<int64_t, std::string>> committed;  // by step number, not by name
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("ckpt_", 0) == 0 && fs::exists(e.path() / kCommit))
      committed.emplace_back(checkpoint_dir_step(e.path()), e.path().string());
  }
  std::sort(committed.begin(), committed.end());
  return newest_verified(committed, [](const std::string& d) { verify_checkpoint(d); }, warn);
}

TrainState PipelineStage::load(const std::string& ckpt_dir, optim::Optimizer& opt,
                               const nlohmann::json& expected_model_config) {
  const fs::path d(ckpt_dir);
  verify_checkpoint(ckpt_dir);  // COMMIT, version, every stage file's size and checksum
  const int P = io::read_json_file(d / kCommit).at("stages").get<int>();
  std::vector<SafeTensorsFile> files;
  for (int q = 0; q < P; ++q) {
    const fs::path f = d / stage_file_name(q, P);
    BLU_CHECK(fs::exists(f), "pipeline load: stage file ", f.string(), " is missing (", P, " expected)");
    files.push_back(SafeTensorsFile::open(f.string()));
  }
  const auto meta = files[0].metadata().find("train_state");
  BLU_CHECK(meta != files[0].metadata().end(), "pipeline load: ", files[0].source(), " has no train_state");
  const nlohmann::json js = nlohmann::json::parse(meta->second);
  BLU_CHECK(expected_model_config.is_null() || js.at("model_config") == expected_model_config, "pipeline load: ",
            ckpt_dir, " holds model ", js.at("model_config").dump(), ", expected ", expected_model_config.dump());
  // Every name in every stage file (the first holder of a name wins: a tied weight is in two files,
  // with the same bytes).
  std::map<std::string, Tensor> found;
  for (const SafeTensorsFile& f : files)
    for (const TensorEntry& e : f.entries())
      if (!found.count(e.name)) found.emplace(e.name, tensor_from(f, e));
  std::set<std::string> owned_names;
  for (const auto& [name, p] : owned_) {
    owned_names.insert(name);
    auto it = found.find("model." + name);
    BLU_CHECK(it != found.end(), "pipeline load: ", ckpt_dir, " has no parameter '", name, "'");
    BLU_CHECK(it->second.shape() == p.shape() && it->second.dtype() == p.dtype(), "pipeline load: parameter '", name,
              "' is ", it->second.dtype(), " ", it->second.shape(), " in the checkpoint, ", p.dtype(), " ", p.shape(),
              " in the model");
  }
  // Optimizer state: "step" and every "<kind>.<param>" of an owned parameter.
  nn::NamedTensors state;
  for (const auto& [full, t] : found) {
    if (full.rfind("optim.", 0) != 0) continue;
    const std::string name = full.substr(6);
    const size_t dot = name.find('.');
    if (name == "step" || (dot != std::string::npos && owned_names.count(name.substr(dot + 1))))
      state.emplace_back(name, t);
  }
  opt.load_state(state);
  NoGradGuard no_grad;
  for (const auto& [name, p] : owned_) copy_(p, to_device(found.at("model." + name), p.device()));
  TrainState st;
  st.step = js.at("step").get<int64_t>();
  st.rng_seed = js.at("rng_seed").get<uint64_t>();
  st.rng_offset = js.at("rng_offset").get<uint64_t>();
  st.loader = js.at("loader");
  st.model_config = js.at("model_config");
  st.run = js.at("run");
  return st;
}

void PipelineStage::share_parameters() {
  if (shared_++ > 0) return;
  for (Unowned& u : unowned_) u.storage->data = allocator_for(u.storage->device()).allocate(u.bytes);
  const nn::NamedTensors all = model_.named_parameters();
  if (owners_.empty()) {  // once: the highest rank that trains each parameter, agreed by one all-reduce
    std::set<std::string> mine;
    for (const auto& [name, p] : owned_) mine.insert(name);
    std::vector<double> v;
    for (const auto& [name, p] : all) v.push_back(mine.count(name) ? double(rank_ + 1) : 0.0);
    const Device dev = pg_->backend() == "nccl" ? all.front().second.device() : kCPU;
    Tensor t = from_vector(v, {int64_t(v.size())}, DType::f64);
    if (!dev.is_cpu()) t = to_device(t, dev);
    pg_->all_reduce(t, ReduceOp::max)->wait();
    for (double o : to_vector(t)) {
      BLU_CHECK(o >= 1, "pipeline: a parameter of the model is trained by no stage");
      owners_.push_back(int(o) - 1);
    }
  }
  for (size_t i = 0; i < all.size(); ++i) pg_->broadcast(all[i].second, owners_[i])->wait();
}

void PipelineStage::release_parameters() {
  BLU_CHECK(shared_ > 0, "PipelineStage::release_parameters without share_parameters");
  if (--shared_ == 0) drop_unowned();
}

}  // namespace blu::dist
