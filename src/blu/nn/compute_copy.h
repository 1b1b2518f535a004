// nn/compute_copy: the persistent 16-bit copies of parameters that mixed-precision forwards read
// instead of casting every parameter on every step.
// Depends on core/, ops/ (to_dtype, cast_with_copy). Keep: a copy is used only while the rule of
// Note [Compute copies] says it equals to_dtype(param); otherwise it is re-cast.
//
// Note [Compute copies]
// In bf16/f16 mode the parameters stay fp32 (master weights) and each forward needs them in the
// compute dtype. A Module keeps, per parameter, a ComputeCopy: c = to_dtype(p, dtype), made by
// the cast kernel the first time and reused while it is current; the forward passes it through
// cast_with_copy(p, c) (no kernel; the gradient still reaches p through the cast's backward).
// AdamW writes round(p_new) into c in the same pass that updates p (adamw_step_'s compute_copy),
// so after an optimizer step no cast runs at all.
// The rule that keeps c from ever being stale: c remembers the storage p viewed (weakly), p's
// view (offset, shape, strides, dtype) and that storage's version (Note [Storage versions],
// core/storage.h) when c was last known to equal to_dtype(p). c is current only while all of
// these are unchanged. Every write to p's bytes bumps the version — any in-place op through
// ops/dispatch (the optimizers, copy_ in load_state_dict and checkpoint restore, fill_,
// init_normal_), the process groups' collectives (DDP's broadcast, ZeRO's all-gather goes through
// copy_many_) — and Module::to() replaces p by a tensor on another storage, so after any of them the
// next forward re-casts. Only code that has just written p and c together in one op may re-stamp
// c (mark_written): AdamW does, right after its adamw_step_ ops; SGD and ZeroAdamW do not, and
// their updates make the copies re-cast on the next forward. Code that writes parameter bytes
// through raw_data() must bump the storage's version itself.
// A re-cast allocates a new tensor (a graph that saved the old copy keeps its values); AdamW
// writes the copy in place, like the fp32 parameter itself: run backward before the next step.
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "blu/core/tensor.h"

namespace blu::nn {

class ComputeCopy {
 public:
  // to_dtype(param, dtype) for a forward, linked to param by autograd: the kept copy when it is
  // current, else a new cast (one cast kernel) kept from then on. dtype == param's dtype: param.
  Tensor cast(const Tensor& param, DType dtype);
  // Casts param into `dest` (16-bit, param's shape: rows of a buffer shared with sibling
  // parameters, Note [Sibling linears] in nn/layers.cpp) and keeps dest as the copy from then on.
  void cast_into(const Tensor& param, const Tensor& dest);
  // Whether the kept copy equals to_dtype(param, its dtype) by the rule above.
  bool current(const Tensor& param) const;
  // What an update of `param` may write its rounded values into (adamw_step_'s compute_copy):
  // the kept bf16/f16 copy when it has param's shape and device, else undefined.
  Tensor target(const Tensor& param) const;
  // Right after one op wrote param and target(param) together: the copy is current for param.
  void mark_written(const Tensor& param);
  const Tensor& tensor() const { return copy_; }  // undefined until the first cast
  void reset();                                   // drops the copy (its memory)

 private:
  void remember(const Tensor& param);
  Tensor copy_;
  std::weak_ptr<Storage> source_;  // the storage param viewed
  uint64_t version_ = 0;           // its version when copy_ was last made or written
  int64_t offset_ = 0;
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
};

// Each parameter (the handle the module holds) with its copy, as Module::compute_copies gives.
using ComputeCopies = std::vector<std::pair<Tensor, std::shared_ptr<ComputeCopy>>>;

}  // namespace blu::nn
