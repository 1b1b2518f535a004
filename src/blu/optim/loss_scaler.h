// optim/loss_scaler: dynamic loss scaling for fp16 training. The loss is multiplied by `scale()`
// before backward so small gradients survive fp16; `unscale_and_check` divides the gradients
// back and says whether they are all finite. A step with inf/NaN gradients is skipped and the
// scale halves; after `growth_interval` good steps in a row it doubles (torch.cuda.amp.GradScaler's
// policy).
// Two ways to run it: on the host (unscale_and_check: one host read per step), or on the device
// (scale_tensor / unscale / update: the scale and its counters are 0-d tensors on the gradients'
// device, the overflow is the norm gate's non-finite total — which makes the gated update skip —
// and nothing is read on the host; scale(), good_steps() and skipped_steps() read them when asked).
// Depends on core/, ops/. Keep: the scale is a power of two, so scaling is exact; both ways take the
// same decisions and give the same unscaled gradients.
#pragma once
#include <functional>
#include <cstdint>
#include <vector>

#include "blu/core/tensor.h"

namespace blu::optim {

class LossScaler {
 public:
  explicit LossScaler(double init_scale = 65536.0, int64_t growth_interval = 2000)
      : scale_(init_scale), growth_interval_(growth_interval) {}
  // The current scale (a host read once the scale lives on the device).
  double scale() const;
  // Divides every gradient by the scale; returns false (and backs off) if any is inf/NaN, in
  // which case the caller skips the optimizer step. `agree`, when given, turns this process's
  // verdict into the one every data-parallel rank takes (true: all finite) before the scale
  // changes — needed wherever ranks check different gradients (ZeRO-2 checks its local ones):
  // a rank that skipped alone would leave the others waiting in the next collective.
  bool unscale_and_check(const std::vector<Tensor>& params, const std::function<bool(bool)>& agree = {});
  // The same on gradient tensors themselves (ZeRO-2's shard gradient); undefined ones are skipped.
  bool unscale_and_check_grads(const std::vector<Tensor>& grads, const std::function<bool(bool)>& agree = {});
  int64_t skipped_steps() const;
  void set_state(double scale, int64_t good_steps, int64_t skipped);
  int64_t good_steps() const;

  // Device side. The scale as a 0-d f32 tensor on `device` (made from the host state on first use;
  // from then on the device holds the state).
  Tensor scale_tensor(Device device);
  // Divides every defined gradient by the device scale, in place.
  void unscale(const std::vector<Tensor>& grads);
  // After the step's gated update: `sum_squares` (the norm gate's total over the unscaled gradients;
  // undefined when there are none) not finite means overflow — the scale halves and the skip count
  // grows — else a good step, doubling the scale after growth_interval of them.
  void update(const Tensor& sum_squares);
  // The skipped-step count as a 0-d f64 device tensor (for a read batched with others).
  Tensor skipped_tensor() const { return skipped_t_; }

 private:
  double scale_;
  int64_t growth_interval_;
  int64_t good_ = 0, skipped_ = 0;
  Tensor scale_t_, good_t_, skipped_t_;  // device state (f32, f64, f64), once scale_tensor was called
};

}  // namespace blu::optim
