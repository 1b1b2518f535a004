// optim/clip: global-norm gradient clipping (torch.nn.utils.clip_grad_norm_ with norm_type 2) —
// applied in place after a host read (clip_grad_norm), or as a gate the update ops read on the
// device (grad_norm_gate, Note [Norm gate] in ops/optim.h).
#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/optim/optimizer.h"

namespace blu::optim {

namespace {

// The defined gradients of `params`, checked to be floating.
std::vector<Tensor> gradients(const std::vector<Tensor>& params, const char* what) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.defined()) continue;
    Tensor g = p.grad();
    if (!g.defined()) continue;
    BLU_CHECK(is_floating(g.dtype()), what, ": gradient ", g.str(), " is not floating");
    grads.push_back(g);
  }
  return grads;
}

}  // namespace

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = gradients(params, "clip_grad_norm");
  // One sum-of-squares op over every gradient, on their device, so only one number crosses to the
  // host: double sums on the CPU; on a GPU fp32 block partials in a fixed order (two launches).
  Tensor total;
  if (!grads.empty()) total = sum_squares(grads);
  const double norm = total.defined() ? std::sqrt(to_vector(total)[0]) : 0.0;
  if (!std::isfinite(norm)) return norm;  // reported, not applied: scaling by NaN/0 would destroy the grads
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0)
    for (const Tensor& g : grads) mul_(g, scale);
  return norm;
}

NormGate grad_norm_gate(const std::vector<Tensor>& params, double max_norm) {
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "grad_norm_gate: max_norm must be > 0, got ", max_norm);
  NoGradGuard no_grad;
  const std::vector<Tensor> grads = gradients(params, "grad_norm_gate");
  return {.sum_squares = grads.empty() ? Tensor() : sum_squares(grads), .max_norm = max_norm};
}

double gate_norm(const NormGate& gate) {
  return gate.defined() ? std::sqrt(to_vector(gate.sum_squares)[0]) : 0.0;
}

}  // namespace blu::optim
