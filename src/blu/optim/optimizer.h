// optim/optimizer: optimizers over parameter groups — AdamW (decoupled weight decay, exactly
// torch.optim.AdamW's update) and SGD with momentum — plus global-norm gradient clipping,
// learning-rate schedules and the optimizer state that checkpoints save.
// Depends on core/, ops/. Keep: updates run under NoGradGuard through dispatched ops (so the
// CUDA backend can supply fused kernels); state tensors are named so checkpoints can hold them.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/core/tensor.h"
#include "blu/nn/module.h"

namespace blu::optim {

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
  virtual void step() = 0;  // uses lr()
  void zero_grad();
  void set_lr(double lr) { lr_ = lr; }
  double lr() const { return lr_; }
  int64_t steps() const { return steps_; }
  // Named state ("exp_avg.h.0.mlp.c_fc.weight", …, and "step") for checkpoints.
  virtual nn::NamedTensors state() const = 0;
  virtual void load_state(const nn::NamedTensors& state) = 0;  // strict, like Module
  const std::vector<ParamGroup>& groups() const { return groups_; }

 protected:
  std::vector<ParamGroup> groups_;
  double lr_ = 1e-3;
  int64_t steps_ = 0;
};

struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};
std::unique_ptr<Optimizer> make_adamw(std::vector<ParamGroup> groups, AdamWOptions opt);
struct SGDOptions {
  double lr = 1e-2, momentum = 0.0;
  bool nesterov = false;
};
std::unique_ptr<Optimizer> make_sgd(std::vector<ParamGroup> groups, SGDOptions opt);

// Scales all gradients so their global L2 norm is at most max_norm; returns the norm before.
double clip_grad_norm(const std::vector<Tensor>& params, double max_norm);

struct LRSchedule {
  enum class Kind { constant, cosine, linear } kind = Kind::cosine;
  double max_lr = 6e-4, min_lr = 6e-5;
  int64_t warmup_steps = 0, total_steps = 1;
  double at(int64_t step) const;  // linear warmup from 0, then decay to min_lr at total_steps
  static Kind parse(const std::string& name);
};

}  // namespace blu::optim
