#include "blu/nn/module.h"

#include <map>
#include <set>

#include "blu/core/grad_mode.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::nn {

Tensor& Module::register_parameter(std::string name, Tensor& slot, Tensor value) {
  BLU_CHECK(value.defined(), "register_parameter: parameter '", name, "' is undefined");
  BLU_CHECK(is_floating(value.dtype()), "register_parameter: parameter '", name, "' must be floating, got ",
            value.dtype());
  for (auto& p : params_) BLU_CHECK(p.name != name, "register_parameter: '", name, "' is registered twice");
  slot = value.detach();
  slot.set_requires_grad(true);
  params_.push_back({std::move(name), &slot, std::make_shared<ComputeCopy>()});
  return slot;
}

Tensor& Module::register_buffer(std::string name, Tensor& slot, Tensor value) {
  BLU_CHECK(value.defined(), "register_buffer: buffer '", name, "' is undefined");
  for (auto& [n, _] : buffers_) BLU_CHECK(n != name, "register_buffer: '", name, "' is registered twice");
  slot = value.detach();
  buffers_.emplace_back(std::move(name), &slot);
  return slot;
}

void Module::visit(const std::string& prefix, bool params, NamedTensors& out) const {
  if (params) {
    for (auto& p : params_) out.emplace_back(prefix + p.name, *p.slot);
  } else {
    for (auto& [name, slot] : buffers_) out.emplace_back(prefix + name, *slot);
  }
  for (auto& c : children_) c.module->visit(prefix + c.name + ".", params, out);
}

void Module::each_slot(const std::function<void(Tensor&, bool is_param)>& f) {
  for (auto& p : params_) f(*p.slot, true);
  for (auto& [_, slot] : buffers_) f(*slot, false);
  for (auto& c : children_) c.module->each_slot(f);
}

void Module::each_module(const std::function<void(Module&)>& f) {
  f(*this);
  for (auto& c : children_) c.module->each_module(f);
}

NamedTensors Module::named_parameters() const {
  NamedTensors out;
  visit("", true, out);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [_, t] : named_parameters()) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers() const {
  NamedTensors out;
  visit("", false, out);
  return out;
}

NamedTensors Module::state_dict() const {
  NamedTensors out = named_parameters();
  for (auto& nt : named_buffers()) out.push_back(std::move(nt));
  return out;
}

void Module::load_state_dict(const NamedTensors& state) {
  // Check everything first so a failed load changes nothing.
  const NamedTensors mine = state_dict();
  std::map<std::string, const Tensor*> given;
  for (auto& [name, t] : state) {
    BLU_CHECK(given.emplace(name, &t).second, "load_state_dict: '", name, "' appears twice in the state");
  }
  std::set<std::string> known;
  for (auto& [name, t] : mine) {
    known.insert(name);
    auto it = given.find(name);
    BLU_CHECK(it != given.end(), "load_state_dict: missing '", name, "' (expected shape ", t.shape(), ")");
    BLU_CHECK(it->second->defined(), "load_state_dict: '", name, "' is an undefined tensor");
    BLU_CHECK(it->second->shape() == t.shape(), "load_state_dict: '", name, "' has shape ", it->second->shape(),
              ", expected ", t.shape());
  }
  for (auto& [name, _] : state) BLU_CHECK(known.count(name), "load_state_dict: unexpected '", name, "'");
  NoGradGuard no_grad;
  for (auto& [name, t] : mine) copy_(t, to_device(given.at(name)->detach(), t.device()));
}

void Module::register_child(std::string name, std::shared_ptr<Module> m, ChildSetter set) {
  BLU_CHECK(m, "register_module: module '", name, "' is null");
  BLU_CHECK(name.find('.') == std::string::npos && !name.empty(), "register_module: expected a name without dots, got '",
            name, "'");
  for (auto& c : children_) BLU_CHECK(c.name != name, "register_module: '", name, "' is registered twice");
  children_.push_back({std::move(name), std::move(m), std::move(set)});
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{"", this}};
  for (auto& c : children_)
    for (auto& [path, m] : c.module->named_modules()) out.emplace_back(path.empty() ? c.name : c.name + "." + path, m);
  return out;
}

Module* Module::find_module(const std::string& path) {
  if (path.empty()) return this;
  const size_t dot = path.find('.');
  const std::string head = path.substr(0, dot);
  for (auto& c : children_)
    if (c.name == head) return dot == std::string::npos ? c.module.get() : c.module->find_module(path.substr(dot + 1));
  return nullptr;
}

void Module::replace_module(const std::string& path, std::shared_ptr<Module> m) {
  BLU_CHECK(m, "replace_module: the replacement for '", path, "' is null");
  const size_t dot = path.rfind('.');
  Module* owner = dot == std::string::npos ? this : find_module(path.substr(0, dot));
  const std::string leaf = dot == std::string::npos ? path : path.substr(dot + 1);
  BLU_CHECK(owner, "replace_module: no module at '", path.substr(0, dot), "'");
  for (auto& c : owner->children_) {
    if (c.name != leaf) continue;
    BLU_CHECK(c.set(m), "replace_module: '", path, "' holds a module of another type than the replacement");
    c.module = std::move(m);
    return;
  }
  BLU_CHECK(false, "replace_module: no module at '", path, "'");
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [_, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c.module->train(on);
}

const Module::ParamSlot* Module::slot_of(const Tensor& param) const {
  for (const ParamSlot& p : params_)
    if (p.slot == &param || p.slot->is_same(param)) return &p;
  return nullptr;
}

Tensor Module::cast_param(const Tensor& param, DType dtype) const {
  if (!param.defined() || param.dtype() == dtype) return param;
  const ParamSlot* p = slot_of(param);
  BLU_CHECK(p, "cast_param: ", param.str(), " is not a parameter of this module");
  return compute_copies_ ? p->copy->cast(*p->slot, dtype) : to_dtype(*p->slot, dtype);
}

std::shared_ptr<ComputeCopy> Module::compute_copy_of(const Tensor& param) const {
  const ParamSlot* p = compute_copies_ && param.defined() ? slot_of(param) : nullptr;
  return p ? p->copy : nullptr;
}

void Module::set_compute_copies(bool on) {
  each_module([on](Module& m) { m.compute_copies_ = on; });
  if (!on) drop_compute_copies();
}

void Module::drop_compute_copies() {
  each_module([](Module& m) {
    for (ParamSlot& p : m.params_) p.copy->reset();
  });
}

ComputeCopies Module::compute_copies() const {
  ComputeCopies out;
  for (const ParamSlot& p : params_) out.emplace_back(*p.slot, p.copy);
  for (auto& c : children_)
    for (auto& e : c.module->compute_copies()) out.push_back(std::move(e));
  return out;
}

void Module::to(Device device) {
  NoGradGuard no_grad;
  drop_compute_copies();  // copies of the tensors being replaced: never current again
  each_slot([&](Tensor& t, bool is_param) {
    if (t.device() == device) return;
    Tensor moved = to_device(t.detach(), device);
    if (is_param) moved.set_requires_grad(true);
    t = moved;
  });
}

void Module::to(DType dtype) {
  BLU_CHECK(is_floating(dtype), "Module::to: expected a floating dtype, got ", dtype);
  NoGradGuard no_grad;
  drop_compute_copies();
  each_slot([&](Tensor& t, bool is_param) {
    if (!is_floating(t.dtype()) || t.dtype() == dtype) return;
    Tensor cast = to_dtype(t.detach(), dtype);
    if (is_param) cast.set_requires_grad(true);
    t = cast;
  });
}

void Module::zero_grad() {
  each_slot([](Tensor& t, bool is_param) {
    if (is_param) t.zero_grad();
  });
}

}  // namespace blu::nn
