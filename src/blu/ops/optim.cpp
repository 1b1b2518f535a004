#include "blu/ops/optim.h"

#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// SGD's inputs (param, grad, momentum buffer): defined ones have the parameter's shape, dtype f32.
std::vector<TensorMeta> infer_sgd_step(std::span<const Tensor> in, const Attrs&) {
  static const char* const kRole[] = {"param", "grad", "momentum buffer"};
  const Tensor& p = in[0];
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined()) continue;
    BLU_CHECK(in[i].dtype() == DType::f32, "sgd_step: ", kRole[i], " must be f32 (the optimizer keeps fp32 "
              "state and fp32 master parameters), got ", in[i].str());
    BLU_CHECK(in[i].shape() == p.shape(), "sgd_step: ", kRole[i], " shape ", in[i].shape(),
              " differs from the parameter's ", p.shape());
  }
  return {TensorMeta{p.shape(), p.dtype(), p.device()}};
}
bool sgd_writes(size_t i, const Attrs&) { return i != 1; }  // all but the gradient
const OpDef kSGDStep{.name = "sgd_step",
                     .infer = infer_sgd_step,
                     .inplace = true,
                     .writes = sgd_writes,
                     .optional_inputs = 1u << 2};

// adamw_step's inputs: per parameter, (param, grad, exp_avg, exp_avg_sq[, compute copy]) — the
// stride is 5 when attr "copies" is set, else 4.
int64_t adamw_stride(const Attrs& a) { return a.b("copies") ? 5 : 4; }
std::vector<TensorMeta> infer_adamw_step(std::span<const Tensor> in, const Attrs& a) {
  static const char* const kRole[] = {"param", "grad", "exp_avg", "exp_avg_sq", "compute copy"};
  const size_t stride = size_t(adamw_stride(a));
  BLU_ASSERT(!in.empty() && in.size() % stride == 0, "adamw_step: ", in.size(), " inputs, expected groups of ",
             stride);
  const DType copy_dtype = stride == 5 ? in[4].dtype() : DType::f32;
  for (size_t t = 0; t < in.size(); t += stride) {
    const Tensor& p = in[t];
    for (size_t k = 0; k < stride; ++k) {
      const Tensor& x = in[t + k];
      const bool copy = k == 4;
      BLU_CHECK(copy ? (x.dtype() == DType::bf16 || x.dtype() == DType::f16) : x.dtype() == DType::f32,
                "adamw_step: ", kRole[k], " of tensor ", t / stride, " must be ",
                copy ? "bf16 or f16" : "f32 (the optimizer keeps fp32 state and fp32 master parameters)", ", got ",
                x.str());
      BLU_CHECK(!copy || x.dtype() == copy_dtype, "adamw_step: the compute copies must share one dtype, got ",
                copy_dtype, " and ", x.dtype(), " (tensor ", t / stride, ")");
      BLU_CHECK(x.shape() == p.shape(), "adamw_step: ", kRole[k], " shape ", x.shape(), " of tensor ", t / stride,
                " differs from the parameter's ", p.shape());
    }
  }
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
bool adamw_writes(size_t i, const Attrs& a) { return i % size_t(adamw_stride(a)) != 1; }  // all but grads
const OpDef kAdamWStep{.name = "adamw_step", .infer = infer_adamw_step, .inplace = true, .writes = adamw_writes};

std::vector<TensorMeta> infer_sum_squares(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(!in.empty(), "sum_squares: expected at least one tensor");
  for (const Tensor& t : in)
    BLU_CHECK(is_floating(t.dtype()), "sum_squares: expected floating tensors, got ", t.str());
  const Device d = in[0].device();
  return {TensorMeta{{}, d.is_cpu() ? DType::f64 : DType::f32, d}};
}
const OpDef kSumSquares{.name = "sum_squares", .infer = infer_sum_squares};

}  // namespace

void adamw_step_(const std::vector<AdamWTensors>& tensors, const AdamWStepArgs& a) {
  BLU_CHECK(a.step >= 1, "adamw_step: step must be >= 1, got ", a.step);
  if (tensors.empty()) return;
  const bool copies = tensors[0].compute_copy.defined();
  std::vector<Tensor> in;
  in.reserve(tensors.size() * (copies ? 5 : 4));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensors& t = tensors[i];
    BLU_CHECK(t.compute_copy.defined() == copies, "adamw_step: tensor ", i, (copies ? " has no" : " has a"),
              " compute copy and tensor 0 ", (copies ? "has one" : "has none"), "; either all have one or none");
    in.insert(in.end(), {t.param, t.grad, t.exp_avg, t.exp_avg_sq});
    if (copies) in.push_back(t.compute_copy);
  }
  dispatch(kAdamWStep, std::move(in),
           Attrs{{"lr", a.lr},
                 {"beta1", a.beta1},
                 {"beta2", a.beta2},
                 {"eps", a.eps},
                 {"weight_decay", a.weight_decay},
                 {"step", a.step},
                 {"copies", copies}});
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
