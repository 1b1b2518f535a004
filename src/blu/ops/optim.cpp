#include "blu/ops/optim.h"

#include <cmath>

#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// The gate's total (Note [Norm gate]), input `index` of `in` (attribute "gate"; -1: no gate).
void check_gate(const char* op, std::span<const Tensor> in, const Attrs& a) {
  const int64_t index = a.i("gate");
  if (index < 0) return;
  BLU_ASSERT(size_t(index) < in.size() && in[size_t(index)].defined(), op, ": gate input ", index, " missing");
  const Tensor& t = in[size_t(index)];
  BLU_CHECK(t.numel() == 1 && (t.dtype() == DType::f32 || t.dtype() == DType::f64), op,
            ": the norm gate's sum of squares must be one f32 or f64 element (as sum_squares gives it), got ",
            t.str());
}
void check_max_norm(const char* op, const NormGate& gate) {
  BLU_CHECK(gate.max_norm > 0 && !std::isnan(gate.max_norm), op, ": the norm gate's max_norm must be > 0, got ",
            gate.max_norm);
}

// SGD's inputs (param, grad, momentum buffer, gate): defined ones of the first three have the
// parameter's shape, dtype f32.
std::vector<TensorMeta> infer_sgd_step(std::span<const Tensor> in, const Attrs& a) {
  static const char* const kRole[] = {"param", "grad", "momentum buffer"};
  BLU_ASSERT(in.size() == 4, "sgd_step: ", in.size(), " inputs, expected 4");
  check_gate("sgd_step", in, a);
  const Tensor& p = in[0];
  for (size_t i = 0; i < 3; ++i) {
    if (!in[i].defined()) continue;
    BLU_CHECK(in[i].dtype() == DType::f32, "sgd_step: ", kRole[i], " must be f32 (the optimizer keeps fp32 "
              "state and fp32 master parameters), got ", in[i].str());
    BLU_CHECK(in[i].shape() == p.shape(), "sgd_step: ", kRole[i], " shape ", in[i].shape(),
              " differs from the parameter's ", p.shape());
  }
  return {TensorMeta{p.shape(), p.dtype(), p.device()}};
}
bool sgd_writes(size_t i, const Attrs&) { return i == 0 || i == 2; }  // param and momentum buffer
const OpDef kSGDStep{.name = "sgd_step",
                     .infer = infer_sgd_step,
                     .inplace = true,
                     .writes = sgd_writes,
                     .optional_inputs = 1u << 2 | 1u << 3};

// adamw_step's inputs: per parameter, (param, grad, exp_avg, exp_avg_sq[, compute copy]) — the
// stride is 5 when attr "copies" is set, else 4 — then the gate's total when attr "gate" is its
// index (>= 0). Split masters (attr "split", with copies): the master's low halves stand in the
// param's place, (low, grad, exp_avg, exp_avg_sq, compute copy).
int64_t adamw_stride(const Attrs& a) { return a.b("copies") ? 5 : 4; }
bool adamw_split(const Attrs& a) { return a.has("split") && a.b("split"); }
std::vector<TensorMeta> infer_adamw_step(std::span<const Tensor> in, const Attrs& a) {
  static const char* const kRole[] = {"param", "grad", "exp_avg", "exp_avg_sq", "compute copy"};
  const size_t stride = size_t(adamw_stride(a));
  const int64_t gate = a.i("gate");
  const size_t n = gate >= 0 ? size_t(gate) : in.size();  // the per-parameter inputs
  BLU_ASSERT(n > 0 && n % stride == 0 && (gate < 0 || n + 1 == in.size()), "adamw_step: ", in.size(),
             " inputs with gate index ", gate, ", expected groups of ", stride, " and the gate last");
  check_gate("adamw_step", in, a);
  const bool split = adamw_split(a);
  BLU_ASSERT(!split || stride == 5, "adamw_step: split masters without compute copies");
  const DType copy_dtype = stride == 5 ? in[4].dtype() : DType::f32;
  const DType state_dtype = in[2].dtype();
  BLU_CHECK(state_dtype == DType::f32 || state_dtype == DType::bf16, "adamw_step: exp_avg of tensor 0 must be f32 "
            "or bf16 (the moments' dtypes), got ", in[2].str());
  for (size_t t = 0; t < n; t += stride) {
    const Tensor& p = split ? in[t + 1] : in[t];  // the shape every operand has
    if (split) {
      const Tensor &low = in[t], &copy = in[t + 4];
      BLU_CHECK(low.dtype() == DType::u8 && low.numel() == 2 * p.numel() && low.is_contiguous(),
                "adamw_step: the split master's low halves of tensor ", t / stride, " must be contiguous u8 of ",
                2 * p.numel(), " bytes, got ", low.str());
      BLU_CHECK(copy.dtype() == DType::bf16 && copy.is_contiguous(), "adamw_step: a split master's compute copy ",
                "(tensor ", t / stride, ") must be contiguous bf16, got ", copy.str());
    }
    for (size_t k = split ? 1 : 0; k < stride; ++k) {
      const Tensor& x = in[t + k];
      const bool copy = k == 4, moment = k == 2 || k == 3;
      if (moment)
        BLU_CHECK(x.dtype() == state_dtype, "adamw_step: ", kRole[k], " of tensor ", t / stride, " must be ",
                  state_dtype, " as tensor 0's exp_avg is (one op's moments share a dtype), got ", x.str());
      else
        BLU_CHECK(copy ? (x.dtype() == DType::bf16 || x.dtype() == DType::f16) : x.dtype() == DType::f32,
                  "adamw_step: ", kRole[k], " of tensor ", t / stride, " must be ",
                  copy ? "bf16 or f16" : "f32 (the parameters and their gradients are fp32)", ", got ", x.str());
      BLU_CHECK(!copy || x.dtype() == copy_dtype, "adamw_step: the compute copies must share one dtype, got ",
                copy_dtype, " and ", x.dtype(), " (tensor ", t / stride, ")");
      BLU_CHECK(x.shape() == p.shape(), "adamw_step: ", kRole[k], " shape ", x.shape(), " of tensor ", t / stride,
                " differs from the parameter's ", p.shape());
    }
  }
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
// All but the gradients and the gate (split: the low halves in the param's place).
bool adamw_writes(size_t i, const Attrs& a) {
  return i % size_t(adamw_stride(a)) != 1 && int64_t(i) != a.i("gate");
}
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

void adamw_step_(const std::vector<AdamWTensors>& tensors, const AdamWStepArgs& a, const NormGate& gate) {
  BLU_CHECK(a.step >= 1, "adamw_step: step must be >= 1, got ", a.step);
  if (gate.defined()) check_max_norm("adamw_step", gate);
  if (tensors.empty()) return;
  const bool copies = tensors[0].compute_copy.defined(), split = tensors[0].master_low.defined();
  std::vector<Tensor> in;
  in.reserve(tensors.size() * (copies ? 5 : 4) + 1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensors& t = tensors[i];
    BLU_CHECK(t.compute_copy.defined() == copies, "adamw_step: tensor ", i, (copies ? " has no" : " has a"),
              " compute copy and tensor 0 ", (copies ? "has one" : "has none"), "; either all have one or none");
    BLU_CHECK(t.master_low.defined() == split, "adamw_step: tensor ", i, (split ? " is not" : " is"),
              " split and tensor 0 ", (split ? "is" : "is not"), "; either all are or none");
    BLU_CHECK(!split || copies, "adamw_step: a split master (tensor ", i, ") needs its compute copy");
    in.insert(in.end(), {split ? t.master_low : t.param, t.grad, t.exp_avg, t.exp_avg_sq});
    if (copies) in.push_back(t.compute_copy);
  }
  const int64_t gate_index = gate.defined() ? int64_t(in.size()) : -1;
  if (gate.defined()) in.push_back(gate.sum_squares);
  Attrs attrs{{"lr", a.lr},
              {"beta1", a.beta1},
              {"beta2", a.beta2},
              {"eps", a.eps},
              {"weight_decay", a.weight_decay},
              {"step", a.step},
              {"copies", copies},
              {"gate", gate_index},
              {"max_norm", gate.max_norm}};
  if (split) attrs.set("split", true);
  dispatch(kAdamWStep, std::move(in), std::move(attrs));
}

void sgd_step_(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer, const SGDStepArgs& a,
               const NormGate& gate) {
  BLU_CHECK(a.momentum == 0 || momentum_buffer.defined(), "sgd_step: momentum ", a.momentum,
            " needs a momentum buffer");
  BLU_CHECK(!a.nesterov || a.momentum > 0, "sgd_step: nesterov needs momentum > 0, got ", a.momentum);
  if (gate.defined()) check_max_norm("sgd_step", gate);
  dispatch(kSGDStep, {param, grad, a.momentum == 0 ? Tensor() : momentum_buffer, gate.sum_squares},
           Attrs{{"lr", a.lr},
                 {"momentum", a.momentum},
                 {"weight_decay", a.weight_decay},
                 {"nesterov", a.nesterov},
                 {"init_buffer", a.init_buffer},
                 {"gate", gate.defined() ? int64_t(3) : int64_t(-1)},
                 {"max_norm", gate.max_norm}});
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
