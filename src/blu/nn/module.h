// nn/module: the Module base — named parameters, buffers and submodules in registration order,
// train/eval mode, moving to a device/dtype, and state dicts (name → tensor) for checkpoints and
// weight import/export. Depends on core/, ops/. Keep: a module owns its parameter tensors as
// members and registers pointers to them, so to() can replace them in place; modules are not
// copyable; names are dotted paths ("h.0.attn.c_attn.weight").
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blu/core/tensor.h"

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

 protected:
  Tensor& register_parameter(std::string name, Tensor& slot, Tensor value);
  Tensor& register_buffer(std::string name, Tensor& slot, Tensor value);
  template <typename M>
  M& register_module(std::string name, std::shared_ptr<M> m) {
    children_.emplace_back(std::move(name), m);
    return *m;
  }

 private:
  void visit(const std::string& prefix, bool params, NamedTensors& out) const;
  void each_slot(const std::function<void(Tensor&, bool is_param)>& f);
  std::vector<std::pair<std::string, Tensor*>> params_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace blu::nn
