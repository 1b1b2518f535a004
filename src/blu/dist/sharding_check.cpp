#include "blu/dist/sharding_check.h"

#include "blu/core/error.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/ops/dispatch.h"

namespace blu::dist {

namespace {
ShardingCheck* g_active = nullptr;
}

ShardingCheck* ShardingCheck::active() { return g_active; }

ShardingCheck::ShardingCheck(bool throw_on_refusal) : throw_(throw_on_refusal) {
  BLU_CHECK(!g_active, "ShardingCheck: another check is active");
  g_active = this;
  observer_ = add_op_observer([this](const OpDef& op, std::span<const Tensor> in, std::span<const Tensor> out,
                                     const Attrs& attrs) { observe(op, in, out, attrs); });
}

ShardingCheck::~ShardingCheck() {
  remove_op_observer(observer_);
  g_active = nullptr;
}

void ShardingCheck::place_parameters(nn::Module& model) {
  for (const ShardedParameter& s : sharded_parameters(model)) {
    const ShardInfo& i = s.info;
    set(s.param, i.sharded() ? Placement::shard(i.dim - int64_t(i.full_shape.size())) : Placement::replicate());
  }
}

void ShardingCheck::set(const Tensor& t, Placement p) {
  if (!t.defined()) return;
  known_[t.impl_ptr().get()] = Entry{t.impl_ptr(), p};
}

std::optional<Placement> ShardingCheck::get(const Tensor& t) const {
  if (!t.defined() || !is_floating(t.dtype())) return Placement::replicate();
  auto it = known_.find(t.impl_ptr().get());
  if (it == known_.end() || it->second.impl.lock() != t.impl_ptr()) return std::nullopt;
  return it->second.placement;
}

void ShardingCheck::refuse(std::string message) {
  refusals_.push_back(message);
  BLU_CHECK(!throw_, message);
}

void ShardingCheck::collective(const char* name, const Tensor& in, Placement want, const Tensor& out, Placement gives) {
  const std::optional<Placement> p = get(in);
  if (p && *p != want)
    refuse(std::string("sharding check: ") + name + " expects a " + want.str() + " input, got " + p->str());
  set(out, gives);
}

void ShardingCheck::observe(const OpDef& op, std::span<const Tensor> in, std::span<const Tensor> out,
                            const Attrs& attrs) {
  if (!op.shard) return;
  std::vector<Placement> places;
  for (const Tensor& t : in) {
    const std::optional<Placement> p = get(t);
    if (!p) return;  // an input the check does not know: not checked
    places.push_back(*p);
  }
  std::vector<Placement> got(out.size());
  ++checked_;
  if (!op.shard(places, in, attrs, got)) {
    std::string what;
    for (size_t i = 0; i < places.size(); ++i) {
      what += (i ? ", " : "") + places[i].str();
      if (in[i].defined()) what += " " + to_string(in[i].shape());
    }
    refuse(std::string("sharding check: op '") + op.name + "' cannot run on placements (" + what +
           "): a collective is missing or misplaced before it");
    return;
  }
  for (size_t j = 0; j < got.size() && j < out.size(); ++j) set(out[j], got[j]);  // cleared: untracked
}

}  // namespace blu::dist
