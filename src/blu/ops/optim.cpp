#include "blu/ops/optim.h"

#include "blu/ops/dispatch.h"

namespace blu {

namespace {

// Every defined input: same shape and device as the parameter, dtype f32.
std::vector<TensorMeta> infer_optim_step(std::span<const Tensor> in, const Attrs&) {
  static const char* const kRole[] = {"param", "grad", "state", "state"};
  const Tensor& p = in[0];
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined()) continue;
    BLU_CHECK(in[i].dtype() == DType::f32, "optimizer step: ", kRole[i], " must be f32 (the optimizer keeps fp32 "
              "state and has no master copies yet), got ", in[i].str());
    BLU_CHECK(in[i].shape() == p.shape(), "optimizer step: ", kRole[i], " shape ", in[i].shape(),
              " differs from the parameter's ", p.shape());
  }
  return {TensorMeta{p.shape(), p.dtype(), p.device()}};
}

const OpDef kAdamWStep{.name = "adamw_step", .infer = infer_optim_step, .inplace = true};
const OpDef kSGDStep{.name = "sgd_step", .infer = infer_optim_step, .inplace = true, .optional_inputs = 1u << 2};

}  // namespace

void adamw_step_(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                 const AdamWStepArgs& a) {
  BLU_CHECK(a.step >= 1, "adamw_step: step must be >= 1, got ", a.step);
  dispatch(kAdamWStep, {param, grad, exp_avg, exp_avg_sq},
           Attrs{{"lr", a.lr},
                 {"beta1", a.beta1},
                 {"beta2", a.beta2},
                 {"eps", a.eps},
                 {"weight_decay", a.weight_decay},
                 {"step", a.step}});
}

void sgd_step_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, const SGDStepArgs& a) {
  BLU_CHECK(a.momentum == 0 || momentum_buffer.defined(), "sgd_step: momentum ", a.momentum,
            " needs a momentum buffer");
  BLU_CHECK(!a.nesterov || a.momentum > 0, "sgd_step: nesterov needs momentum > 0, got ", a.momentum);
  dispatch(kSGDStep, {param, grad, a.momentum == 0 ? Tensor() : momentum_buffer},
           Attrs{{"lr", a.lr},
                 {"momentum", a.momentum},
                 {"weight_decay", a.weight_decay},
                 {"nesterov", a.nesterov},
                 {"init_buffer", a.init_buffer}});
}

}  // namespace blu
