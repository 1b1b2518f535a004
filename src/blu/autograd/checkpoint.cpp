#include "blu/autograd/checkpoint.h"

#include <memory>
#include <unordered_map>

#include "blu/autograd/function.h"
#include "blu/core/grad_mode.h"

namespace blu {

namespace {

thread_local int64_t t_rebuilds = 0;

class GradEnabled {  // grad mode on for a scope (the engine runs backwards with it off)
 public:
  GradEnabled() : prev_(GradMode::enabled()) { GradMode::set_enabled(true); }
  ~GradEnabled() { GradMode::set_enabled(prev_); }

 private:
  bool prev_;
};

struct GenState {
  Generator* gen;
  uint64_t seed, offset;
};

std::vector<GenState> take_states(const std::vector<Generator*>& gens) {
  std::vector<GenState> s;
  for (Generator* g : gens) s.push_back({g, g->seed(), g->offset()});
  return s;
}

void put_states(const std::vector<GenState>& s) {
  for (const GenState& g : s) g.gen->set_state(g.seed, g.offset);
}

struct Region {
  std::string name;
  RegionFn fn;
  std::vector<SavedSlot> inputs;
  std::vector<bool> needs_grad;
  std::vector<GenState> rng;  // the generators as the first run found them
  // The rebuilt graph, from the first need in backward until the region's own backward.
  std::vector<Tensor> leaves;
  Tensor out;

  const Tensor& rebuild() {
    if (out.defined()) return out;
    const std::vector<GenState> now = [&] {
      std::vector<Generator*> gens;
      for (const GenState& g : rng) gens.push_back(g.gen);
      return take_states(gens);
    }();
    put_states(rng);
    leaves.clear();
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor leaf = inputs[i].get().detach();
      if (needs_grad[i]) leaf.set_requires_grad(true);
      leaves.push_back(std::move(leaf));
    }
    {
      GradEnabled grad;
      try {
        out = fn(leaves);
      } catch (...) {
        put_states(now);
        throw;
      }
    }
    put_states(now);
    ++t_rebuilds;
    return out;
  }

  std::vector<Tensor> backward(const Tensor& grad_out) {
    rebuild();
    const Tensor y = std::move(out);
    out = Tensor();
    if (y.requires_grad()) y.backward(grad_out);
    std::vector<Tensor> grads(leaves.size());
    for (size_t i = 0; i < leaves.size(); ++i)
      if (needs_grad[i]) grads[i] = leaves[i].grad();
    leaves.clear();
    return grads;
  }
};

// Outputs of drop_output regions on this thread, by storage: the storage (to tell a reused address
// from the original) and the region.
struct Dropped {
  std::weak_ptr<Storage> storage;
  std::weak_ptr<Region> region;
};
thread_local std::unordered_map<const Storage*, Dropped> t_dropped;

void remember_dropped(const Tensor& out, const std::shared_ptr<Region>& region) {
  if (t_dropped.size() > 256)
    std::erase_if(t_dropped, [](const auto& e) { return e.second.storage.expired() || e.second.region.expired(); });
  t_dropped[out.storage().get()] = {out.storage(), region};
}

struct RebuildBox final : SavedBox {
  std::shared_ptr<Region> region;
  Shape shape, strides;
  int64_t offset;
  DType dtype;
  Tensor unpack() override {
    const Tensor& y = region->rebuild();
    return Tensor(y.storage(), shape, strides, offset, dtype);
  }
};

}  // namespace

Tensor checkpoint(std::string name, const RegionFn& fn, const std::vector<Tensor>& inputs,
                  const std::vector<Generator*>& generators, bool drop_output) {
  bool any = false;
  for (const Tensor& t : inputs) any |= t.defined() && t.requires_grad();
  if (!GradMode::enabled() || !any) return fn(inputs);

  auto region = std::make_shared<Region>();
  region->name = name;
  region->fn = fn;
  std::vector<Generator*> gens = generators;
  gens.push_back(&default_generator());
  region->rng = take_states(gens);
  for (const Tensor& t : inputs) {
    region->inputs.push_back(SavedSlot::save(t, false));
    region->needs_grad.push_back(t.defined() && t.requires_grad());
  }
  Tensor y;
  {
    NoGradGuard no_grad;
    y = fn(inputs);
  }
  BLU_CHECK(y.defined(), "checkpoint (", name, "): the region returned an undefined tensor");
  Tensor out = record_function(std::move(name), inputs, {y},
                               [region](const std::vector<Tensor>& g) { return region->backward(g[0]); })[0];
  if (drop_output) remember_dropped(out, region);
  return out;
}

PackHook recompute_pack_hook() {
  return [](const SavedInfo& info) -> std::shared_ptr<SavedBox> {
    const Tensor& t = info.t;
    const auto it = t_dropped.find(t.storage().get());
    if (it == t_dropped.end()) return nullptr;
    std::shared_ptr<Storage> s = it->second.storage.lock();
    std::shared_ptr<Region> region = it->second.region.lock();
    if (s != t.storage() || !region) return nullptr;
    auto box = std::make_shared<RebuildBox>();
    box->region = std::move(region);
    box->shape = t.shape(), box->strides = t.strides(), box->offset = t.offset(), box->dtype = t.dtype();
    return box;
  };
}

int64_t recompute_rebuild_count() { return t_rebuilds; }

}  // namespace blu
