// nn/module: the Module base — named parameters, buffers and submodules in registration order,
// train/eval mode, moving to a device/dtype, state dicts (name → tensor) for checkpoints and
// weight import/export, and each parameter's compute copy for mixed precision (cast_param).
// Depends on core/, ops/, nn/compute_copy. Keep: a module owns its parameter tensors as
// members and registers pointers to them, so to() can replace them in place; modules are not
// copyable; names are dotted paths ("h.0.attn.c_attn.weight"); forwards take parameters in
// another dtype only through cast_param (Note [Compute copies]).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blu/core/tensor.h"
#include "blu/nn/compute_copy.h"

namespace blu::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module() = default;

  NamedTensors named_parameters() const;  // recursive, registration order
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  // Parameters then buffers, by name.
  NamedTensors state_dict() const;
  // Copies values in (cast to each parameter's dtype). Strict: a missing or unexpected name, or
  // a shape mismatch, is a BLU_CHECK error naming the tensor — nothing is changed in that case.
  void load_state_dict(const NamedTensors& state);
  int64_t num_parameters() const;

  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves/casts every parameter and buffer; parameters stay leaves that require grad.
  void to(Device device);
  void to(DType dtype);
  void zero_grad();

  // `param` (one of this module's own parameter members, or undefined) in `dtype` for a forward,
  // gradients flowing back to it in its own dtype: param itself when the dtypes agree; else its
  // compute copy (nn/compute_copy.h) — re-cast only when param was written since — or, with
  // compute copies off, a fresh cast as to_dtype gives. Either way the same values.
  Tensor cast_param(const Tensor& param, DType dtype) const;
  // Keep compute copies (on by default) in this module and every submodule; off drops them and
  // casts every forward instead.
  void set_compute_copies(bool on);
  bool compute_copies_enabled() const { return compute_copies_; }
  // Every parameter (recursive, registration order) with its compute copy, for an optimizer that
  // writes the copies as it updates the parameters (Optimizer::attach_compute_copies).
  ComputeCopies compute_copies() const;

 protected:
  Tensor& register_parameter(std::string name, Tensor& slot, Tensor value);
  Tensor& register_buffer(std::string name, Tensor& slot, Tensor value);
  template <typename M>
  M& register_module(std::string name, std::shared_ptr<M> m) {
    children_.emplace_back(std::move(name), m);
    return *m;
  }

 private:
  struct ParamSlot {
    std::string name;
    Tensor* slot;
    std::shared_ptr<ComputeCopy> copy;
  };
  void visit(const std::string& prefix, bool params, NamedTensors& out) const;
  void each_slot(const std::function<void(Tensor&, bool is_param)>& f);
  void each_module(const std::function<void(Module&)>& f);
  void drop_compute_copies();
  std::vector<ParamSlot> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
  bool compute_copies_ = true;
};

}  // namespace blu::nn
