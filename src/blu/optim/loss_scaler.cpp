#include "blu/optim/loss_scaler.h"

#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"

namespace blu::optim {

bool LossScaler::unscale_and_check(const std::vector<Tensor>& params, const std::function<bool(bool)>& agree) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.defined() ? p.grad() : Tensor());
  return unscale_and_check_grads(grads, agree);
}

bool LossScaler::unscale_and_check_grads(const std::vector<Tensor>& grads, const std::function<bool(bool)>& agree) {
  NoGradGuard no_grad;
  // One device-side sum of |g| per tensor (inf/NaN propagate), one number to the host.
  Tensor total;
  for (Tensor g : grads) {
    if (!g.defined()) continue;
    mul_(g, 1.0 / scale_);
    Tensor s = sum(abs(to_dtype(g, DType::f32)));
    total = total.defined() ? add(total, s) : s;
  }
  bool finite = !total.defined() || std::isfinite(to_vector(total)[0]);
  if (agree) finite = agree(finite);
  if (!finite) {
    scale_ *= 0.5;
    good_ = 0;
    ++skipped_;
  } else if (++good_ >= growth_interval_) {
    scale_ *= 2.0;
    good_ = 0;
  }
  return finite;
}

}  // namespace blu::optim
