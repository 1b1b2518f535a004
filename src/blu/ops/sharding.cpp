#include "blu/ops/sharding.h"

namespace blu {

std::string Placement::str() const {
  switch (kind) {
    case Kind::replicate: return "replicate";
    case Kind::shard: return "shard(" + std::to_string(dim) + ")";
    case Kind::partial: return "partial";
  }
  return "?";
}

namespace {

// The common shard dim of the defined inputs, or replicate; false on a mix of shard dims, on a
// shard dim an input of full extent there would have to hold whole, or on partial.
bool common_shard(std::span<const Placement> in, std::span<const Tensor> inputs, Placement& got) {
  got = Placement::replicate();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].is_partial()) return false;
    if (!in[i].is_shard()) continue;
    if (got.is_shard() && got.dim != in[i].dim) return false;
    got = in[i];
  }
  if (!got.is_shard()) return true;
  // A replicated input that has the sharded dim with more than one element would be combined
  // whole with a chunk: refused. (Broadcast along it — absent or of size 1 — is fine.)
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].is_replicate() || i >= inputs.size() || !inputs[i].defined()) continue;
    const int64_t d = inputs[i].dim() + got.dim;
    if (d >= 0 && inputs[i].size(d) != 1) return false;
  }
  return true;
}

}  // namespace

bool shard_rule_pointwise(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs&,
                          std::vector<Placement>& out) {
  Placement p;
  if (!common_shard(in, inputs, p)) return false;
  for (Placement& o : out) o = p;
  return true;
}

bool shard_rule_add(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                    std::vector<Placement>& out) {
  bool all_partial = true;
  for (const Placement& p : in) all_partial &= p.is_partial();
  if (all_partial && !in.empty()) {
    for (Placement& o : out) o = Placement::partial();
    return true;
  }
  return shard_rule_pointwise(in, inputs, attrs, out);
}

bool shard_rule_mul(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                    std::vector<Placement>& out) {
  int partial = 0, replicate = 0;
  for (const Placement& p : in) partial += p.is_partial(), replicate += p.is_replicate();
  if (partial == 1 && partial + replicate == int(in.size())) {
    for (Placement& o : out) o = Placement::partial();
    return true;
  }
  return shard_rule_pointwise(in, inputs, attrs, out);
}

bool shard_rule_linear_unary(std::span<const Placement> in, std::span<const Tensor>, const Attrs&,
                             std::vector<Placement>& out) {
  for (Placement& o : out) o = in.empty() ? Placement::replicate() : in[0];
  return true;
}

bool shard_rule_view(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                     std::vector<Placement>& out) {
  const Placement& p = in[0];
  if (!p.is_shard()) {
    for (Placement& o : out) o = p;  // a view of a replicated or partial tensor is one too
    return true;
  }
  const Shape& from = inputs[0].shape();
  const Shape& to = attrs.get<Shape>("shape");
  const int64_t k = -p.dim;  // the sharded dim and the ones after it
  bool kept = int64_t(from.size()) >= k && int64_t(to.size()) >= k;
  for (int64_t i = 1; kept && i < k; ++i) kept = from[from.size() - size_t(i)] == to[to.size() - size_t(i)];
  kept = kept && (p.dim != -1 || from.back() == to.back());
  if (kept) for (Placement& o : out) o = p;
  else out.clear();  // not a plain placement any more: untracked
  return true;
}

bool shard_rule_permute(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                        std::vector<Placement>& out) {
  const Placement& p = in[0];
  if (!p.is_shard()) {
    for (Placement& o : out) o = p;
    return true;
  }
  const Shape& dims = attrs.get<Shape>("dims");
  const int64_t n = inputs[0].dim(), d = n + p.dim;
  for (int64_t j = 0; j < int64_t(dims.size()); ++j)
    if ((dims[size_t(j)] + n) % n == d) {
      out.assign(out.size(), Placement::shard(j - n));
      return true;
    }
  out.clear();
  return true;
}

bool shard_rule_slice(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                      std::vector<Placement>& out) {
  const Placement& p = in[0];
  const int64_t n = inputs[0].dim(), d = (attrs.i("dim") + n) % n;
  if (p.is_shard() && n + p.dim == d) {  // cut along the sharded dim: not tracked
    out.clear();
    return true;
  }
  for (Placement& o : out) o = p;
  return true;
}

bool shard_rule_last_dim_norm(std::span<const Placement> in, std::span<const Tensor>, const Attrs&,
                              std::vector<Placement>& out) {
  for (size_t i = 1; i < in.size(); ++i)
    if (!in[i].is_replicate()) return false;  // the weight and bias are whole on every rank
  const Placement& x = in[0];
  if (x.is_partial() || (x.is_shard() && x.dim == -1)) return false;  // the statistics need every feature
  for (Placement& o : out) o = x;
  return true;
}

}  // namespace blu
