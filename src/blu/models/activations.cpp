#include "blu/models/activations.h"

#include <cstdlib>
#include <optional>

#include "blu/core/grad_mode.h"
#include "blu/models/causal_lm.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"

namespace blu::models {

// --- policy ---

ActivationPolicy ActivationPolicy::parse(std::string_view recompute, bool offload_activations) {
  ActivationPolicy p;
  p.offload = offload_activations;
  const auto bad = [&] {
    BLU_CHECK(false,
              "--recompute: expected none, or selective, mlp, mlp:N, mlp-first:K, block, block:N, block-first:K "
              "(N, K >= 1) joined by + in that order (e.g. selective+block:2, mlp-first:9+block:4), got '",
              recompute, "'");
  };
  // ":N" (N >= 1) -> N.
  const auto count = [&](std::string_view n_text) -> int64_t {
    if (!n_text.starts_with(":") || n_text.size() < 2) bad();
    int64_t n = 0;
    for (char c : n_text.substr(1)) {
      if (c < '0' || c > '9' || n > 1'000'000) bad();
      n = n * 10 + (c - '0');
    }
    if (n < 1) bad();
    return n;
  };
  // The blocks of "<name>", "<name>:N" or "<name>-first:K"; none when `part` is not `name`'s.
  const auto blocks = [&](std::string_view part, std::string_view name) -> BlockSet {
    if (!part.starts_with(name)) return {};
    const std::string_view rest = part.substr(name.size());
    if (rest.empty()) return BlockSet::all();
    constexpr std::string_view kFirst = "-first";
    if (rest.starts_with(kFirst)) return {.first = count(rest.substr(kFirst.size()))};
    return {.every = count(rest)};
  };
  if (recompute == "none") return p;
  std::string_view rest = recompute;
  int next = 0;  // the parts in order: 0 selective, 1 mlp, 2 block
  while (true) {
    const size_t plus = rest.find('+');
    const std::string_view part = rest.substr(0, plus);
    if (part == "selective" && next <= 0) {
      p.selective = true;
      next = 1;
    } else if (const BlockSet m = blocks(part, "mlp"); m.any() && next <= 1) {
      p.mlp = m;
      next = 2;
    } else if (const BlockSet b = blocks(part, "block"); b.any() && next <= 2) {
      p.block = b;
      next = 3;
    } else {
      bad();
    }
    if (plus == std::string_view::npos) return p;
    rest.remove_prefix(plus + 1);
  }
}

std::string ActivationPolicy::recompute_name() const {
  std::string s;
  const auto add = [&](const char* name, const BlockSet& b) {
    s += (s.empty() ? "" : "+") + std::string(name);
    if (b.first > 0) s += "-first:" + std::to_string(b.first);
    else if (b.every > 1) s += ":" + std::to_string(b.every);
  };
  if (selective) s = "selective";
  if (mlp.any()) add("mlp", mlp);
  if (block.any()) add("block", block);
  return s.empty() ? "none" : s;
}

// --- selective regions ---

namespace {
thread_local bool t_selective = false;
thread_local bool t_mlp = false;
thread_local std::vector<Generator*> t_generators;
}  // namespace

SelectiveScope::SelectiveScope(std::vector<Generator*> generators, bool selective, bool mlp)
    : prev_(std::move(t_generators)), prev_selective_(t_selective), prev_mlp_(t_mlp) {
  t_generators = std::move(generators);
  t_selective = selective;
  t_mlp = mlp;
}

SelectiveScope::~SelectiveScope() {
  t_generators = std::move(prev_);
  t_selective = prev_selective_;
  t_mlp = prev_mlp_;
}

Tensor selective_region(const char* name, const RegionFn& fn, const std::vector<Tensor>& inputs) {
  if (!t_selective || !GradMode::enabled()) return fn(inputs);
  return checkpoint(name, fn, inputs, t_generators, /*drop_output=*/true);
}

Tensor mlp_region(const RegionFn& fn, const std::vector<Tensor>& inputs) {
  if (!t_mlp || !GradMode::enabled()) return fn(inputs);
  return checkpoint("mlp", fn, inputs, t_generators, /*drop_output=*/true);
}

// --- offload ---

struct ActivationOffloader::Entry {
  std::weak_ptr<Storage> source;  // the device storage (to tell a reused address apart)
  Device device;
  TransferTicket host;
  TransferTicket back;  // the device copy, once fetched
  void fetch() {
    if (!back.storage) back = host_transfer(device).to_device(host, device);
  }
};

namespace {

struct OffloadBox final : SavedBox {
  std::shared_ptr<void> entry;  // ActivationOffloader::Entry (private type)
  Tensor (*get)(const std::shared_ptr<void>&, const Shape&, const Shape&, int64_t, DType);
  Shape shape, strides;
  int64_t offset;
  DType dtype;
  Tensor unpack() override { return get(entry, shape, strides, offset, dtype); }
};

}  // namespace

std::shared_ptr<ActivationOffloader::Entry> ActivationOffloader::entry_for(const Tensor& t, size_t block) {
  const std::shared_ptr<Storage>& s = t.storage();
  if (auto it = by_storage_.find(s.get()); it != by_storage_.end()) {
    if (std::shared_ptr<Entry> e = it->second.lock(); e && e->source.lock() == s) return e;
  }
  if (by_storage_.size() > 4096)
    std::erase_if(by_storage_, [](const auto& kv) { return kv.second.expired(); });
  auto e = std::make_shared<Entry>();
  e->source = s;
  e->device = t.device();
  e->host = host_transfer(t.device()).to_host(s);
  by_storage_[s.get()] = e;
  if (by_block_.size() <= block) by_block_.resize(block + 1);
  std::vector<std::weak_ptr<Entry>>& list = by_block_[block];
  std::erase_if(list, [](const std::weak_ptr<Entry>& w) { return w.expired(); });
  list.push_back(e);
  bytes_ += int64_t(s->nbytes());
  ++count_;
  return e;
}

PackHook ActivationOffloader::hook(size_t block, const nn::Module& block_module) {
  return [this, block, &block_module](const SavedInfo& info) -> std::shared_ptr<SavedBox> {
    const Tensor& t = info.t;
    if (!info.fresh) {
      if (t.is_leaf() || !t.requires_grad()) return nullptr;  // parameters, tables, constants
      for (const auto& [param, copy] : block_module.compute_copies())
        if (copy->tensor().defined() && copy->tensor().storage() == t.storage()) return nullptr;
    }
    auto box = std::make_shared<OffloadBox>();
    box->entry = entry_for(t, block);
    box->get = [](const std::shared_ptr<void>& p, const Shape& shape, const Shape& strides, int64_t offset,
                  DType dtype) {
      auto* e = static_cast<Entry*>(p.get());
      e->fetch();
      host_transfer(e->device).wait(e->back);
      return Tensor(e->back.storage, shape, strides, offset, dtype);
    };
    box->shape = t.shape(), box->strides = t.strides(), box->offset = t.offset(), box->dtype = t.dtype();
    return box;
  };
}

void ActivationOffloader::prefetch(size_t block) {
  if (block >= by_block_.size()) return;
  for (const std::weak_ptr<Entry>& w : by_block_[block])
    if (std::shared_ptr<Entry> e = w.lock()) e->fetch();
}

// --- bytes per block ---

std::vector<ActivationBytes> activation_bytes(CausalLM& model, int64_t B, int64_t T, const ActivationPolicy& policy,
                                              size_t probe_block) {
  const size_t n = model.num_blocks();
  BLU_CHECK(n > 0 && B > 0 && T > 0, "activation_bytes: expected B, T > 0 and a model with blocks, got B ", B,
            ", T ", T, ", ", n, " blocks");
  BLU_CHECK(probe_block < n, "activation_bytes: block ", probe_block, " of a model with ", n, " blocks");
  const Tensor w = model.token_embedding().weight;
  const Device device = w.device();
  const DType dtype = model.compute_dtype();
  const int64_t C = w.size(1);
  Allocator& dev = allocator_for(device);
  Allocator& host = host_transfer(device).host_allocator();
  const ActivationPolicy saved = model.activation_policy();
  std::vector<Generator*> gens = model.generators();
  gens.push_back(&default_generator());
  std::vector<std::pair<uint64_t, uint64_t>> rng;
  for (Generator* g : gens) rng.emplace_back(g->seed(), g->offset());

  // The probe block under policy p on a fresh non-leaf input: the device bytes its graph holds once the
  // caller's handles to the input and the output are gone (the input counts when the graph keeps
  // it), and the host bytes it sent away.
  auto measure = [&](const ActivationPolicy& p) {
    model.set_activation_policy(p);
    Generator gen(1);
    Tensor leaf = randn({B, T, C}, dtype, device, &gen);
    leaf.set_requires_grad(true);
    Tensor input = mul(leaf, 1.0);
    const int64_t d0 = dev.stats().current_bytes - int64_t(input.storage()->nbytes());
    const int64_t h0 = host.stats().current_bytes;
    Tensor y = model.block(probe_block, input);
    input = Tensor();
    ActivationBytes b;
    b.kept = dev.stats().current_bytes - d0 - int64_t(y.storage()->nbytes());
    b.offloaded = host.stats().current_bytes - h0;
    return b;
  };
  {  // lazily made state (Llama's RoPE tables) is not an activation: make it before measuring
    NoGradGuard no_grad;
    model.set_activation_policy(ActivationPolicy{});
    model.block(probe_block, zeros({B, T, C}, dtype, device));
  }
  // The blocks are alike: the probe block stands for every block, measured once per way it can run.
  std::vector<ActivationBytes> out;
  try {
    const ActivationBytes full = measure(ActivationPolicy{});
    // The ways a block runs: whole-block recompute, or with its regions, the MLP's or not.
    std::optional<ActivationBytes> whole, with_mlp, part;
    for (size_t i = 0; i < n; ++i) {
      const bool rec = policy.recompute_block(i), mlp = !rec && policy.recompute_mlp(i);
      std::optional<ActivationBytes>& b = rec ? whole : mlp ? with_mlp : part;
      if (!b) {
        ActivationPolicy p = policy;
        p.block = rec ? BlockSet::all() : BlockSet{};
        p.mlp = mlp ? BlockSet::all() : BlockSet{};
        b = measure(p);
        b->recomputed = std::max<int64_t>(0, full.kept - b->kept - b->offloaded);
      }
      out.push_back(*b);
    }
  } catch (...) {
    model.set_activation_policy(saved);
    for (size_t k = 0; k < gens.size(); ++k) gens[k]->set_state(rng[k].first, rng[k].second);
    throw;
  }
  model.set_activation_policy(saved);
  for (size_t k = 0; k < gens.size(); ++k) gens[k]->set_state(rng[k].first, rng[k].second);
  return out;
}

ActivationTotals activation_totals(CausalLM& model, int64_t B, int64_t T, const ActivationPolicy& policy,
                                   const std::vector<int64_t>& blocks) {
  const std::vector<ActivationBytes> bytes =
      activation_bytes(model, B, T, policy, blocks.empty() ? 0 : size_t(blocks.front()));
  std::vector<size_t> counted;
  for (int64_t b : blocks) counted.push_back(size_t(b));
  if (blocks.empty())
    for (size_t i = 0; i < bytes.size(); ++i) counted.push_back(i);
  ActivationTotals t;
  t.blocks = int64_t(counted.size());
  const bool mlp = policy.mlp.any();
  t.regions = policy.selective && mlp ? "attention core, MLP"
               : policy.selective      ? "attention core, MLP activation"
               : mlp                   ? "MLP"
                                       : "";
  int64_t back = 0;  // the most one block's backward brings back
  for (size_t k = 0; k < counted.size(); ++k) {
    const size_t i = counted[k];
    BLU_CHECK(i < bytes.size(), "activation_totals: block ", i, " of a model with ", bytes.size(), " blocks");
    const ActivationBytes& b = bytes[i];
    if (policy.recompute_block(i) || policy.selective || policy.recompute_mlp(i)) ++t.recomputed_blocks;
    else if (policy.offload) ++t.offloaded_blocks;
    else ++t.kept_blocks;
    t.device_bytes += b.kept;
    t.host_bytes += b.offloaded;
    const int64_t prev = k > 0 ? bytes[counted[k - 1]].offloaded : 0;
    back = std::max(back, b.recomputed + (policy.offload ? b.offloaded + prev : 0));
  }
  t.device_bytes += back;
  return t;
}

}  // namespace blu::models
