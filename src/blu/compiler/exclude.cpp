#include "blu/compiler/exclude.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "blu/backend/backend.h"
#include "blu/core/error.h"

namespace blu::compiler {

std::vector<std::string> parse_op_list(std::string_view spec) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= spec.size()) {
    size_t end = spec.find(',', at);
    if (end == std::string_view::npos) end = spec.size();
    std::string_view item = spec.substr(at, end - at);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    if (!item.empty() && std::find(out.begin(), out.end(), item) == out.end()) out.emplace_back(item);
    at = end + 1;
  }
  return out;
}

std::vector<std::string> checked_op_list(std::string_view spec, std::string_view source) {
  std::vector<std::string> names = parse_op_list(spec);
  for (const std::string& n : names)
    BLU_CHECK(backend(DeviceType::cpu).supports(n) || backend(DeviceType::cuda).supports(n), source, ": '", n,
              "' is not an op's name (expected dispatch ops as the compile log and the graph dump print them, e.g. ",
              "linear, add, gelu, layer_norm, gelu_and_backward)");
  return names;
}

namespace {

std::mutex g_mu;

std::vector<std::string>& list() {
  static std::vector<std::string> names = [] {
    const char* e = std::getenv("BLU_COMPILE_EXCLUDE");
    return e ? checked_op_list(e, "BLU_COMPILE_EXCLUDE") : std::vector<std::string>{};
  }();
  return names;
}

}  // namespace

const std::vector<std::string>& excluded_ops() {
  std::lock_guard<std::mutex> lock(g_mu);
  return list();
}

void set_excluded_ops(std::vector<std::string> names) {
  std::lock_guard<std::mutex> lock(g_mu);
  list() = std::move(names);
}

bool op_excluded(std::string_view name) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto& l = list();
  return std::find(l.begin(), l.end(), name) != l.end();
}

}  // namespace blu::compiler
