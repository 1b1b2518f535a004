// compiler/codegen/region_check: the check mode (BLU_COMPILE_CHECK=1) — a fused region run against
// eager on the same inputs. Eager replays the region's ops one by one through dispatch (each op's
// OpDef from the graph); the fused kernel runs once; the largest absolute difference over the
// region's outputs is reported (stderr, one line per region) and returned.
// Depends on compiler/codegen/cpu_kernel.h, ops/dispatch. Keep: the check never changes what the
// step computes (it reads copies of the inputs, writes its own outputs).
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "blu/compiler/codegen/cpu_kernel.h"

namespace blu::compiler {

bool compile_check_enabled();  // BLU_COMPILE_CHECK=1

// The region's outputs computed eagerly from `ins` (the region's inputs, in its order).
std::vector<Tensor> run_region_eager(const Graph& g, const FusedRegion& r, const std::vector<Tensor>& ins);
// Fresh contiguous outputs for the fused kernel.
std::vector<Tensor> alloc_region_outputs(const Graph& g, const FusedRegion& r);
// max |a - b| over two tensors of one shape, in f64 on the CPU: equal values (infinities too) and
// NaN against NaN differ by 0, a NaN against a number makes the result NaN.
double max_abs_diff(const Tensor& a, const Tensor& b);
// The worse of two such differences: NaN once either is NaN, else the larger.
inline double worse_diff(double a, double b) {
  if (std::isnan(a)) return a;
  return std::isnan(b) ? b : std::max(a, b);
}
// max |fused - eager| over all outputs (in f64); logs "compile check: region N (k ops): max |diff| X".
double check_region(const Graph& g, const FusedRegion& r, const CpuKernel& k, const std::vector<Tensor>& ins);

}  // namespace blu::compiler
