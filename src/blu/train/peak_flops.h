// train/peak_flops: a GPU's dense matmul peak for a --precision, for the MFU that `train` records
// (model FLOPs per second over this peak). The figures are the vendor's dense (no sparsity) tensor
// core peaks for the SXM parts; `--peak-tflops` overrides them (bench reports MFU against the
// measured cuBLASLt peak instead, which is lower: 795.7 TFLOP/s bf16 on the H100 here).
// Depends on nothing. Keep: an unknown GPU or the CPU gives 0 (no MFU), never a guess.
#pragma once
#include <string>

namespace blu::train {

// TFLOP/s for `device_name` (as cudaGetDeviceProperties names it, e.g. "NVIDIA H100 80GB HBM3")
// at `precision` (fp32 | tf32 | bf16 | fp16); 0 when the GPU is not in the table.
double dense_peak_tflops(const std::string& device_name, const std::string& precision);

}  // namespace blu::train
