// core/device: where a tensor lives — the CPU or one CUDA device.
// Depends on core/error. Keep: Device is a small value type, compared by (type, index).
#pragma once
#include <ostream>
#include <string>
#include <string_view>

namespace blu {

enum class DeviceType : uint8_t { cpu, cuda };
inline constexpr int kNumDeviceTypes = 2;

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  Device(std::string_view spec);  // NOLINT: "cpu", "cuda", "cuda:1"
  Device(const char* spec) : Device(std::string_view(spec)) {}  // NOLINT
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace blu
