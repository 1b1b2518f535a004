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

double LossScaler::scale() const { return scale_t_.defined() ? to_vector(scale_t_)[0] : scale_; }
int64_t LossScaler::good_steps() const { return good_t_.defined() ? int64_t(to_vector(good_t_)[0]) : good_; }
int64_t LossScaler::skipped_steps() const { return skipped_t_.defined() ? int64_t(to_vector(skipped_t_)[0]) : skipped_; }

void LossScaler::set_state(double scale, int64_t good_steps, int64_t skipped) {
  scale_ = scale;
  good_ = good_steps;
  skipped_ = skipped;
  if (scale_t_.defined()) {
    const Device d = scale_t_.device();
    scale_t_ = Tensor();
    scale_tensor(d);
  }
}

Tensor LossScaler::scale_tensor(Device device) {
  if (!scale_t_.defined()) {
    scale_t_ = full({}, scale_, DType::f32, device);
    good_t_ = full({}, double(good_), DType::f64, device);
    skipped_t_ = full({}, double(skipped_), DType::f64, device);
  }
  BLU_CHECK(scale_t_.device() == device, "LossScaler: the scale lives on ", scale_t_.device(), ", asked for on ", device);
  return scale_t_;
}

void LossScaler::unscale(const std::vector<Tensor>& grads) {
  NoGradGuard no_grad;
  Tensor inv;
  for (const Tensor& g : grads) {
    if (!g.defined()) continue;
    if (!inv.defined()) inv = div(full({}, 1.0, DType::f32, g.device()), scale_tensor(g.device()));  // exact: a power of two
    copy_(g, mul(g, to_dtype(inv, g.dtype())));
  }
}

void LossScaler::update(const Tensor& sum_squares) {
  if (!scale_t_.defined()) return;  // nothing was scaled on the device
  NoGradGuard no_grad;
  const Device d = scale_t_.device();
  const Tensor finite = sum_squares.defined() ? lt(abs(to_dtype(sum_squares, DType::f64)), full({}, INFINITY, DType::f64, d))
                                              : full({}, 1.0, DType::b8, d);
  const Tensor zero = full({}, 0.0, DType::f64, d), one = full({}, 1.0, DType::f64, d);
  const Tensor grown = add(good_t_, 1.0);
  const Tensor at_interval = ge(grown, full({}, double(growth_interval_), DType::f64, d));
  const Tensor up = where(at_interval, mul(scale_t_, 2.0), scale_t_);
  scale_t_ = where(finite, up, mul(scale_t_, 0.5));
  good_t_ = where(finite, where(at_interval, zero, grown), zero);
  skipped_t_ = add(skipped_t_, where(finite, zero, one));
}

}  // namespace blu::optim
