// optim/clip: global-norm gradient clipping (torch.nn.utils.clip_grad_norm_ with norm_type 2).
#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/optim/optimizer.h"

namespace blu::optim {

double clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.defined()) continue;
    Tensor g = p.grad();
    if (g.defined()) grads.push_back(g);
  }
  // Sum of squares per gradient, accumulated on the gradients' device so only one number crosses
  // to the host. On the CPU in double (no fp32 rounding of the partial sums); on a GPU the sum
  // kernels accumulate fp32 in fp32, as torch.nn.utils.clip_grad_norm_ does there.
  Tensor total;
  for (const Tensor& g : grads) {
    BLU_CHECK(is_floating(g.dtype()), "clip_grad_norm: gradient ", g.str(), " is not floating");
    const Tensor gd = to_dtype(g, g.device().is_cpu() ? DType::f64 : DType::f32);
    Tensor s = sum(mul(gd, gd));
    total = total.defined() ? add(total, s) : s;
  }
  const double norm = total.defined() ? std::sqrt(to_vector(total)[0]) : 0.0;
  if (!std::isfinite(norm)) return norm;  // reported, not applied: scaling by NaN/0 would destroy the grads
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0)
    for (const Tensor& g : grads) mul_(g, scale);
  return norm;
}

}  // namespace blu::optim
