// backend: what a device backend offers the dispatcher — a table of kernels by op name (in the
// spirit of ggml's backend interface: `supports(op)` before use, adding a backend means filling
// the table). Kernels receive inputs, already-allocated outputs and the execution context (the
// stream to queue work on and the workspace to take scratch from; Note [Execution context] in
// core/exec_context.h); they never allocate outputs, pick a stream or allocate scratch.
// Depends on core/. Keep: one registry per device type; kernels register at static init with
// BLU_REGISTER_KERNEL and are looked up by the op's name — by the dispatcher once per op and
// device type (it caches the result in the OpDef, ops/dispatch.h), not once per call.
#pragma once
#include <atomic>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "blu/core/attrs.h"
#include "blu/core/device.h"
#include "blu/core/exec_context.h"
#include "blu/core/tensor.h"

namespace blu {

struct KernelCall {
  std::string_view op;
  std::span<const Tensor> in;
  std::span<Tensor> out;
  const Attrs& attrs;
  const ExecContext& ctx;  // of the kernel's device; its workspace was reset for this call
  // Input i, or an undefined tensor when the call has fewer inputs (an optional last input).
  Tensor optional_in(size_t i) const { return i < in.size() ? in[i] : Tensor(); }
};
using Kernel = void (*)(const KernelCall&);

class Backend {
 public:
  explicit Backend(DeviceType type) : type_(type) {}
  void add(std::string_view op, Kernel k);
  Kernel find(std::string_view op) const;
  bool supports(std::string_view op) const { return find(op) != nullptr; }
  DeviceType type() const { return type_; }
  size_t size() const { return kernels_.size(); }
  // How many times find() has run (a by-name lookup: one string hash): lets tests check that the
  // dispatcher does not look kernels up per call.
  uint64_t lookups() const { return lookups_.load(std::memory_order_relaxed); }

 private:
  DeviceType type_;
  std::unordered_map<std::string, Kernel> kernels_;
  mutable std::atomic<uint64_t> lookups_{0};
};

Backend& backend(DeviceType type);

struct KernelRegistrar {
  KernelRegistrar(DeviceType type, std::string_view op, Kernel k) { backend(type).add(op, k); }
};

}  // namespace blu

#define BLU_REGISTER_KERNEL(device_type, op_name, fn) \
  static ::blu::KernelRegistrar BLU_CONCAT(blu_kernel_reg_, __COUNTER__)(::blu::DeviceType::device_type, op_name, fn)
