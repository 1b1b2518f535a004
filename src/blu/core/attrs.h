// core/attrs: the non-tensor arguments of an op call (dims, scalars, flags, dtypes), by name.
// Ops, backends, observers and the compiler all read them the same way.
// Depends on core/dtype, core/shape. Keep: small and copyable; a missing attribute is an
// internal error (ops always set what their kernels read).
#pragma once
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "blu/core/dtype.h"
#include "blu/core/error.h"
#include "blu/core/shape.h"

namespace blu {

using AttrValue = std::variant<int64_t, double, bool, DType, Shape>;

class Attrs {
 public:
  Attrs() = default;
  Attrs(std::initializer_list<std::pair<std::string_view, AttrValue>> init) : items_(init) {}
  Attrs& set(std::string_view name, AttrValue v) {
    for (auto& [k, val] : items_)
      if (k == name) {
        val = std::move(v);
        return *this;
      }
    items_.emplace_back(name, std::move(v));
    return *this;
  }
  bool has(std::string_view name) const {
    for (auto& [k, v] : items_)
      if (k == name) return true;
    return false;
  }
  template <typename T>
  const T& get(std::string_view name) const {
    for (auto& [k, v] : items_)
      if (k == name) {
        BLU_ASSERT(std::holds_alternative<T>(v), "attribute '", name, "' has another type");
        return std::get<T>(v);
      }
    BLU_ASSERT(false, "missing attribute '", name, "'");
  }
  int64_t i(std::string_view name) const { return get<int64_t>(name); }
  double f(std::string_view name) const { return get<double>(name); }
  bool b(std::string_view name) const { return get<bool>(name); }
  const std::vector<std::pair<std::string_view, AttrValue>>& items() const { return items_; }

 private:
  // Names are string literals from op definitions: views are safe.
  std::vector<std::pair<std::string_view, AttrValue>> items_;
};

}  // namespace blu
