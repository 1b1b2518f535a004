// ops/optim: the optimizer updates as single in-place ops, so a backend can run a whole update in
// one pass (on CUDA, AdamW over many parameters per launch) and the compiler sees one node per
// update. optim/ builds the optimizers on these.
// Depends on ops/dispatch. Keep: param, grad and state tensors have one shape and dtype f32 (the
// optimizer's state dtype); math is fp32 in the order torch.optim's single-tensor path uses, so
// results match PyTorch to rounding, and every backend does the same operations (CUDA matches the
// CPU bit for bit); no autograd (call under NoGradGuard).
#pragma once
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

struct AdamWStepArgs {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // the parameters' update count including this one (>= 1)
};
// One parameter's tensors for adamw_step_. `compute_copy` (optional) is a bf16/f16 tensor of the
// parameter's shape that receives the updated parameter rounded to its dtype, exactly what
// to_dtype(param) would give, in the same pass (nn/compute_copy.h, Note [Compute copies]).
struct AdamWTensors {
  Tensor param, grad, exp_avg, exp_avg_sq;
  Tensor compute_copy;
};
// torch.optim.AdamW, in place on each tensor's param, exp_avg, exp_avg_sq (and compute copy), all
// with the same coefficients:
//   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g;
//   p += (-(lr/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps),  bc_i = 1 - b_i^step (in double);
//   copy = round(p).
// One op however many tensors (one CUDA launch per 64 contiguous ones). Either every tensor has a
// compute copy, all of one dtype, or none has (group the calls: optim/adamw.cpp). The tensors may
// be any views (non-contiguous ones take a strided path), but must not overlap one another.
void adamw_step_(const std::vector<AdamWTensors>& tensors, const AdamWStepArgs& args);

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
