#include "blu/train/peak_flops.h"

namespace blu::train {

namespace {
struct Peak {
  const char* name_part;  // matched as a substring of the device name; the first match wins
  double fp32, tf32, bf16;  // fp16 runs at the bf16 rate on these parts
};
// Vendor datasheets, dense: H100/H200 SXM5, H100 PCIe, A100 SXM4/PCIe (the same peaks), L40S.
constexpr Peak kPeaks[] = {
    {"H200", 66.9, 494.7, 989.4},
    {"H100 PCIe", 51.2, 378.0, 756.0},
    {"H100", 66.9, 494.7, 989.4},
    {"A100", 19.5, 156.0, 312.0},
    {"L40S", 91.6, 183.0, 362.05},
};
}  // namespace

double dense_peak_tflops(const std::string& device_name, const std::string& precision) {
  for (const Peak& p : kPeaks) {
    if (device_name.find(p.name_part) == std::string::npos) continue;
    if (precision == "fp32") return p.fp32;
    if (precision == "tf32") return p.tf32;
    if (precision == "bf16" || precision == "fp16") return p.bf16;
    return 0;
  }
  return 0;
}

}  // namespace blu::train
