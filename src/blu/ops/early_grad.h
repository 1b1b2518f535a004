// ops/early_grad: a backward formula hands out an input's gradient the moment it exists, before the
// rest of its work, to a listener the graph attached to that node (Note [Early input gradients]).
// Depends on core/tensor. Keep: a formula calls input_grad_ready() at most once per input, with
// the very tensor it then returns for that input; the listener may start asynchronous work on
// that tensor (in place) but must leave it to that work, so the formula must not read it again.
#pragma once
#include <cstddef>
#include <functional>

#include "blu/core/tensor.h"

namespace blu {

// Note [Early input gradients]
// Under tensor parallelism a column-parallel linear's input gradient must be summed over the ranks
// (all-reduce, or reduce-scatter under sequence parallelism) before the norm below it can run its
// backward, and the linear's weight gradient — a GEMM as large as the one that made the input
// gradient — needs nothing from the other ranks. The linear's backward computes the input gradient
// first and calls input_grad_ready(0, gx); the listener (dist/tensor_parallel.cpp) starts the
// collective on gx right there, so it runs on the communication stream (NCCL) or the group's
// thread (Gloo) while the weight-gradient GEMM runs, and the collective's own node later only waits
// for it. Without a listener the call does nothing and the collective runs where it always did.

using EarlyGradFn = std::function<void(size_t input, const Tensor& grad)>;

// Makes `fn` (null: none) this thread's listener for the scope; autograd opens one around every
// op node's backward, with that node's listener.
class EarlyGradScope {
 public:
  explicit EarlyGradScope(const EarlyGradFn* fn);
  ~EarlyGradScope();
  EarlyGradScope(const EarlyGradScope&) = delete;
  EarlyGradScope& operator=(const EarlyGradScope&) = delete;

 private:
  const EarlyGradFn* prev_;
};

// Called by a backward formula once input `input`'s gradient is final; nothing without a listener.
void input_grad_ready(size_t input, const Tensor& grad);

}  // namespace blu
