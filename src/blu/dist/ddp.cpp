// dist/ddp: buckets whose slices are the gradients, grad hooks, in-order issue of the bucket
// all-reduces, the embedding row exchange, finish().
#include "blu/dist/ddp.h"

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "blu/core/grad_mode.h"
#include "blu/dist/row_exchange.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::dist {

void broadcast_parameters(nn::Module& module, ProcessGroup& pg, int root) {
  NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> all = module.named_parameters();
  for (auto& nb : module.named_buffers())
    if (nb.second.defined() && is_floating(nb.second.dtype())) all.push_back(nb);
  std::vector<WorkPtr> works;
  for (auto& [name, t] : all) {
    BLU_CHECK(t.is_contiguous(), "broadcast_parameters: '", name, "' is not contiguous (", t.str(), ")");
    works.push_back(pg.broadcast(t, root));
  }
  for (auto& w : works) w->wait();
}

namespace {

// `g` is the bucket view `v` itself (or another handle to the same elements).
bool is_view_of(const Tensor& g, const Tensor& v) {
  return g.storage() == v.storage() && g.raw_data() == v.raw_data() && g.is_contiguous();
}

}  // namespace

struct DistributedDataParallel::State {
  struct Param {
    std::string name;
    Tensor tensor;
    Tensor view;  // its slice of the bucket buffer, the parameter's shape: its grad slot
    size_t bucket = 0;
    bool ready = false;  // its gradient for this step is in the bucket buffer
  };
  struct Bucket {
    Tensor buffer;  // 1-d, the bucket's dtype
    Tensor wire;    // the buffer cast to DDPOptions::reduce_dtype while its all-reduce runs (else undefined)
    std::vector<size_t> params;
    size_t pending = 0;  // parameters whose gradient has not arrived yet
    WorkPtr work;        // set once issued
  };
  std::shared_ptr<ProcessGroup> pg;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  std::vector<RowExchange> rows;  // the exchange_rows embeddings (Row exchange in ddp.h)
  std::vector<bool> rows_warned;
  double gather_limit = 1.0;
  std::optional<DType> reduce_dtype;
  size_t next_issue = 0;  // buckets [0, next_issue) are issued
  bool sync = true;
  int64_t copied = 0;  // gradients that were not their bucket view (copied_gradients())
  std::mutex mu;

  void reset_step() {
    for (Param& p : params) p.ready = false;
    for (Bucket& b : buckets) {
      b.pending = b.params.size();
      b.work.reset();
      b.wire = Tensor();
    }
    for (RowExchange& r : rows) r.reset();
    next_issue = 0;
  }

  // Makes sure p's bucket slice holds its gradient (zeros when it has none) and marks it ready.
  // The fast path does nothing: the engine accumulated straight into the view.
  void stage(Param& p) {
    const Tensor g = p.tensor.grad();
    if (!g.defined()) {
      fill_(p.view, 0.0);
    } else if (!is_view_of(g, p.view)) {
      BLU_CHECK(g.shape() == p.tensor.shape() && g.dtype() == p.tensor.dtype(), "DDP: gradient of '", p.name,
                "' is ", g.str(), ", expected the parameter's shape and dtype (", p.tensor.str(), ")");
      copy_(p.view, g);
      if (copied++ == 0)
        std::fprintf(stderr,
                     "DDP: the gradient of '%s' is not its bucket view (was .grad replaced?); copying it into the "
                     "bucket, and finish() makes .grad the view again (reported once)\n",
                     p.name.c_str());
    }
    p.ready = true;
    --buckets[p.bucket].pending;
  }

  // Buckets in order as they complete; after the last bucket, the rows in order as they arrive.
  void issue_ready() {
    while (next_issue < buckets.size() && buckets[next_issue].pending == 0) {
      Bucket& b = buckets[next_issue++];
      if (reduce_dtype && dtype_size(*reduce_dtype) < dtype_size(b.buffer.dtype())) {
        NoGradGuard no_grad;
        b.wire = to_dtype(b.buffer, *reduce_dtype);
        b.work = pg->all_reduce(b.wire, ReduceOp::avg);
      } else {
        b.work = pg->all_reduce(b.buffer, ReduceOp::avg);
      }
    }
    if (next_issue < buckets.size()) return;
    for (RowExchange& r : rows) {
      if (r.issued()) continue;
      if (!r.received()) return;
      r.issue(*pg, params[r.param()].tensor.shape()[0], gather_limit, 0);
    }
  }

  // The row sink of rows[k]'s embedding: the gradient of its output for ids `idx`.
  void on_rows(size_t k, const Tensor& idx, const Tensor& g) {
    std::lock_guard lock(mu);
    NoGradGuard no_grad;
    RowExchange& r = rows[k];
    Param& p = params[r.param()];
    if (!sync) {  // gradient accumulation: into the local gradient (the bucket view) now
      Tensor gw = p.tensor.grad();
      if (!gw.defined()) {
        fill_(p.view, 0.0);
        p.tensor.set_grad(p.view);
        gw = p.view;
      }
      RowExchange::add_locally(gw, idx, g);
      return;
    }
    r.receive(idx, g, "DDP: " + p.name, p.tensor.dtype());
    if (!p.ready && !rows_warned[k]) {
      rows_warned[k] = true;
      std::fprintf(stderr,
                   "DDP: row exchange for '%s': its dense gradient had not arrived when its rows did, so its "
                   "bucket (issued first) held the others back during backward; exchange_rows is meant for a tied "
                   "embedding (reported once)\n",
                   p.name.c_str());
    }
    issue_ready();
  }

  void on_grad(size_t i) {
    std::lock_guard lock(mu);
    if (!sync) return;
    Param& p = params[i];
    BLU_CHECK(!p.ready, "DDP: parameter '", p.name, "' received a second gradient before finish(); ",
              "for gradient accumulation run the earlier micro-batches under no_sync()");
    NoGradGuard no_grad;
    stage(p);
    issue_ready();
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> pg,
                                                 DDPOptions options)
    : module_(module), pg_(std::move(pg)), state_(std::make_shared<State>()) {
  BLU_CHECK(pg_, "DistributedDataParallel: null process group");
  BLU_CHECK(options.bucket_mib > 0, "DistributedDataParallel: bucket_mib must be > 0, got ", options.bucket_mib);
  BLU_CHECK(options.first_bucket_mib > 0, "DistributedDataParallel: first_bucket_mib must be > 0, got ",
            options.first_bucket_mib);
  broadcast_parameters(module_, *pg_);
  State& s = *state_;
  s.pg = pg_;
  s.gather_limit = options.rows_gather_limit;
  s.reduce_dtype = options.reduce_dtype;
  const nn::NamedTensors named = module_.named_parameters();
  for (const auto& [name, t] : named) {
    BLU_CHECK(t.requires_grad(), "DistributedDataParallel: parameter '", name, "' does not require grad");
    s.params.push_back({.name = name, .tensor = t, .view = Tensor(), .bucket = 0, .ready = false});
  }
  std::vector<bool> exchanged(s.params.size(), false);
  std::vector<Tensor> tensors;
  for (const State::Param& p : s.params) tensors.push_back(p.tensor);
  for (nn::Embedding* emb : options.exchange_rows) {
    const size_t k = RowExchange::find_weight(tensors, emb, "DistributedDataParallel", "is not part of the wrapped model");
    BLU_CHECK(!exchanged[k] && !emb->has_row_grad_sink(), "DistributedDataParallel: the embedding '",
              s.params[k].name, "' already has a row sink (listed twice, or under another DDP)");
    exchanged[k] = true;
    s.rows.emplace_back(emb, k);
    s.rows_warned.push_back(false);
  }
  // Buckets over the parameters in reverse registration order; a bucket holds one dtype. A
  // parameter that would overflow the open bucket opens the next one (unless the bucket is empty).
  const double first_cap = options.first_bucket_mib * 1024 * 1024, cap_rest = options.bucket_mib * 1024 * 1024;
  std::vector<std::vector<size_t>> members;
  std::vector<DType> dtypes;
  // Row-exchange weights first, one bucket each: their dense gradient comes first in backward.
  for (const RowExchange& r : s.rows) {
    members.push_back({r.param()});
    dtypes.push_back(s.params[r.param()].tensor.dtype());
  }
  const size_t n_row_buckets = members.size();
  double filled = 0, cap = first_cap;
  for (size_t k = s.params.size(); k-- > 0;) {
    if (exchanged[k]) continue;
    const Tensor& t = s.params[k].tensor;
    const double bytes = double(t.nbytes());
    if (members.size() == n_row_buckets || dtypes.back() != t.dtype() || (filled > 0 && filled + bytes > cap)) {
      cap = members.size() == n_row_buckets ? first_cap : cap_rest;
      members.emplace_back();
      dtypes.push_back(t.dtype());
      filled = 0;
    }
    members.back().push_back(k);
    filled += bytes;
  }
  NoGradGuard no_grad;
  for (size_t b = 0; b < members.size(); ++b) {
    // Each gradient starts on a 16-byte boundary, so the CUDA kernels' vectorised path (which
    // needs aligned operands) serves every gradient; the gaps stay zero through the all-reduces.
    const int64_t align = std::max<int64_t>(1, 16 / int64_t(dtype_size(dtypes[b])));
    auto aligned = [&](int64_t n) { return (n + align - 1) / align * align; };
    State::Bucket bucket;
    std::vector<int64_t> offsets;
    int64_t n = 0;
    for (size_t k : members[b]) {
      n = aligned(n);
      offsets.push_back(n);
      n += s.params[k].tensor.numel();
    }
    bucket.buffer = zeros({n}, dtypes[b], s.params[members[b][0]].tensor.device());
    for (size_t j = 0; j < members[b].size(); ++j) {
      State::Param& p = s.params[members[b][j]];
      p.bucket = b;
      p.view = view(narrow(bucket.buffer, 0, offsets[j], p.tensor.numel()), p.tensor.shape());
      // A gradient that already exists moves into the bucket; from now on the engine writes there.
      if (const Tensor g = p.tensor.grad(); g.defined()) {
        copy_(p.view, g);
        p.tensor.set_grad(p.view);
      }
      p.tensor.set_grad_slot(p.view);
    }
    bucket.params = members[b];
    s.buckets.push_back(std::move(bucket));
  }
  s.reset_step();
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i)
    s.params[i].tensor.register_grad_hook([weak, i](Tensor&) {
      if (auto st = weak.lock()) st->on_grad(i);
    });
  for (size_t k = 0; k < s.rows.size(); ++k)
    s.rows[k].embedding()->set_row_grad_sink([weak, k](const Tensor& idx, const Tensor& g) {
      if (auto st = weak.lock()) st->on_rows(k, idx, g);
    });
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& b : state_->buckets)
    if (b.work) try {
        b.work->wait();
      } catch (const std::exception&) {
      }
  for (auto& r : state_->rows) {
    r.reset();  // waits for what was issued
    r.embedding()->set_row_grad_sink({});  // its gradient flows into the weight again
  }
  // The engine stops writing into the buckets (unless another DDP has put its own slot there).
  for (auto& p : state_->params)
    if (const Tensor slot = p.tensor.grad_slot(); slot.defined() && is_view_of(slot, p.view))
      p.tensor.set_grad_slot(Tensor());
}

void DistributedDataParallel::set_sync(bool on) {
  std::lock_guard lock(state_->mu);
  state_->sync = on;
}

bool DistributedDataParallel::sync() const {
  std::lock_guard lock(state_->mu);
  return state_->sync;
}

void DistributedDataParallel::finish() {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  if (!s.sync) return;
  NoGradGuard no_grad;
  // Parameters whose hook did not fire this step: their local gradient (from earlier no_sync
  // micro-batches, already in the bucket) or zeros.
  for (auto& p : s.params)
    if (!p.ready) s.stage(p);
  s.issue_ready();
  BLU_ASSERT(s.next_issue == s.buckets.size(), "DDP: not every bucket was issued");
  std::string missing;
  for (auto& r : s.rows)
    if (!r.issued()) missing += (missing.empty() ? "'" : ", '") + s.params[r.param()].name + "'";
  std::exception_ptr failure;
  auto wait = [&](const WorkPtr& w) {
    try {
      w->wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  };
  for (auto& b : s.buckets) wait(b.work);
  if (failure || !missing.empty()) {
    s.reset_step();
    if (failure) std::rethrow_exception(failure);
    BLU_CHECK(false, "DDP: no embedding rows arrived this step for ", missing,
              " (exchange_rows needs the embedding used in every synced backward, on every rank)");
  }
  for (auto& b : s.buckets)  // averages that travelled narrower: back into their buckets
    if (b.wire.defined()) copy_(b.buffer, b.wire);
  // The averages are in the buckets. Gradients that are the views already hold them (the usual
  // case: only pointers are compared); the others (none, or a replaced tensor) become the view.
  for (auto& p : s.params)
    if (const Tensor g = p.tensor.grad(); !g.defined() || !is_view_of(g, p.view)) p.tensor.set_grad(p.view);
  // The rows, averaged, into their weights' averaged dense gradients.
  try {
    for (auto& r : s.rows) r.add_into(s.params[r.param()].view, 0, s.pg->size());
  } catch (...) {
    s.reset_step();
    throw;
  }
  s.reset_step();
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_layout() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : state_->buckets) {
    out.emplace_back();
    for (size_t k : b.params) out.back().push_back(state_->params[k].name);
  }
  return out;
}

Tensor DistributedDataParallel::bucket_buffer(size_t b) const {
  BLU_CHECK(b < state_->buckets.size(), "DDP: bucket ", b, " does not exist (", state_->buckets.size(), " buckets)");
  return state_->buckets[b].buffer;
}

std::vector<int> DistributedDataParallel::bucket_states() const {
  std::lock_guard lock(state_->mu);
  std::vector<int> out;
  for (const auto& b : state_->buckets) out.push_back(!b.work ? 0 : b.work->is_completed() ? 2 : 1);
  return out;
}

std::optional<DType> DistributedDataParallel::reduce_dtype() const { return state_->reduce_dtype; }

std::vector<std::string> DistributedDataParallel::row_exchange_paths() const {
  std::lock_guard lock(state_->mu);
  std::vector<std::string> out;
  for (const auto& r : state_->rows) out.push_back(r.path());
  return out;
}

int64_t DistributedDataParallel::copied_gradients() const {
  std::lock_guard lock(state_->mu);
  return state_->copied;
}

}  // namespace blu::dist
