// dist/ddp: buckets, grad hooks, in-order issue of the bucket all-reduces, finish().
#include "blu/dist/ddp.h"

#include <mutex>

#include "blu/core/grad_mode.h"
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

struct DistributedDataParallel::State {
  struct Param {
    std::string name;
    Tensor tensor;
    size_t bucket = 0;
    int64_t offset = 0;  // in the bucket's buffer, elements
    bool ready = false;  // its gradient for this step is in the bucket buffer
  };
  struct Bucket {
    Tensor buffer;  // 1-d, the bucket's dtype
    std::vector<size_t> params;
    size_t pending = 0;  // parameters whose gradient has not arrived yet
    WorkPtr work;        // set once issued
  };
  std::shared_ptr<ProcessGroup> pg;
  std::vector<Param> params;
  std::vector<Bucket> buckets;
  size_t next_issue = 0;  // buckets [0, next_issue) are issued
  bool sync = true;
  std::mutex mu;

  void reset_step() {
    for (Param& p : params) p.ready = false;
    for (Bucket& b : buckets) {
      b.pending = b.params.size();
      b.work.reset();
    }
    next_issue = 0;
  }

  Tensor slot(const Param& p) const {
    return view(narrow(buckets[p.bucket].buffer, 0, p.offset, p.tensor.numel()), p.tensor.shape());
  }

  // Puts p's gradient (zeros when it has none) into its bucket slot.
  void stage(Param& p) {
    const Tensor g = p.tensor.grad();
    const Tensor s = slot(p);
    if (g.defined()) {
      BLU_CHECK(g.shape() == p.tensor.shape() && g.dtype() == p.tensor.dtype(), "DDP: gradient of '", p.name,
                "' is ", g.str(), ", expected the parameter's shape and dtype (", p.tensor.str(), ")");
      copy_(s, g);
    } else {
      fill_(s, 0.0);
    }
    p.ready = true;
    --buckets[p.bucket].pending;
  }

  void issue_ready() {
    while (next_issue < buckets.size() && buckets[next_issue].pending == 0) {
      Bucket& b = buckets[next_issue++];
      b.work = pg->all_reduce(b.buffer, ReduceOp::avg);
    }
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
  broadcast_parameters(module_, *pg_);
  State& s = *state_;
  s.pg = pg_;
  const nn::NamedTensors named = module_.named_parameters();
  for (const auto& [name, t] : named) {
    BLU_CHECK(t.requires_grad(), "DistributedDataParallel: parameter '", name, "' does not require grad");
    s.params.push_back({name, t});
  }
  // Buckets over the parameters in reverse registration order; a bucket holds one dtype.
  const double cap = options.bucket_mib * 1024 * 1024;
  std::vector<std::vector<size_t>> members;
  std::vector<DType> dtypes;
  double filled = 0;
  for (size_t k = s.params.size(); k-- > 0;) {
    const Tensor& t = s.params[k].tensor;
    const double bytes = double(t.nbytes());
    if (members.empty() || dtypes.back() != t.dtype() || (filled > 0 && filled + bytes > cap)) {
      members.emplace_back();
      dtypes.push_back(t.dtype());
      filled = 0;
    }
    members.back().push_back(k);
    filled += bytes;
  }
  for (size_t b = 0; b < members.size(); ++b) {
    State::Bucket bucket;
    int64_t n = 0;
    for (size_t k : members[b]) {
      s.params[k].bucket = b;
      s.params[k].offset = n;
      n += s.params[k].tensor.numel();
    }
    bucket.buffer = zeros({n}, dtypes[b], s.params[members[b][0]].tensor.device());
    bucket.params = members[b];
    s.buckets.push_back(std::move(bucket));
  }
  s.reset_step();
  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i)
    s.params[i].tensor.register_grad_hook([weak, i](Tensor&) {
      if (auto st = weak.lock()) st->on_grad(i);
    });
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& b : state_->buckets)
    if (b.work) try {
        b.work->wait();
      } catch (const std::exception&) {
      }
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
  // micro-batches) or zeros.
  for (auto& p : s.params)
    if (!p.ready) s.stage(p);
  s.issue_ready();
  BLU_ASSERT(s.next_issue == s.buckets.size(), "DDP: not every bucket was issued");
  std::exception_ptr failure;
  for (auto& b : s.buckets) try {
      b.work->wait();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  if (failure) {
    s.reset_step();
    std::rethrow_exception(failure);
  }
  for (auto& p : s.params) {
    Tensor g = p.tensor.grad();
    if (g.defined()) {
      copy_(g, s.slot(p));
    } else {
      p.tensor.set_grad(clone(s.slot(p)));
    }
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

}  // namespace blu::dist
