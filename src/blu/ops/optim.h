// ops/optim: the per-tensor optimizer updates as single in-place ops, so a backend can run each
// parameter's whole update in one pass (one kernel on CUDA) and the compiler sees one node per
// parameter. optim/ builds the optimizers on these.
// Depends on ops/dispatch. Keep: param, grad and state tensors have one shape and dtype f32 (the
// optimizer's state dtype); math is fp32 in the order torch.optim's single-tensor path uses, so
// results match PyTorch to rounding; no autograd (call under NoGradGuard).
#pragma once
#include "blu/core/tensor.h"

namespace blu {

struct AdamWStepArgs {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // this parameter's update count including this one (>= 1)
};
// torch.optim.AdamW for one tensor, in place on param, exp_avg, exp_avg_sq:
//   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g;
//   p += (-(lr/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps),  bc_i = 1 - b_i^step (in double).
void adamw_step_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const AdamWStepArgs& args);

struct SGDStepArgs {
  double lr, momentum, weight_decay;
  bool nesterov;
  bool init_buffer;  // first step of this parameter: buf = d_p instead of momentum*buf + d_p
};
// torch.optim.SGD (dampening 0) for one tensor, in place on param and momentum_buffer
// (undefined when momentum == 0):
//   d = g + wd*p;  buf = init ? d : momentum*buf + d;  d = nesterov ? d + momentum*buf : buf;
//   p += -lr * d.
void sgd_step_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, const SGDStepArgs& args);

// Σ over every element of every tensor of x², as one op (one or two kernels on CUDA, however many
// tensors): a 0-d tensor on their device, f64 on the CPU (double sums), f32 on CUDA (fp32 block
// partials, combined in a fixed order: deterministic). Floating tensors of any dtypes, at least
// one, all on one device; non-contiguous ones are copied first. No autograd (clip_grad_norm).
Tensor sum_squares(const std::vector<Tensor>& tensors);

}  // namespace blu
