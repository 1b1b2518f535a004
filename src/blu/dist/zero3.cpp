// dist/zero3: ZeroAdamW's stage 3 — the parameters sharded by unit, gathered around each unit's
// forward and backward, each unit's gradient reduce-scattered right after its backward.
#include <deque>

#include "blu/autograd/function.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/zero.h"
#include "blu/memory/allocator.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::dist {

// Note [ZeRO-3]
// Units. ZeroOptions::units names the parameters of each block (block i is unit i); every other
// parameter belongs to the last unit, "the rest" (embeddings, final norm, head). A unit's n
// parameter elements, in flat (optimizer) order, are split into W chunks of c = ceil(n / W); rank r
// keeps chunk r of every unit: its shard of the parameters (the master weights AdamW updates) and
// of the gradient, both [Σ c] with each unit's chunk at its own column, padding included, so a
// chunk is all-gathered from and reduce-scattered into its place without a copy. AdamW's moments
// cover the real elements only (shard_ranges(), the same checkpoint layout as stages 1 and 2).
//
// Storage. Each unit owns one Storage for its gathered parameters [W·c] and one for its gradient
// [W·c]; every parameter of the unit is a view of the first (its TensorImpl re-pointed once, at
// construction) and has a view of the second as its grad slot (Tensor::set_grad_slot), so
// backward writes the unit's gradient in place, one flat buffer ready to reduce-scatter. A unit
// that is not in use holds no bytes: its Storage's DataPtr is empty (0 bytes, the device kept).
// Releasing empties the DataPtr but keeps the Storage object, so the views an autograd graph saved
// during the forward see the bytes again once the unit is gathered for its backward — the same
// values, as nothing updates the shards between a forward and its backward.
//
// Schedule (the block hooks dist::Strategy installs; n blocks):
//   forward    begin_forward: the rest gathered (the embedding). before_block(i): the rest released
//              (i = 0); unit i ready (its all-gather, usually issued as the previous block's
//              prefetch, waited for); the next unit's all-gather issued — block i+1, or the rest
//              for the head — to run while block i computes. after_block(i): unit i released
//              (unless keep_forward); after the last block the rest is ready for the head.
//   backward   begin_backward: the rest's gradient buffer (the head's, later the embedding's
//              gradients accumulate there through the whole backward). Then the identities the
//              hooks returned run their callbacks around each block's backward: after_block's
//              node, right before block i's backward — unit i ready, its gradient buffer zeroed,
//              unit i-1's all-gather issued (the prefetch); after the head's backward the rest is
//              released unless the graph still holds a view of it (an embedding whose backward
//              reads weights; then it is gathered again before block 0's backward ends).
//              before_block's node, right after block i's backward — unit i's gradient
//              reduce-scattered (average) into a buffer of c, its parameters' grads dropped, unit i
//              released; with more than kInFlight reductions outstanding, the oldest is completed:
//              waited for, added into the shard gradient, its gradient buffer freed.
//              end_backward: the rest's gradient reduced, every reduction completed, every unit
//              released.
// So between blocks a rank holds its shards, at most two gathered units (the one computing and the
// prefetched one) and, in backward, the gradient buffers of the reductions in flight and of the
// rest. Micro-batches each reduce their gradients (a unit's buffer cannot outlive its backward);
// the shard gradient sums them. Collectives are issued in block order on every rank.
struct ZeroAdamW::Gatherer {
  static constexpr size_t kInFlight = 2;
  struct Unit {
    std::vector<size_t> params;    // indices into params_, flat order
    std::vector<int64_t> offsets;  // each parameter's offset in the unit
    int64_t numel = 0, chunk = 0;  // real elements; c
    int64_t shard_offset = 0;      // this unit's chunk in the padded shard
    std::shared_ptr<Storage> data, grad;  // [W·c] each, empty when released
    Tensor data_full, grad_full;          // views of all of data / grad
    long data_refs = 0;  // references to data held by the unit and its parameters themselves
    WorkPtr gather;      // the all-gather in flight
    bool gathered = false, has_grad = false;
  };
  struct Reduction {
    size_t unit;
    Tensor out;  // [c]
    WorkPtr work;
  };
  ProcessGroup* pg = nullptr;
  Device device = kCPU;
  int W = 1, rank = 0;
  std::vector<Unit> units;  // the blocks, then the rest
  size_t blocks = 0;
  std::vector<Tensor> params;  // params_[i].tensor
  Tensor shard_params, shard_grad;  // [Σ c]
  std::deque<Reduction> reducing;
  bool keep_forward = false;
  int full = 0;  // gather_full depth

  size_t rest() const { return units.size() - 1; }
  size_t bytes(const Unit& u) const { return size_t(u.chunk) * size_t(W) * 4; }
  DataPtr no_bytes() const { return DataPtr(nullptr, 0, device, nullptr, nullptr); }

  void gather(size_t k) {  // issues unit k's all-gather
    Unit& u = units[k];
    if (u.gathered) return;
    u.data->data = allocator_for(device).allocate(bytes(u));
    u.gather = pg->all_gather(u.data_full, narrow(shard_params, 0, u.shard_offset, u.chunk));
    u.gathered = true;
  }
  void ready(size_t k) {
    gather(k);
    if (WorkPtr w = std::move(units[k].gather)) w->wait();
  }
  void release(size_t k) {
    Unit& u = units[k];
    if (!u.gathered || full > 0) return;
    if (WorkPtr w = std::move(u.gather)) w->wait();
    u.data->data = no_bytes();
    u.gathered = false;
  }
  // Whether something besides the unit and its parameters refers to the unit's parameter bytes (a
  // view saved by a graph that has not run its backward yet).
  bool data_in_use(size_t k) const { return units[k].data.use_count() > units[k].data_refs; }
  void begin_grad(size_t k) {
    Unit& u = units[k];
    if (u.has_grad) return;
    u.grad->data = allocator_for(device).allocate(bytes(u));
    fill_(u.grad_full, 0.0);  // a parameter that gets no gradient contributes zeros
    u.has_grad = true;
  }
  void reduce(size_t k) {
    Unit& u = units[k];
    if (!u.has_grad) return;
    for (size_t i : u.params) params[i].zero_grad();  // the next gradient goes into the slot afresh
    Tensor out = empty({u.chunk}, DType::f32, device);
    reducing.push_back({k, out, pg->reduce_scatter(out, u.grad_full, ReduceOp::avg)});
    while (reducing.size() > kInFlight) complete_oldest();
  }
  void complete_oldest() {
    Reduction r = std::move(reducing.front());
    reducing.pop_front();
    r.work->wait();
    Unit& u = units[r.unit];
    add_(narrow(shard_grad, 0, u.shard_offset, u.chunk), r.out);
    u.grad->data = no_bytes();
    u.has_grad = false;
  }
  void complete_all() {
    while (!reducing.empty()) complete_oldest();
  }
};

namespace {

Tensor flat_of(const Tensor& t) { return view(t, {t.numel()}); }

// A contiguous view of `storage` from element `offset`, built without the bounds check of Tensor's
// constructor (the storage may hold no bytes at this moment).
Tensor view_of(const std::shared_ptr<Storage>& storage, int64_t offset, const Shape& shape) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage;
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->offset = offset;
  impl->dtype = DType::f32;
  return Tensor(std::move(impl));
}

}  // namespace

void ZeroAdamW::build_stage3(const ZeroOptions& zero) {
  NoGradGuard no_grad;
  auto g = std::make_shared<Gatherer>();
  g->pg = pg_.get();
  g->device = device_;
  g->W = pg_->size();
  g->rank = pg_->rank();
  g->keep_forward = zero.keep_forward;
  g->blocks = zero.units.size();
  g->units.resize(g->blocks + 1);
  std::vector<size_t> unit_of(params_.size(), g->blocks);
  std::vector<bool> named(params_.size(), false);
  for (size_t k = 0; k < zero.units.size(); ++k)
    for (const std::string& name : zero.units[k]) {
      size_t i = 0;
      while (i < params_.size() && params_[i].name != name) ++i;
      BLU_CHECK(i < params_.size(), "ZeroAdamW: ZeroOptions::units[", k, "] names '", name,
                "', which is not one of the optimizer's parameters");
      BLU_CHECK(!named[i], "ZeroAdamW: parameter '", name, "' is in two units (the second is units[", k, "])");
      named[i] = true;
      unit_of[i] = k;
    }
  for (size_t i = 0; i < params_.size(); ++i) {
    Gatherer::Unit& u = g->units[unit_of[i]];
    u.params.push_back(i);
    u.offsets.push_back(u.numel);
    u.numel += params_[i].tensor.numel();
    g->params.push_back(params_[i].tensor);
  }
  const int W = g->W, r = g->rank;
  int64_t padded = 0;
  for (Gatherer::Unit& u : g->units) {
    u.chunk = std::max<int64_t>(1, (u.numel + W - 1) / W);
    u.shard_offset = padded;
    const int64_t lo = std::min(u.numel, int64_t(r) * u.chunk), hi = std::min(u.numel, lo + u.chunk);
    for (size_t j = 0; j < u.params.size(); ++j) {  // this rank's chunk, as pieces of parameters
      const int64_t p_lo = std::max(lo, u.offsets[j]);
      const int64_t p_hi = std::min(hi, u.offsets[j] + params_[u.params[j]].tensor.numel());
      if (p_lo < p_hi)
        segments_.push_back({u.params[j], p_lo - u.offsets[j], shard_numel_ + p_lo - lo, p_hi - p_lo, padded + p_lo - lo});
    }
    shard_numel_ += hi - lo;
    padded += u.chunk;
  }
  // The shard from the whole parameters (every rank holds rank 0's: Strategy broadcasts first).
  g->shard_params = zeros({padded}, DType::f32, device_);
  g->shard_grad = zeros({padded}, DType::f32, device_);
  std::vector<Tensor> to, from;
  for (const Segment& s : segments_) {
    to.push_back(narrow(g->shard_params, 0, s.padded_offset, s.length));
    from.push_back(narrow(flat_of(params_[s.param].tensor), 0, s.param_offset, s.length));
  }
  if (!to.empty()) copy_many_(to, from);
  // Each parameter becomes a view of its unit's storage, with its grad slot in the unit's gradient
  // storage; then both are released (the parameters' own storage goes with the last reference).
  Allocator& alloc = allocator_for(device_);
  for (Gatherer::Unit& u : g->units) {
    u.data = std::make_shared<Storage>(alloc.allocate(g->bytes(u)));
    u.grad = std::make_shared<Storage>(alloc.allocate(g->bytes(u)));
    u.data_full = view_of(u.data, 0, {u.chunk * W});
    u.grad_full = view_of(u.grad, 0, {u.chunk * W});
    for (size_t j = 0; j < u.params.size(); ++j) {
      Tensor p = params_[u.params[j]].tensor;
      TensorImpl& impl = p.impl();
      impl.storage = u.data;
      impl.offset = u.offsets[j];
      p.set_grad_slot(view_of(u.grad, u.offsets[j], p.shape()));
    }
    u.data->data = g->no_bytes();
    u.grad->data = g->no_bytes();
    u.data_refs = u.data.use_count();
  }
  gatherer_ = g;
}

void ZeroAdamW::shutdown_stage3() {
  Gatherer& g = *gatherer_;
  try {
    NoGradGuard no_grad;
    g.complete_all();
    gather_full();
    // The parameters get storage of their own with their current values, and no grad slot.
    for (Tensor p : g.params) {
      const Tensor own = clone(p.detach());
      TensorImpl& impl = p.impl();
      impl.storage = own.storage();
      impl.offset = own.offset();
      p.set_grad_slot(Tensor());
      p.zero_grad();
    }
  } catch (const std::exception&) {
    // A broken process group: the parameters stay released views (no values to give back).
  }
}

Tensor ZeroAdamW::stage3_shard_params() const { return gatherer_->shard_params; }

Tensor ZeroAdamW::stage3_shard_grad() {
  NoGradGuard no_grad;
  gatherer_->complete_all();
  return gatherer_->shard_grad;
}

void ZeroAdamW::begin_forward(bool first) {
  BLU_CHECK(stage_ == 3, "ZeroAdamW::begin_forward: stage 3 only, this is stage ", stage_);
  NoGradGuard no_grad;
  Gatherer& g = *gatherer_;
  if (first) fill_(g.shard_grad, 0.0);
  g.ready(g.rest());
}

Tensor ZeroAdamW::before_block(size_t i, const Tensor& x) {
  Gatherer& g = *gatherer_;
  BLU_CHECK(i < g.blocks, "ZeroAdamW::before_block: block ", i, " of ", g.blocks, " units of blocks");
  if (g.full > 0) return x;
  {
    NoGradGuard no_grad;
    if (i == 0 && !g.keep_forward) g.release(g.rest());  // the embedding is done
    g.ready(i);
    g.gather(i + 1 < g.blocks ? i + 1 : g.rest());  // prefetch: overlaps block i's forward
  }
  // Its backward node runs right after block i's backward.
  return identity_with_backward_callback(
      x,
      [&g, i] {
        g.reduce(i);
        g.release(i);
        if (i == 0 && g.units[g.rest()].gathered) g.ready(g.rest());  // the embedding's backward needs it
      },
      "zero3_reduce_block_" + std::to_string(i));
}

Tensor ZeroAdamW::after_block(size_t i, const Tensor& y) {
  Gatherer& g = *gatherer_;
  BLU_CHECK(i < g.blocks, "ZeroAdamW::after_block: block ", i, " of ", g.blocks, " units of blocks");
  if (g.full > 0) return y;
  {
    NoGradGuard no_grad;
    if (!g.keep_forward) g.release(i);
    if (i + 1 == g.blocks) g.ready(g.rest());  // the head
  }
  // Its backward node runs right before block i's backward.
  return identity_with_backward_callback(
      y,
      [&g, i] {
        const size_t rest = g.rest();
        if (i + 1 == g.blocks && !g.data_in_use(rest)) g.release(rest);  // the head's backward is done
        g.ready(i);
        g.begin_grad(i);
        if (i > 0) g.gather(i - 1);                      // prefetch: overlaps block i's backward
        else if (g.data_in_use(rest)) g.gather(rest);  // the embedding's backward reads it
      },
      "zero3_gather_block_" + std::to_string(i));
}

void ZeroAdamW::begin_backward() {
  BLU_CHECK(stage_ == 3, "ZeroAdamW::begin_backward: stage 3 only, this is stage ", stage_);
  NoGradGuard no_grad;
  gatherer_->begin_grad(gatherer_->rest());
}

void ZeroAdamW::end_backward() {
  BLU_CHECK(stage_ == 3, "ZeroAdamW::end_backward: stage 3 only, this is stage ", stage_);
  NoGradGuard no_grad;
  Gatherer& g = *gatherer_;
  g.reduce(g.rest());
  g.complete_all();
  for (size_t k = 0; k < g.units.size(); ++k) g.release(k);
}

void ZeroAdamW::gather_full() {
  if (stage_ != 3) return;
  NoGradGuard no_grad;
  Gatherer& g = *gatherer_;
  if (g.full++ > 0) return;
  for (size_t k = 0; k < g.units.size(); ++k) g.gather(k);
  for (size_t k = 0; k < g.units.size(); ++k) g.ready(k);
}

void ZeroAdamW::release_full(bool write_back) {
  if (stage_ != 3) return;
  NoGradGuard no_grad;
  Gatherer& g = *gatherer_;
  BLU_CHECK(g.full > 0, "ZeroAdamW::release_full without gather_full");
  if (--g.full > 0) return;
  for (size_t k = 0; k < g.units.size(); ++k) {
    Gatherer::Unit& u = g.units[k];
    if (write_back)
      copy_(narrow(g.shard_params, 0, u.shard_offset, u.chunk), narrow(u.data_full, 0, int64_t(g.rank) * u.chunk, u.chunk));
    g.release(k);
  }
}

size_t ZeroAdamW::num_units() const { return gatherer_ ? gatherer_->units.size() : 0; }

std::vector<std::string> ZeroAdamW::unit_parameter_names(size_t unit) const {
  BLU_CHECK(gatherer_ && unit < gatherer_->units.size(), "ZeroAdamW::unit_parameter_names: no unit ", unit);
  std::vector<std::string> out;
  for (size_t i : gatherer_->units[unit].params) out.push_back(params_[i].name);
  return out;
}

int64_t ZeroAdamW::unit_numel(size_t unit) const {
  BLU_CHECK(gatherer_ && unit < gatherer_->units.size(), "ZeroAdamW::unit_numel: no unit ", unit);
  return gatherer_->units[unit].numel;
}

int64_t ZeroAdamW::gathered_bytes() const {
  int64_t n = 0;
  if (gatherer_)
    for (const auto& u : gatherer_->units) n += int64_t(u.data->nbytes() + u.grad->nbytes());
  return n;
}

bool ZeroAdamW::keep_forward() const { return gatherer_ && gatherer_->keep_forward; }

}  // namespace blu::dist
