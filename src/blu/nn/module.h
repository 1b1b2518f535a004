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

  // This module ("") and every submodule by dotted path ("h.0.attn"), registration order.
  std::vector<std::pair<std::string, Module*>> named_modules();
  // The submodule at a dotted path; nullptr when there is none.
  Module* find_module(const std::string& path);
  // Puts `m` in place of the submodule at `path`. The slot keeps its declared type: `m` must be of
  // the owner's member type (a subclass of it), else BLU_CHECK names the path; parameters, buffers
  // and modes are the new module's own. What tensor parallelism uses to rewrite a model.
  void replace_module(const std::string& path, std::shared_ptr<Module> m);

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
  // The compute copy kept for `param` (one of this module's own parameters), to be filled or
  // reused by a caller that casts several parameters together (nn/layers.h: sibling_linears);
  // null when compute copies are off or param is not one of this module's own.
  std::shared_ptr<ComputeCopy> compute_copy_of(const Tensor& param) const;
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
  // Registers the module held in `slot` (a member of the subclass); replace_module writes the slot.
  template <typename M>
  M& register_module(std::string name, std::shared_ptr<M>& slot) {
    register_child(std::move(name), slot, [&slot](const std::shared_ptr<Module>& m) {
      auto typed = std::dynamic_pointer_cast<M>(m);
      if (typed) slot = typed;
      return bool(typed);
    });
    return *slot;
  }
  // A setter writes the owner's typed slot and says whether `m` has the slot's type.
  using ChildSetter = std::function<bool(const std::shared_ptr<Module>& m)>;
  void register_child(std::string name, std::shared_ptr<Module> m, ChildSetter set);

 private:
  struct ParamSlot {
    std::string name;
    Tensor* slot;
    std::shared_ptr<ComputeCopy> copy;
  };
  const ParamSlot* slot_of(const Tensor& param) const;  // this module's own parameter; null if not
  void visit(const std::string& prefix, bool params, NamedTensors& out) const;
  void each_slot(const std::function<void(Tensor&, bool is_param)>& f);
  void each_module(const std::function<void(Module&)>& f);
  void drop_compute_copies();
  std::vector<ParamSlot> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  struct Child {
    std::string name;
    std::shared_ptr<Module> module;
    ChildSetter set;
  };
  std::vector<Child> children_;
  bool training_ = true;
  bool compute_copies_ = true;
};

}  // namespace blu::nn
