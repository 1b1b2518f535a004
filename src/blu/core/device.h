// core/device: where a tensor lives — the CPU or one CUDA device. On the CPU, index 0 is host
// memory; an index >= 1 is a budgeted pool standing in for an accelerator's memory
// (memory/device_pool.h): its tensors run the CPU kernels, but crossing to or from it is an
// explicit copy, so offload plans and transfers run for real on machines without a GPU.
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
  Device(std::string_view spec);  // NOLINT: "cpu", "cpu:1", "cuda", "cuda:1"
  Device(const char* spec) : Device(std::string_view(spec)) {}  // NOLINT
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace blu
