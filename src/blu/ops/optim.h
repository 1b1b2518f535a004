// ops/optim: the optimizer updates as single in-place ops, so a backend can run a whole update in
// one pass (on CUDA, AdamW over many parameters per launch) and the compiler sees one node per
// update. optim/ builds the optimizers on these.
// Depends on ops/dispatch. Keep: param, grad and state tensors have one shape and dtype f32 (AdamW's
// moments may be bf16: Note [Stochastic bf16 moments]); math is fp32 in the order torch.optim's
// single-tensor path uses, so results match PyTorch to rounding, and every backend does the same
// operations (CUDA matches the CPU bit for bit); no autograd (call under NoGradGuard).
#pragma once
#include <cmath>
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

// Global-norm gradient clipping and the non-finite skip, decided on the device (Note [Norm gate]).
// `sum_squares`: the global gradient norm's square — 0-d (or one element), f32 or f64, on the
// gradients' device, as sum_squares() below gives it; undefined: no gate. `max_norm`: the
// clipping threshold (> 0; infinity: no clipping, the gate only skips).
struct NormGate {
  Tensor sum_squares;
  double max_norm = INFINITY;
  bool defined() const { return sum_squares.defined(); }
};

// Note [Norm gate]
// An update given a gate reads the total on the device, once per thread (CPU: once per op), with
// no host read, and decides there, in double:
//   norm = sqrt(total); if norm is not finite: change nothing (parameters, moments, compute
//   copies, momentum buffers untouched);
//   else coef = max_norm / (norm + 1e-6); when coef < 1 every gradient element g is used as
//   g * float(coef), one fp32 product rounded as mul_(grad, coef) rounds it — without writing
//   the gradient.
// So grad_norm_gate + a gated update equals optim::clip_grad_norm's in-place scaling followed by
// the plain update, bit for bit, and equals skipping the update when the norm is not finite. The
// gate is an input of the op (the dispatcher, observers and the compiler see it), its index the
// attribute "gate" (-1: none) and max_norm the attribute "max_norm".

struct AdamWStepArgs {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // the parameters' update count including this one (>= 1)
};
// One parameter's tensors for adamw_step_. `compute_copy` (optional) is a bf16/f16 tensor of the
// parameter's shape that receives the updated parameter rounded to its dtype, exactly what
// to_dtype(param) would give, in the same pass (nn/compute_copy.h, Note [Compute copies]).
// `master_low` (optional, with a bf16 compute copy): the parameter is held split (Note [Split fp32],
// core/split_f32.h) — its fp32 value is the copy's bits and these low 16 bits (u8, two bytes an element,
// contiguous, the copy contiguous too); `param` is then not read or written (it may have no bytes),
// and the update writes both halves back, the copy rounded with ties away from zero.
struct AdamWTensors {
  Tensor param, grad, exp_avg, exp_avg_sq;
  Tensor compute_copy;
  Tensor master_low;
};
// exp_avg and exp_avg_sq are f32, or bf16 in every tensor of the call: then they are widened for
// the arithmetic below and stored back rounded stochastically (Note [Stochastic bf16 moments],
// core/round_stochastic.h; the key is `step`).
// torch.optim.AdamW, in place on each tensor's param, exp_avg, exp_avg_sq (and compute copy), all
// with the same coefficients:
//   p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + ((1-b2)*g)*g;
//   p += (-(lr/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps),  bc_i = 1 - b_i^step (in double);
//   copy = round(p).
// One op however many tensors (one CUDA launch per 64 contiguous ones). Either every tensor has a
// compute copy, all of one dtype, or none has, and either every one is split or none is (group
// the calls: optim/adamw.cpp). The tensors may
// be any views (non-contiguous ones take a strided path), but must not overlap one another.
// With a gate (Note [Norm gate]) the gradients are clipped, or the whole update skipped, on the
// device.
void adamw_step_(const std::vector<AdamWTensors>& tensors, const AdamWStepArgs& args, const NormGate& gate = {});

struct SGDStepArgs {
  double lr, momentum, weight_decay;
  bool nesterov;
  bool init_buffer;  // first step of this parameter: buf = d_p instead of momentum*buf + d_p
};
// torch.optim.SGD (dampening 0) for one tensor, in place on param and momentum_buffer
// (undefined when momentum == 0):
//   d = g + wd*p;  buf = init ? d : momentum*buf + d;  d = nesterov ? d + momentum*buf : buf;
//   p += -lr * d.
// With a gate (Note [Norm gate]) the gradient is clipped, or the update skipped, on the device.
void sgd_step_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, const SGDStepArgs& args,
               const NormGate& gate = {});

// Σ over every element of every tensor of x², as one op (one or two kernels on CUDA, however many
// tensors): a 0-d tensor on their device, f64 on the CPU (double sums), f32 on CUDA (fp32 block
// partials, combined in a fixed order: deterministic). Floating tensors of any dtypes, at least
// one, all on one device; non-contiguous ones are copied first. No autograd (clip_grad_norm, and
// the total of a NormGate).
Tensor sum_squares(const std::vector<Tensor>& tensors);

}  // namespace blu
