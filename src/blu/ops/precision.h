// ops/precision: process-wide numeric settings the kernels read — whether fp32 matmuls may use
// TF32 tensor cores ("tf32") or must be IEEE fp32 ("ieee", the default). The CPU backend always
// computes IEEE fp32. Depends on nothing. Keep: the default is IEEE, so results match the CPU.
#pragma once
#include <string>

namespace blu {

void set_matmul_precision(const std::string& mode);  // "ieee" | "tf32"; BLU_CHECK otherwise
bool matmul_allow_tf32();

}  // namespace blu
