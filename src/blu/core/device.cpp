#include "blu/core/device.h"

#include <charconv>

#include "blu/core/error.h"

namespace blu {

// "cpu:N" with N >= 1 names a budgeted host pool that stands in for an accelerator on builds without
// one (memory/device_pool.h); "cpu:0" is the CPU itself.
static bool parse_index(std::string_view rest, int& index) {
  if (rest.empty() || rest[0] != ':') return false;
  int idx = -1;
  auto [p, ec] = std::from_chars(rest.data() + 1, rest.data() + rest.size(), idx);
  if (ec != std::errc() || p != rest.data() + rest.size() || idx < 0) return false;
  index = idx;
  return true;
}

Device::Device(std::string_view spec) {
  if (spec == "cpu") return;
  if (spec.starts_with("cpu") && parse_index(spec.substr(3), index)) return;
  if (spec.starts_with("cuda")) {
    type = DeviceType::cuda;
    std::string_view rest = spec.substr(4);
    if (rest.empty() || parse_index(rest, index)) return;
  }
  BLU_CHECK(false, "bad device '", spec, "' (expected cpu, cpu:N, cuda or cuda:N)");
}

std::string Device::str() const {
  if (type == DeviceType::cpu) return index == 0 ? std::string("cpu") : "cpu:" + std::to_string(index);
  return "cuda:" + std::to_string(index);
}

}  // namespace blu
