// ops/sharding: the sharding rules of ops — how an op's outputs are placed across the ranks of a
// tensor-parallel group given how its inputs are — stated by each op beside its shape rule
// (OpDef::shard, ops/dispatch.h), and the rules several ops share.
//
// Note [Sharding rules]
// Under tensor parallelism a rank's tensor is its part of a logical tensor, placed as
//   replicate  every rank holds all of it;
//   shard(d)   rank r holds the r-th of equal chunks along dim d (counted from the end here, so
//              broadcasting operands line up: -1 is the last dim);
//   partial    every rank holds a tensor of the full shape, and the value is the sum over ranks.
// A rule gets the inputs' placements (undefined inputs: replicate) and either gives the outputs'
// placements or refuses — the op cannot run locally on those placements and give a placed result
// (a norm or a GELU of a partial sum, a bias added to a partial sum, a GEMM whose contraction dim
// is split on one side only): a collective is missing or misplaced. Rules only describe; they never
// communicate. dist/sharding_check.h runs them on every dispatched op in a check mode and reports
// the first refusal; an op without a rule is not checked (its outputs are untracked).
// Depends on core/tensor. Keep: a rule is a pure function of placements, shapes and attributes.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "blu/core/attrs.h"
#include "blu/core/tensor.h"

namespace blu {

struct Placement {
  enum class Kind : uint8_t { replicate, shard, partial };
  Kind kind = Kind::replicate;
  int64_t dim = 0;  // shard: the split dim, negative (from the end)
  static Placement replicate() { return {}; }
  static Placement shard(int64_t dim_from_end) { return {Kind::shard, dim_from_end}; }
  static Placement partial() { return {Kind::partial, 0}; }
  bool is_replicate() const { return kind == Kind::replicate; }
  bool is_shard() const { return kind == Kind::shard; }
  bool is_partial() const { return kind == Kind::partial; }
  bool operator==(const Placement&) const = default;
  std::string str() const;  // "replicate", "shard(-1)", "partial"
};

// `out` comes sized to the outputs. Returns false when the op refuses the placements; else true
// with `out` filled, or cleared when the outputs' placement is not a plain one (a view that splits
// the sharded dim into two): they are then not tracked.
using ShardFn = bool (*)(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                         std::vector<Placement>& out);

// Shared rules.
// Nonlinear pointwise (gelu, exp, silu, …; several same-shaped or broadcast inputs): every input
// replicate, or shard on one dim (broadcast inputs lacking that dim replicate) → that placement;
// partial refused.
bool shard_rule_pointwise(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                          std::vector<Placement>& out);
// Linear in each input separately, as add and sub: as pointwise, and all-partial → partial
// (partial mixed with anything else refused: a replicated addend would be counted size times).
bool shard_rule_add(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                    std::vector<Placement>& out);
// Linear in each input given the other, as mul: as pointwise, and partial × replicate → partial.
bool shard_rule_mul(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                    std::vector<Placement>& out);
// Linear in its one input (mul by a scalar, a cast): the input's placement, partial included.
bool shard_rule_linear_unary(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                             std::vector<Placement>& out);
// Views and copies that keep elements in place along the sharded dim: view (a row shard — any dim
// but the last — stays one when leading dims merge or split; a last-dim shard only while the last
// dim is kept), permute (the shard follows its dim), narrow and split (along another dim).
bool shard_rule_view(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                     std::vector<Placement>& out);
bool shard_rule_permute(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                        std::vector<Placement>& out);
bool shard_rule_slice(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                      std::vector<Placement>& out);
// A norm over the last dim (layer_norm, rms_norm; input 0 the activations, the rest replicated
// parameters): replicate, or shard on any dim but the last; its statistics outputs alike.
bool shard_rule_last_dim_norm(std::span<const Placement> in, std::span<const Tensor> inputs, const Attrs& attrs,
                              std::vector<Placement>& out);

}  // namespace blu
