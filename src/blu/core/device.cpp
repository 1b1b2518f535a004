#include "blu/core/device.h"

#include <charconv>

#include "blu/core/error.h"

namespace blu {

Device::Device(std::string_view spec) {
  if (spec == "cpu") return;
  if (spec.starts_with("cuda")) {
    type = DeviceType::cuda;
    std::string_view rest = spec.substr(4);
    if (rest.empty()) return;
    int idx = -1;
    if (rest[0] == ':') {
      auto [p, ec] = std::from_chars(rest.data() + 1, rest.data() + rest.size(), idx);
      if (ec == std::errc() && p == rest.data() + rest.size() && idx >= 0) {
        index = idx;
        return;
      }
    }
  }
  BLU_CHECK(false, "bad device '", spec, "' (expected cpu, cuda or cuda:N)");
}

std::string Device::str() const {
  return type == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

}  // namespace blu
