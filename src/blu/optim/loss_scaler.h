// optim/loss_scaler: dynamic loss scaling for fp16 training. The loss is multiplied by `scale()`
// before backward so small gradients survive fp16; `unscale_and_check` divides the gradients
// back and says whether they are all finite. A step with inf/NaN gradients is skipped and the
// scale halves; after `growth_interval` good steps in a row it doubles (torch.cuda.amp.GradScaler's
// policy). Depends on core/, ops/. Keep: the scale is a power of two, so scaling is exact.
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
  double scale() const { return scale_; }
  // Divides every gradient by the scale; returns false (and backs off) if any is inf/NaN, in
  // which case the caller skips the optimizer step. `agree`, when given, turns this process's
  // verdict into the one every data-parallel rank takes (true: all finite) before the scale
  // changes — needed wherever ranks check different gradients (ZeRO-2 checks its local ones):
  // a rank that skipped alone would leave the others waiting in the next collective.
  bool unscale_and_check(const std::vector<Tensor>& params, const std::function<bool(bool)>& agree = {});
  // The same on gradient tensors themselves (ZeRO-2's shard gradient); undefined ones are skipped.
  bool unscale_and_check_grads(const std::vector<Tensor>& grads, const std::function<bool(bool)>& agree = {});
  int64_t skipped_steps() const { return skipped_; }
  void set_state(double scale, int64_t good_steps, int64_t skipped) {
    scale_ = scale;
    good_ = good_steps;
    skipped_ = skipped;
  }
  int64_t good_steps() const { return good_; }

 private:
  double scale_;
  int64_t growth_interval_;
  int64_t good_ = 0, skipped_ = 0;
};

}  // namespace blu::optim
