#include "blu/backend/backend.h"

namespace blu {

void Backend::add(std::string_view op, Kernel k) {
  auto [it, fresh] = kernels_.emplace(std::string(op), k);
  BLU_ASSERT(fresh, "kernel for op '", op, "' registered twice");
}

Kernel Backend::find(std::string_view op) const {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  auto it = kernels_.find(std::string(op));
  return it == kernels_.end() ? nullptr : it->second;
}

Backend& backend(DeviceType type) {
  static Backend cpu(DeviceType::cpu), cuda(DeviceType::cuda);
  return type == DeviceType::cpu ? cpu : cuda;
}

}  // namespace blu
