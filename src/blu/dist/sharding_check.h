// dist/sharding_check: the check mode of the ops' sharding rules (Note [Sharding rules],
// ops/sharding.h). While a ShardingCheck is alive it watches every dispatched op (an op
// observer): it knows the placement of the tensors it was told about (the parameters, from their
// ShardInfo) and of those it derived, runs each op's rule on its inputs' placements and records
// the outputs'. An op whose rule refuses its inputs — a collective missing before a norm, a bias
// added before the reduction — is an error naming the op and the placements. The tensor-parallel
// collectives (dist/tensor_parallel.h) check what they take (f a replicated tensor, g a partial
// one, the sequence gather a sequence shard, …) and set what they give.
// Integer tensors (token ids) count as replicated; a floating tensor the check does not know
// (an input made outside it, an op without a rule's output) is not checked, nor is an op that reads
// one. Costs a hash lookup per op: a test and debugging mode, off unless constructed.
// Depends on ops/ (observers, rules), dist/tensor_parallel (ShardInfo). Keep: one check at a
// time, on the thread that runs the model.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "blu/nn/module.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/sharding.h"

namespace blu::dist {

class ShardingCheck {
 public:
  // throw_on_refusal: a refusal throws blu::Error at once (else it is only recorded).
  explicit ShardingCheck(bool throw_on_refusal = true);
  ~ShardingCheck();
  ShardingCheck(const ShardingCheck&) = delete;
  ShardingCheck& operator=(const ShardingCheck&) = delete;

  // Every parameter of `model` placed from its ShardInfo (dist/tensor_parallel.h).
  void place_parameters(nn::Module& model);
  void set(const Tensor& t, Placement p);
  std::optional<Placement> get(const Tensor& t) const;
  // For a collective: `in` must be placed `want` (unknown passes); `out` is then placed `gives`.
  void collective(const char* name, const Tensor& in, Placement want, const Tensor& out, Placement gives);

  const std::vector<std::string>& refusals() const { return refusals_; }
  int64_t ops_checked() const { return checked_; }  // ops whose rule ran
  static ShardingCheck* active();

 private:
  void observe(const OpDef& op, std::span<const Tensor> in, std::span<const Tensor> out, const Attrs& attrs);
  void refuse(std::string message);
  struct Entry {
    std::weak_ptr<TensorImpl> impl;  // an entry whose tensor died (and whose address was reused) is ignored
    Placement placement;
  };
  std::unordered_map<const TensorImpl*, Entry> known_;
  std::vector<std::string> refusals_;
  int64_t checked_ = 0;
  bool throw_;
  int observer_ = -1;
};

}  // namespace blu::dist
