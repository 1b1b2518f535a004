// compiler/codegen/cpu_kernel: a fused region as a CPU kernel — emitted C++ compiled by the
// system C++ compiler into a shared object (through the kernel cache) and dlopen'ed.
// Why emitted C++ and not MLIR's ExecutionEngine: the same emitter shape serves the CUDA path
// (emitted CUDA C for NVRTC), the kernel runs the eager CPU kernels' arithmetic in the same order
// (so compiled equals eager bitwise where the op's order is the same), and loading a cached .so
// needs no MLIR (the GPU machine has none).
// Emitted arithmetic: each op computes in its accumulation type (float for f32/bf16/f16, double
// for f64) with the eager kernel's formula, and rounds its result to its value's dtype, as eager
// does when it stores it; layer_norm's statistics run in double over the row, as eager's.
// Supported: unary and binary pointwise ops (broadcast inputs), cast, layer_norm forward. Other
// ops throw "not supported" from emit_cpu_source, and the caller keeps them eager.
// Depends on compiler/codegen/region.h, kernel_cache.h, core/. Keep: region inputs/outputs are
// contiguous tensors (the runtime checks; a strided value is not fused).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/core/tensor.h"

namespace blu::compiler {

// Whether every op of the region has a CPU emitter.
bool cpu_emitter_supports(const Graph& g, const FusedRegion& r);
std::string emit_cpu_source(const Graph& g, const FusedRegion& r);

class CpuKernel {
 public:
  // Loads the region's kernel from the cache, or emits, compiles and caches it. `compiled`
  // says which happened.
  static std::unique_ptr<CpuKernel> load(const Graph& g, const FusedRegion& r, bool* compiled = nullptr);
  ~CpuKernel();
  CpuKernel(const CpuKernel&) = delete;
  CpuKernel& operator=(const CpuKernel&) = delete;
  // ins: the region's inputs, outs: its outputs (allocated by the caller), in the region's order;
  // scalars: region_scalars of this step's capture (region.h).
  void run(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs, const std::vector<double>& scalars) const;

 private:
  CpuKernel() = default;
  void* handle_ = nullptr;
  void (*fn_)(void* const*, const double*) = nullptr;
};

// The kernel cache's target for CPU kernels (the kernel ABI: pointers, then the scalar array).
inline constexpr const char* kCpuTarget = "cpu-x86_64-abi2";

// The C++ compiler's identity for the cache key ("g++ (Debian 12.2.0-14) 12.2.0").
std::string cpu_toolchain_version();

}  // namespace blu::compiler
