// optim/optimizer: optimizers over parameter groups — AdamW (decoupled weight decay, exactly
// torch.optim.AdamW's update) and SGD with momentum — plus global-norm gradient clipping,
// learning-rate schedules and the optimizer state that checkpoints save.
// Depends on core/, ops/ (ops/optim: the update ops), nn/ (names, compute copies). Keep: updates
// run under NoGradGuard through dispatched ops (so the CUDA backend can supply fused kernels);
// state tensors are named so checkpoints can hold them; parameters whose grad is undefined are
// skipped (their state and step count are left alone, as in PyTorch); state and parameters are
// fp32 (BLU_CHECK otherwise) — in mixed precision the parameters are the fp32 master weights and
// the 16-bit side is the model's compute copies, which AdamW writes as it updates.
//
// State names (state() / load_state()):
//   "step"                     0-d i64: optimizer steps taken (steps()); f64 is accepted on load
//   "exp_avg.<param>"          AdamW first moment, the parameter's shape, f32
//   "exp_avg_sq.<param>"       AdamW second moment
//   "step.<param>"             AdamW: this parameter's update count (its bias correction), 0-d i64
//   "momentum_buffer.<param>"  SGD with momentum != 0
// A parameter has entries only once it has been updated (PyTorch creates state lazily too).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/core/tensor.h"
#include "blu/nn/module.h"
#include "blu/ops/optim.h"

namespace blu::optim {

class SplitMasters;

struct ParamGroup {
  nn::NamedTensors params;
  double weight_decay = 0.0;
};
// GPT-style grouping: tensors with dim >= 2 (matmul weights, embeddings) decay, biases and
// norm weights do not.
std::vector<ParamGroup> decay_groups(const nn::NamedTensors& params, double weight_decay);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every parameter that has a gradient, at lr().
  void step() { step(NormGate{}); }
  // With a gate (grad_norm_gate below): the gradients clipped, or the update skipped when their
  // norm is not finite, decided on the device (Note [Norm gate], ops/optim.h) — no host read.
  // The host does not learn whether the update was skipped, so the step counts advance either
  // way: steps() and AdamW's per-parameter counts (its bias correction) count a skipped update
  // too, and a parameter's state is created (moments zero, SGD's momentum buffer zero) by a
  // skipped first update. Everything else a skipped update leaves bit for bit as it was.
  virtual void step(const NormGate& gate) = 0;
  void zero_grad();
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }
  int64_t steps() const { return steps_; }
  // Named state ("exp_avg.h.0.mlp.c_fc.weight", …, and "step") for checkpoints: handles to the
  // live tensors (no copy), so save them before the next step.
  virtual nn::NamedTensors state() const = 0;
  // Copies state in. Strict, like Module: a missing "step", an unknown kind or parameter name, a
  // parameter with only part of its entries, or a shape mismatch is a BLU_CHECK error naming the
  // tensor — and nothing is changed in that case.
  virtual void load_state(const nn::NamedTensors& state) = 0;
  const std::vector<ParamGroup>& groups() const { return groups_; }
  // Mixed precision (Note [Compute copies], nn/compute_copy.h): the model's compute copies
  // (Module::compute_copies), for an optimizer that writes them in the pass that updates the
  // parameters (AdamW). The others (SGD, ZeroAdamW) ignore them; the next forward re-casts what
  // they updated. Entries for tensors that are not this optimizer's parameters are ignored.
  virtual void attach_compute_copies(const nn::ComputeCopies& copies) {}
  // Split masters (Note [Split masters], optim/master_split.h): the update reads and writes those
  // parameters through their two halves. AdamW does; the others refuse (BLU_CHECK).
  virtual void attach_split_masters(std::shared_ptr<const SplitMasters> masters);

 protected:
  std::vector<ParamGroup> groups_;
  double lr_ = 1e-3;
  int64_t steps_ = 0;
};

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  // The moments' dtype: f32 (torch.optim's), or bf16 — half the state's bytes and traffic, stored
  // rounded stochastically (Note [Stochastic bf16 moments], core/round_stochastic.h). A checkpoint's
  // moments of the other dtype load converted (bf16 → f32 exactly, f32 → bf16 to nearest).
  DType state_dtype = DType::f32;
};
// BLU_CHECK: `dtype` is a dtype AdamW can hold its moments in (f32, bf16); `who` names the caller.
void check_state_dtype(DType dtype, const char* who);
std::unique_ptr<Optimizer> make_adamw(std::vector<ParamGroup> groups, AdamWOptions opt);
struct SGDOptions {
  double lr = 1e-2, momentum = 0.0;
  bool nesterov = false;
};
std::unique_ptr<Optimizer> make_sgd(std::vector<ParamGroup> groups, SGDOptions opt);

// Scales all gradients so their global L2 norm is at most max_norm; returns the norm before.
// As torch.nn.utils.clip_grad_norm_: norm over every defined grad (accumulated in double here),
// scale = max_norm / (norm + 1e-6) applied when < 1. A non-finite norm is returned and nothing is
// scaled (the caller decides to skip the step). Reads the norm on the host (one host read, a
// device synchronisation): a training step uses grad_norm_gate instead.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);
// The same clipping decided on the device: one sum_squares op over every defined gradient of
// `params` (no host read), for Optimizer::step(gate). The gate's sum_squares is undefined when no
// parameter has a gradient (step(gate) then acts as step()). max_norm > 0 (infinity: only the
// non-finite skip).
NormGate grad_norm_gate(const std::vector<Tensor>& params, double max_norm);
// The gate's norm, sqrt of its total, read on the host (one host read; 0 for an undefined total):
// what clip_grad_norm returns, for logging.
double gate_norm(const NormGate& gate);

struct LRSchedule {
  enum class Kind { constant, cosine, linear } kind = Kind::cosine;
  double max_lr = 6e-4, min_lr = 6e-5;
  int64_t warmup_steps = 0, total_steps = 1;
  // step < warmup_steps: max_lr * (step+1) / warmup_steps. Then constant: max_lr; cosine /
  // linear: from max_lr at warmup_steps down to min_lr at total_steps, and min_lr after.
  double at(int64_t step) const;
  static Kind parse(const std::string& name);  // "constant", "cosine", "linear" 
};

}  // namespace blu::optim
