// dist/zero: the flat layout and its slices, ZeRO-1/2 AdamW steps.
#include "blu/dist/zero.h"

#include <cmath>
#include <algorithm>
#include <map>
#include <mutex>
#include <span>

#include "blu/core/grad_mode.h"
#include "blu/dist/row_exchange.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace blu::dist {

namespace {

Tensor flat(const Tensor& t) { return view(t, {t.numel()}); }

}  // namespace

// Note [ZeRO-2 buckets]
// Stage 2 groups the parameters into buckets in reduction order (ZeroOptions::reduce_order: the
// order backward completes gradients), each bucket about bucket_mib. Bucket b of n elements (its
// parameters back to back) is split into W chunks of c = ceil(n / W); rank r owns chunk r, so its
// shard is chunk r of every bucket, in bucket order — pieces of parameters that are not contiguous
// in the flat vector, described by segments_ (and by shard_ranges() in checkpoints). A gradient
// hook on each parameter does the work while backward runs: when a parameter's gradient is
// complete (the engine has summed its contributions) and sync is on, it is copied into its
// bucket's staging buffer [W·c] (allocated by the bucket's first gradient; a parameter alone in its
// bucket with no padding is reduced from its own gradient) and released; when the
// bucket's last gradient has arrived and every earlier bucket has been issued, the buffer is
// reduce-scattered (average) into [c] — in bucket order on every rank, so the collectives match
// whatever order the hooks fire in; a full chunk is reduced straight into its place in the shard
// gradient. At most kInFlight buckets are reduced at once: issuing one more first completes the
// oldest (its staging buffer freed), which bounds the gradient memory to the shard gradient (N/W),
// a few buckets, and the gradients backward has made but not yet completed.
// reduce_gradients() stages what backward did not deliver (a gradient set by hand, or zeros for
// a parameter without one), issues the rest and completes everything. The next synced gradient
// opens a new round with a fresh shard gradient, so a skipped step (fp16 overflow) leaves nothing
// behind.
//
// Note [ZeRO-2 row exchange]
// A tied embedding (ZeroOptions::exchange_rows) gets two gradients: the LM head's, dense, from the
// first op of backward, and the embedding's, a few rows, from the last. Summed by the engine, the
// whole [V, C] gradient would be complete only when backward ends — held all the while, reduced
// after everything else, and the embedding's backward would make a second dense [V, C] to add. So
// the embedding hands its output gradient to the reducer instead (nn::Embedding's row sink): the
// weight's gradient is then the LM head's part alone, complete early; its bucket — its own, first
// in the reduction order — is reduce-scattered and released while backward goes on. The bucket's
// chunks are whole rows (c = ceil(V / W) rows of C), so rank r's piece of the shard gradient is
// rows [r·c/C, …) of the embedding. After the last bucket the rows are exchanged, as DDP does:
// every rank's ids and rows all-gathered while W × tokens ≤ rows_gather_limit × V, each rank adding
// those in its rows into its piece (embedding_backward_add_window_, scaled 1/W; deterministic);
// above that, summed locally into a dense [W·c/C, C] and reduce-scattered (average) into [c/C, C]
// that is added. Under set_sync(false) the rows are added into the local gradient at once (the
// synced backward reduces it with the LM head's part). Every rank's batch must hold the same
// number of tokens, and the embedding must be used in every synced backward.
namespace {
constexpr size_t kBucketsInFlight = 2;  // stage 2: buckets reduced at once
}  // namespace

struct ZeroAdamW::Reducer {
  static constexpr size_t kInFlight = kBucketsInFlight;
  struct Bucket {
    std::vector<size_t> params;    // indices into params_, in bucket order
    std::vector<int64_t> offsets;  // each parameter's offset in the bucket
    int64_t numel = 0, chunk = 0;  // elements; chunk c = ceil(numel / unit / W) · unit
    int64_t unit = 1;              // a chunk is whole units: an exchanged embedding's row, else 1
    int64_t shard_offset = 0;      // where this rank's chunk starts in the shard
    int64_t mine = 0;              // the real (unpadded) elements of this rank's chunk
    Tensor staging, out;           // [W·c] gradients; [c] this rank's averaged chunk when padded
    size_t pending = 0;            // parameters not staged yet this round
    WorkPtr work;
  };
  std::shared_ptr<ProcessGroup> pg;
  std::vector<Tensor> tensors;  // the parameters, in flat order
  std::vector<std::string> names;
  std::vector<Bucket> buckets;
  std::vector<RowExchange> rows;  // the exchange_rows embeddings (Note [ZeRO-2 row exchange])
  double gather_limit = 1.0;
  std::vector<size_t> bucket_of, slot_of;  // per parameter: bucket, position in it
  std::vector<bool> staged;
  Tensor shard_grad;  // [shard numel] this round's averaged gradient
  Device device = kCPU;
  int64_t shard_numel = 0;
  size_t next_issue = 0, next_done = 0;
  bool sync = true, open = false, finished = false;
  std::mutex mu;

  void open_round() {
    if (open) return;
    open = true;
    finished = false;
    shard_grad = empty({shard_numel}, DType::f32, device);  // each bucket writes its chunk once a round
    for (Bucket& b : buckets) b.pending = b.params.size();
    std::fill(staged.begin(), staged.end(), false);
    next_issue = next_done = 0;
    for (RowExchange& r : rows) r.reset();
  }
  // Copies parameter i's gradient (zeros without one) into its bucket slot and releases it. A
  // parameter alone in its bucket with no padding (GPT's tied embedding) is reduced from its
  // gradient itself, with no staging copy.
  void stage(size_t i) {
    Bucket& b = buckets[bucket_of[i]];
    const Tensor g = tensors[i].grad();
    if (g.defined())
      BLU_CHECK(g.shape() == tensors[i].shape() && g.dtype() == DType::f32, "ZeroAdamW: gradient of '", names[i],
                "' is ", g.str(), ", expected ", tensors[i].str());
    if (g.defined() && g.is_contiguous() && b.params.size() == 1 && b.numel == b.chunk * pg->size()) {
      b.staging = reshape(g, {g.numel()});
    } else {
      if (!b.staging.defined()) b.staging = zeros({b.chunk * pg->size()}, DType::f32, device);
      if (g.defined()) copy_(narrow(b.staging, 0, b.offsets[slot_of[i]], g.numel()), reshape(g, {g.numel()}));
    }
    if (g.defined()) tensors[i].zero_grad();  // released: stage 2 keeps only the shard
    staged[i] = true;
    --b.pending;
  }
  void complete(size_t k) {
    Bucket& b = buckets[k];
    b.work->wait();
    if (b.out.defined() && b.mine > 0) copy_(narrow(shard_grad, 0, b.shard_offset, b.mine), narrow(b.out, 0, 0, b.mine));
    b.work.reset();
    b.staging = b.out = Tensor();
  }
  // Buckets in order as they complete; after the last bucket, the rows in order as they arrive.
  void issue_ready() {
    while (next_issue < buckets.size() && buckets[next_issue].pending == 0) {
      Bucket& b = buckets[next_issue++];
      // A whole chunk lands straight in the shard gradient; a padded one (the last ranks') via [c].
      const Tensor dst = b.mine == b.chunk ? narrow(shard_grad, 0, b.shard_offset, b.chunk)
                                           : (b.out = empty({b.chunk}, DType::f32, device));
      b.work = pg->reduce_scatter(dst, b.staging, ReduceOp::avg);
      while (next_issue - next_done > kInFlight) complete(next_done++);
    }
    if (next_issue < buckets.size()) return;
    for (RowExchange& r : rows) {
      if (r.issued()) continue;
      if (!r.received()) return;
      const Bucket& b = buckets[bucket_of[r.param()]];
      r.issue(*pg, tensors[r.param()].shape()[0], gather_limit, b.chunk / b.unit);
    }
  }
  // After every bucket is complete: the exchanged rows, averaged, into this rank's rows of the
  // shard gradient (its chunk of the weight's bucket: whole rows).
  void add_rows(RowExchange& r) {
    const Bucket& b = buckets[bucket_of[r.param()]];
    const int64_t C = b.unit;
    r.add_into(reshape(narrow(shard_grad, 0, b.shard_offset, b.mine), {b.mine / C, C}),
               int64_t(pg->rank()) * (b.chunk / C), pg->size());
  }
  // The row sink of rows[k]'s embedding: the gradient of its output for ids `idx`.
  void on_rows(size_t k, const Tensor& idx, const Tensor& g) {
    std::lock_guard lock(mu);
    NoGradGuard no_grad;
    RowExchange& r = rows[k];
    Tensor& w = tensors[r.param()];
    if (!sync) {  // gradient accumulation: into the local gradient now
      Tensor gw = w.grad();
      if (!gw.defined()) {
        gw = zeros(w.shape(), DType::f32, device);
        w.set_grad(gw);
      }
      RowExchange::add_locally(gw, idx, g);
      return;
    }
    open_round();
    r.receive(idx, g, "ZeroAdamW: " + names[r.param()], DType::f32);
    issue_ready();
  }
  void on_grad(size_t i) {
    std::lock_guard lock(mu);
    if (!sync) return;  // accumulation: the gradient stays in .grad until the synced backward
    NoGradGuard no_grad;
    open_round();
    BLU_CHECK(!staged[i], "ZeroAdamW: parameter '", names[i], "' received a second gradient before the step; ",
              "for gradient accumulation run the earlier micro-batches with set_sync(false)");
    stage(i);
    issue_ready();
  }
  void finish() {
    std::lock_guard lock(mu);
    if (finished) return;
    NoGradGuard no_grad;
    open_round();
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!staged[i]) stage(i);
    issue_ready();
    while (next_done < next_issue) complete(next_done++);
    open = false;
    std::string missing;
    for (const RowExchange& r : rows)
      if (!r.issued()) missing += (missing.empty() ? "'" : ", '") + names[r.param()] + "'";
    if (!missing.empty()) {
      for (RowExchange& r : rows) r.reset();
      BLU_CHECK(false, "ZeroAdamW: no embedding rows arrived this step for ", missing,
                " (exchange_rows needs the embedding used in every synced backward, on every rank)");
    }
    try {
      for (RowExchange& r : rows) add_rows(r);
    } catch (...) {
      for (RowExchange& r : rows) r.reset();
      throw;
    }
    finished = true;
  }
  // The step has used the shard gradient: it is freed, and the next reduce_gradients() starts a new
  // round even without a backward in between (gradients set by hand).
  void consume() {
    std::lock_guard lock(mu);
    finished = false;
    shard_grad = Tensor();  // not kept through the next forward
  }
};

double zero2_staging_bytes(double elements, double largest, double bytes_per_element, double bucket_mib) {
  return std::min(bytes_per_element * std::max(0.0, elements - largest),
                  double(kBucketsInFlight + 1) * bucket_mib * double(1 << 20));
}

ZeroOptions zero_options_for(const nn::Module& model, double bucket_mib, nn::Embedding* tied, bool exchange_rows) {
  ZeroOptions o;
  o.bucket_mib = bucket_mib;
  for (const auto& [name, t] : model.named_parameters()) {
    o.reduce_order.push_back(name);
    if (tied && t.storage() == tied->weight.storage() && t.raw_data() == tied->weight.raw_data()) o.solo = {name};
  }
  std::reverse(o.reduce_order.begin(), o.reduce_order.end());
  if (tied) {
    BLU_CHECK(!o.solo.empty(), "zero_options_for: the tied embedding (weight ", tied->weight.str(),
              ") is not one of the model's parameters");
    if (exchange_rows) o.exchange_rows = {tied};
  }
  return o;
}

ZeroAdamW::ZeroAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions options,
                     std::shared_ptr<ProcessGroup> pg, int stage, ZeroOptions zero)
    : options_(options), pg_(std::move(pg)), stage_(stage) {
  BLU_CHECK(pg_, "ZeroAdamW: null process group");
  BLU_CHECK(stage >= 1 && stage <= 3, "ZeroAdamW: stage must be 1, 2 or 3, got ", stage);
  BLU_CHECK(zero.bucket_mib > 0, "ZeroAdamW: bucket_mib must be > 0, got ", zero.bucket_mib);
  // The same option checks as optim's AdamW (which this must match).
  optim::make_adamw({}, options);
  groups_ = std::move(groups);
  lr_ = options.lr;
  for (const auto& ref : optim::detail::flatten_groups(groups_, "ZeroAdamW")) {
    BLU_CHECK(ref.param.is_contiguous(), "ZeroAdamW: parameter '", ref.name, "' is not contiguous");
    BLU_CHECK(ref.param.dtype() == DType::f32, "ZeroAdamW: parameter '", ref.name, "' is ", ref.param.dtype(),
              ", expected f32 (master weights)");
    params_.push_back({ref.name, ref.param, ref.weight_decay, total_});
    total_ += ref.param.numel();
  }
  // Shards, state and staging buffers live on the parameters' device (NCCL for CUDA tensors).
  device_ = params_.empty() ? kCPU : params_[0].tensor.device();
  for (const Param& p : params_)
    BLU_CHECK(p.tensor.device() == device_, "ZeroAdamW: parameter '", p.name, "' is on ", p.tensor.device(),
              ", the first one on ", device_, " (one device per rank)");
  const int W = pg_->size(), r = pg_->rank();
  BLU_CHECK(stage == 2 || zero.exchange_rows.empty(), "ZeroAdamW: exchange_rows is for stage 2; stage 1 gets its ",
            "gradients from DDP (give the embedding to DDPOptions::exchange_rows), stage 3 reduces whole units");
  BLU_CHECK(stage == 3 || zero.units.empty(), "ZeroAdamW: ZeroOptions::units is for stage 3, got stage ", stage);
  if (stage == 3) {
    build_stage3(zero);
  } else if (stage == 1) {
    chunk_ = std::max<int64_t>(1, (total_ + W - 1) / W);
    const int64_t begin = std::min(total_, int64_t(r) * chunk_), end = std::min(total_, int64_t(r + 1) * chunk_);
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t lo = std::max(begin, params_[i].offset);
      const int64_t hi = std::min(end, params_[i].offset + params_[i].tensor.numel());
      if (lo < hi) segments_.push_back({i, lo - params_[i].offset, lo - begin, hi - lo});
    }
    shard_numel_ = end - begin;
  } else {
    auto red = std::make_shared<Reducer>();
    // Row-exchange weights first, a bucket each: their gradient (the LM head's part) comes first.
    std::vector<size_t> order;
    std::vector<bool> placed(params_.size(), false);
    std::vector<Tensor> tensors;
    for (const Param& p : params_) tensors.push_back(p.tensor);
    for (nn::Embedding* emb : zero.exchange_rows) {
      const size_t k = RowExchange::find_weight(tensors, emb, "ZeroAdamW", "is not one of the optimizer's parameters");
      BLU_CHECK(!placed[k] && !emb->has_row_grad_sink(), "ZeroAdamW: the embedding '", params_[k].name,
                "' already has a row sink (listed twice, or under a DDP or another optimizer)");
      order.push_back(k);
      placed[k] = true;
      red->rows.emplace_back(emb, k);
    }
    red->gather_limit = zero.rows_gather_limit;
    // Then the listed names, then the rest in reverse flat order.
    for (const std::string& name : zero.reduce_order)
      for (size_t i = 0; i < params_.size(); ++i)
        if (!placed[i] && params_[i].name == name) {
          order.push_back(i);
          placed[i] = true;
        }
    for (size_t i = params_.size(); i-- > 0;)
      if (!placed[i]) order.push_back(i);
    red->pg = pg_;
    red->device = device_;
    for (const Param& p : params_) {
      red->tensors.push_back(p.tensor);
      red->names.push_back(p.name);
    }
    red->bucket_of.assign(params_.size(), 0);
    red->slot_of.assign(params_.size(), 0);
    red->staged.assign(params_.size(), false);
    const int64_t cap = std::max<int64_t>(1, int64_t(zero.bucket_mib * 1024 * 1024 / 4));
    for (const std::string& name : zero.solo)
      BLU_CHECK(std::any_of(params_.begin(), params_.end(), [&](const Param& p) { return p.name == name; }),
                "ZeroAdamW: ZeroOptions::solo names '", name, "', which is not one of the optimizer's parameters");
    auto exchanged = [&](size_t i) {
      return std::any_of(red->rows.begin(), red->rows.end(), [&](const RowExchange& rw) { return rw.param() == i; });
    };
    auto is_solo = [&](size_t i) {
      return exchanged(i) || std::find(zero.solo.begin(), zero.solo.end(), params_[i].name) != zero.solo.end();
    };
    bool after_solo = false;
    for (size_t i : order) {
      const int64_t n = params_[i].tensor.numel();
      if (red->buckets.empty() || after_solo || is_solo(i) ||
          (red->buckets.back().numel > 0 && red->buckets.back().numel + n > cap))
        red->buckets.emplace_back();
      after_solo = is_solo(i);
      Reducer::Bucket& b = red->buckets.back();
      red->bucket_of[i] = red->buckets.size() - 1;
      red->slot_of[i] = b.params.size();
      b.params.push_back(i);
      b.offsets.push_back(b.numel);
      b.numel += n;
      if (exchanged(i)) b.unit = params_[i].tensor.shape()[1];
    }
    for (Reducer::Bucket& b : red->buckets) {
      b.chunk = std::max<int64_t>(1, (b.numel / b.unit + W - 1) / W) * b.unit;
      const int64_t lo = std::min(b.numel, int64_t(r) * b.chunk), hi = std::min(b.numel, int64_t(r + 1) * b.chunk);
      b.shard_offset = shard_numel_;
      b.mine = hi - lo;
      for (size_t j = 0; j < b.params.size(); ++j) {  // this rank's chunk, as pieces of parameters
        const int64_t p_lo = std::max(lo, b.offsets[j]);
        const int64_t p_hi = std::min(hi, b.offsets[j] + params_[b.params[j]].tensor.numel());
        if (p_lo < p_hi) segments_.push_back({b.params[j], p_lo - b.offsets[j], shard_numel_ + p_lo - lo, p_hi - p_lo});
      }
      shard_numel_ += b.mine;
    }
    red->shard_numel = shard_numel_;
    reducer_ = red;
    std::weak_ptr<Reducer> weak = red;
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].tensor.register_grad_hook([weak, i](Tensor&) {
        if (auto st = weak.lock()) st->on_grad(i);
      });
    for (size_t k = 0; k < red->rows.size(); ++k)
      red->rows[k].embedding()->set_row_grad_sink([weak, k](const Tensor& idx, const Tensor& g) {
        if (auto st = weak.lock()) st->on_rows(k, idx, g);
      });
  }
  BLU_CHECK(zero.offload_chunk_elements >= 0, "ZeroAdamW: offload_chunk_elements must be >= 0, got ",
            zero.offload_chunk_elements);
  if (zero.offload_chunk_elements == 0) {
    exp_avg_ = zeros({shard_numel_}, options_.state_dtype, device_);
    exp_avg_sq_ = zeros({shard_numel_}, options_.state_dtype, device_);
    return;
  }
  BLU_CHECK(options_.state_dtype == DType::f32, "ZeroAdamW: optimizer state offload keeps f32 moments; bf16 moments ",
            "(--adamw-state bf16) are held on the device only");
  BLU_CHECK(device_.is_cuda() || device_.index >= 1, "ZeroAdamW: optimizer state offload needs the parameters on a GPU ",
            "or a device pool cpu:N (N >= 1) apart from the host, got ", device_);
  Allocator& host = offload::host_allocator_for(device_);
  for (Tensor* t : {&exp_avg_, &exp_avg_sq_}) {
    *t = offload::empty_from(host, {shard_numel_}, DType::f32);
    std::memset(t->raw_data(), 0, t->nbytes());
  }
  engine_ = offload::make_copy_engine(device_);
  const int64_t chunk = std::max<int64_t>(1, std::min(zero.offload_chunk_elements, shard_numel_));
  for (int b = 0; b < 2; ++b) {
    stage_m_[b] = empty({chunk}, DType::f32, device_);
    stage_v_[b] = empty({chunk}, DType::f32, device_);
    tag_memory(stage_m_[b], MemoryCategory::optimizer_state, "ZeRO offload staging (exp_avg)");
    tag_memory(stage_v_[b], MemoryCategory::optimizer_state, "ZeRO offload staging (exp_avg_sq)");
  }
  // The first uploads into the staging buffers (on the in lane) wait for work the current stream
  // had queued on their blocks (the caching allocator hands a freed block back to it at once).
  pending_out_ = engine_->record(offload::Lane::compute);
}

ZeroAdamW::~ZeroAdamW() {
  if (engine_) engine_->host_wait(nullptr);  // downloads into the host moments end before they go
  if (gatherer_) shutdown_stage3();
  if (!reducer_) return;
  auto wait = [](const WorkPtr& w) {  // issued collectives finish before their buffers go
    if (w) try {
        w->wait();
      } catch (const std::exception&) {
      }
  };
  for (auto& b : reducer_->buckets) wait(b.work);
  for (auto& r : reducer_->rows) {
    r.reset();  // waits for what was issued
    r.embedding()->set_row_grad_sink({});  // its gradient flows into the weight again
  }
}

std::vector<std::pair<int64_t, int64_t>> ZeroAdamW::shard_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Segment& s : segments_) {
    const int64_t flat_offset = params_[s.param].offset + s.param_offset;
    if (!out.empty() && out.back().first + out.back().second == flat_offset) out.back().second += s.length;
    else out.emplace_back(flat_offset, s.length);
  }
  return out;
}

std::vector<std::vector<std::string>> ZeroAdamW::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  if (reducer_)
    for (const auto& b : reducer_->buckets) {
      out.emplace_back();
      for (size_t i : b.params) out.back().push_back(params_[i].name);
    }
  return out;
}

std::vector<std::string> ZeroAdamW::row_exchange_paths() const {
  std::vector<std::string> out;
  if (reducer_) {
    std::lock_guard lock(reducer_->mu);
    for (const auto& r : reducer_->rows) out.push_back(r.path());
  }
  return out;
}

void ZeroAdamW::set_sync(bool on) {
  BLU_CHECK(stage_ == 2, "ZeroAdamW::set_sync: stage 1 communicates through DDP (use its no_sync)");
  std::lock_guard lock(reducer_->mu);
  reducer_->sync = on;
}
bool ZeroAdamW::sync() const { return !reducer_ || reducer_->sync; }

void ZeroAdamW::reduce_gradients() {
  if (stage_ == 2) reducer_->finish();
  if (stage_ == 3) stage3_shard_grad();
}

Tensor ZeroAdamW::shard_gradient() {
  BLU_CHECK(stage_ >= 2, "ZeroAdamW::shard_gradient: stages 2 and 3 only (stage 1's gradients are the parameters')");
  if (stage_ == 3) return stage3_shard_grad();
  reduce_gradients();
  return reducer_->shard_grad;
}

Tensor ZeroAdamW::shard_sum_squares() {
  const Tensor g = shard_gradient();
  NoGradGuard no_grad;
  // This rank's sum of squares (sum_squares: f64 sums on the CPU, no copy of the shard), then summed
  // over the ranks in f64 on the device.
  Tensor sumsq = shard_numel_ > 0 ? to_dtype(reshape(sum_squares({g}), {1}), DType::f64) : zeros({1}, DType::f64, device_);
  pg_->all_reduce(sumsq, ReduceOp::sum)->wait();
  return sumsq;
}

std::vector<Tensor> ZeroAdamW::parameter_tensors() const {
  std::vector<Tensor> ts;
  for (const Param& p : params_) ts.push_back(p.tensor);
  return ts;
}

double ZeroAdamW::clip_grad_norm(double max_norm) {
  if (stage_ == 1) return optim::clip_grad_norm(parameter_tensors(), max_norm);
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  const Tensor sumsq = shard_sum_squares();
  const double norm = std::sqrt(to_vector(sumsq)[0]);
  if (!std::isfinite(norm)) return norm;
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    NoGradGuard no_grad;
    mul_(shard_gradient(), scale);
  }
  return norm;
}

NormGate ZeroAdamW::norm_gate(double max_norm) {
  if (stage_ == 1) return optim::grad_norm_gate(parameter_tensors(), max_norm);
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "norm_gate: max_norm must be > 0, got ", max_norm);
  NoGradGuard no_grad;
  return {.sum_squares = reshape(shard_sum_squares(), {}), .max_norm = max_norm};
}

void ZeroAdamW::step(const NormGate& gate) {
  NoGradGuard no_grad;
  Tensor shard_grad, shard_params;
  if (stage_ >= 2) shard_grad = shard_gradient();
  if (stage_ == 3) shard_params = stage3_shard_params();
  const int64_t t = steps_ + 1;
  std::map<double, std::vector<AdamWTensors>> by_decay;  // one adamw_step op per weight decay
  const AdamWStepArgs args{.lr = lr_, .beta1 = options_.beta1, .beta2 = options_.beta2, .eps = options_.eps,
                           .weight_decay = 0.0 /* each group's, below */, .step = t};
  struct Piece {  // a segment's parameter and gradient; its moments are [shard, shard + length)
    Tensor w, g;
    int64_t shard, length;
    double decay;
  };
  std::vector<Piece> pieces;
  for (const Segment& s : segments_) {
    const Param& p = params_[s.param];
    Tensor g, w;
    if (stage_ == 3) {
      g = narrow(shard_grad, 0, s.padded_offset, s.length);
      w = narrow(shard_params, 0, s.padded_offset, s.length);
    } else if (stage_ == 2) {
      g = narrow(shard_grad, 0, s.shard_offset, s.length);
    } else {
      const Tensor full_grad = p.tensor.grad();
      BLU_CHECK(full_grad.defined(), "ZeroAdamW (stage 1): parameter '", p.name, "' has no gradient; ",
                "call DistributedDataParallel::finish() before step()");
      g = narrow(reshape(full_grad, {full_grad.numel()}), 0, s.param_offset, s.length);
    }
    if (!w.defined()) w = narrow(flat(p.tensor), 0, s.param_offset, s.length);
    pieces.push_back({w, g, s.shard_offset, s.length, p.weight_decay});
  }
  if (!engine_) {
    for (const Piece& pc : pieces)
      by_decay[pc.decay].push_back({pc.w, pc.g, narrow(exp_avg_, 0, pc.shard, pc.length),
                                    narrow(exp_avg_sq_, 0, pc.shard, pc.length), Tensor()});
    for (const auto& [wd, tensors] : by_decay) {
      AdamWStepArgs a = args;
      a.weight_decay = wd;
      adamw_step_(tensors, a, gate);
    }
  } else {
    // The moments stream through the device in chunks of the shard's flat range: chunk c's come in
    // on the in lane (after the buffer's previous chunk went out), the pieces of the segments that
    // fall in it are updated on the compute lane, and the moments go back on the out lane.
    const int64_t cap = stage_m_[0].numel();
    const auto span = [&](size_t c) {
      const int64_t c0 = int64_t(c) * cap;
      return std::pair<int64_t, int64_t>{c0, std::min(cap, shard_numel_ - c0)};
    };
    offload::stream_through_slots(
        *engine_, size_t((shard_numel_ + cap - 1) / cap), pending_out_,
        [&](size_t c, int b) {
          const auto [c0, n] = span(c);
          engine_->copy(narrow(stage_m_[b], 0, 0, n), narrow(exp_avg_, 0, c0, n), offload::Lane::in);
          engine_->copy(narrow(stage_v_[b], 0, 0, n), narrow(exp_avg_sq_, 0, c0, n), offload::Lane::in);
        },
        [&](size_t c, int b) {
          const auto [c0, n] = span(c);
          by_decay.clear();
          for (const Piece& pc : pieces) {
            const int64_t lo = std::max(c0, pc.shard), hi = std::min(c0 + n, pc.shard + pc.length);
            if (lo >= hi) continue;
            by_decay[pc.decay].push_back({narrow(pc.w, 0, lo - pc.shard, hi - lo), narrow(pc.g, 0, lo - pc.shard, hi - lo),
                                          narrow(stage_m_[b], 0, lo - c0, hi - lo), narrow(stage_v_[b], 0, lo - c0, hi - lo),
                                          Tensor()});
          }
          for (const auto& [wd, tensors] : by_decay) {
            AdamWStepArgs a = args;
            a.weight_decay = wd;
            adamw_step_(tensors, a, gate);
          }
        },
        [&](size_t c, int b) {
          const auto [c0, n] = span(c);
          engine_->copy(narrow(exp_avg_, 0, c0, n), narrow(stage_m_[b], 0, 0, n), offload::Lane::out);
          engine_->copy(narrow(exp_avg_sq_, 0, c0, n), narrow(stage_v_[b], 0, 0, n), offload::Lane::out);
        });
  }
  if (stage_ < 3) gather_parameters();  // stage 3 gathers the units when they are next used
  if (reducer_) reducer_->consume();
  ++steps_;
}

// Every rank contributes its updated shard; all receive the whole parameters. Stage 1: the flat
// slices, in rank order. Stage 2: chunk r of every bucket, rank r's send buffer padded to Σ c, so
// the gathered [W][Σ c] holds chunk q of bucket b in row q, at b's columns.
void ZeroAdamW::gather_parameters() {
  const int W = pg_->size();
  // Every piece moves in one copy_many_ each way (a copy_ per piece would be ~2 × 150 launches a
  // step, issued after clip_grad_norm's host sync while the GPU waits).
  std::vector<Tensor> to, from;
  auto piece = [&](const Tensor& dst, const Tensor& src) {
    to.push_back(dst);
    from.push_back(src);
  };
  auto flush = [&] {
    copy_many_(to, from);
    to.clear();
    from.clear();
  };
  if (stage_ == 1) {
    Tensor send = zeros({chunk_}, DType::f32, device_), recv = empty({chunk_ * W}, DType::f32, device_);
    for (const Segment& s : segments_)
      piece(narrow(send, 0, s.shard_offset, s.length), narrow(flat(params_[s.param].tensor), 0, s.param_offset, s.length));
    flush();
    pg_->all_gather(recv, send)->wait();
    for (const Param& p : params_) piece(flat(p.tensor), narrow(recv, 0, p.offset, p.tensor.numel()));
    flush();
    return;
  }
  int64_t padded = 0;
  std::vector<int64_t> cols;  // each bucket's column in the send buffer and in each row of recv
  for (const auto& b : reducer_->buckets) {
    cols.push_back(padded);
    padded += b.chunk;
  }
  // f(the piece of a parameter inside chunk q of bucket b, its offset in the chunk), per parameter.
  auto chunk_pieces = [&](const Reducer::Bucket& b, int q, auto&& f) {
    const int64_t lo = std::min(b.numel, int64_t(q) * b.chunk), hi = std::min(b.numel, lo + b.chunk);
    for (size_t j = 0; j < b.params.size(); ++j) {
      const Tensor& t = params_[b.params[j]].tensor;
      const int64_t p_lo = std::max(lo, b.offsets[j]), p_hi = std::min(hi, b.offsets[j] + t.numel());
      if (p_lo < p_hi) f(narrow(flat(t), 0, p_lo - b.offsets[j], p_hi - p_lo), p_lo - lo);
    }
  };
  Tensor send = zeros({padded}, DType::f32, device_), recv = empty({padded * W}, DType::f32, device_);
  for (size_t k = 0; k < reducer_->buckets.size(); ++k)  // this rank's chunk of each bucket, from the parameters
    chunk_pieces(reducer_->buckets[k], pg_->rank(),
                 [&](const Tensor& p, int64_t at) { piece(narrow(send, 0, cols[k] + at, p.numel()), p); });
  flush();
  pg_->all_gather(recv, send)->wait();
  // Each rank's chunk of each bucket straight into the parameters' pieces (no bucket-sized copy).
  for (size_t k = 0; k < reducer_->buckets.size(); ++k)
    for (int q = 0; q < W; ++q)
      chunk_pieces(reducer_->buckets[k], q,
                   [&](const Tensor& p, int64_t at) { piece(p, narrow(recv, 0, q * padded + cols[k] + at, p.numel())); });
  flush();
}

nn::NamedTensors ZeroAdamW::state() const {
  if (engine_) engine_->host_wait(nullptr);  // the last step's moments have landed on the host
  return {{"step", optim::detail::count_tensor(steps_)}, {"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
}

void ZeroAdamW::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
  BLU_CHECK(m.size() == 3 && m.count("step") && m.count("exp_avg") && m.count("exp_avg_sq"),
            "ZeroAdamW state: expected exactly 'step', 'exp_avg', 'exp_avg_sq' (", state.size(), " entries given)");
  for (const char* k : {"exp_avg", "exp_avg_sq"})
    BLU_CHECK(m[k].shape() == Shape{shard_numel_}, "ZeroAdamW state: '", k, "' has shape ", m[k].shape(),
              ", this rank's shard is [", shard_numel_, "] (another world size or stage? use load_sharded_checkpoint)");
  const int64_t step = optim::detail::read_count(m["step"], "step");
  NoGradGuard no_grad;
  if (engine_) engine_->host_wait(nullptr);  // no download still writes the host moments
  copy_(exp_avg_, to_device(m["exp_avg"], exp_avg_.device()));  // loaded on the host; the state may be on a GPU
  copy_(exp_avg_sq_, to_device(m["exp_avg_sq"], exp_avg_sq_.device()));
  steps_ = step;
}

}  // namespace blu::dist
