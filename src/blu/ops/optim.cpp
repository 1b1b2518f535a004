#include "blu/ops/optim.h"

#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

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
std::vector<TensorMeta> infer_sum_squares(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(!in.empty(), "sum_squares: expected at least one tensor");
  for (const Tensor& t : in)
    BLU_CHECK(is_floating(t.dtype()), "sum_squares: expected floating tensors, got ", t.str());
  const Device d = in[0].device();
  return {TensorMeta{{}, d.is_cpu() ? DType::f64 : DType::f32, d}};
}
const OpDef kSumSquares{.name = "sum_squares", .infer = infer_sum_squares};

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

Tensor sum_squares(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> in;
  in.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    BLU_CHECK(t.defined(), "sum_squares: undefined tensor");
    in.push_back(t.is_contiguous() ? t : contiguous(t));
  }
  return dispatch1(kSumSquares, std::move(in));
}

}  // namespace blu
