// compiler/codegen/cuda_module: a fused region's CUDA kernel, built and run — the emitted CUDA C
// (cuda_kernel.h) compiled by NVRTC for the device's architecture (sm_90a on an H100) to a cubin,
// kept in the kernel cache (keyed by the region text and the source, "cuda-<arch>" and
// nvrtcVersion), loaded with the driver API (cuModuleLoadData, cuModuleGetFunction) and launched
// with cuLaunchKernel on the execution context's stream, by the region's launch shape.
// Depends on compiler/codegen/{cuda_kernel,kernel_cache}.h; NVRTC and the CUDA runtime only in
// BLU_HAVE_CUDA builds (elsewhere building or loading a kernel is refused with a message). Keep:
// a launch never allocates or synchronises.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/compiler/codegen/cuda_kernel.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/core/exec_context.h"
#include "blu/core/tensor.h"

namespace blu::compiler {

// The cache target for an architecture: "cuda-sm_90a".
std::string cuda_target(const std::string& arch);

// NVRTC's identity for the cache key ("nvrtc 13.0"); "none" in a build without CUDA.
std::string nvrtc_version();

// The architecture NVRTC compiles for on `device_index` ("sm_90a" for compute capability 9.0,
// "sm_<major><minor>" otherwise).
std::string cuda_device_arch(int device_index);

// The region's cubin for `arch` in the kernel cache: found there, or compiled with NVRTC and stored.
// Needs no GPU. Returns the cubin's path and bytes; `compiled` says whether NVRTC ran.
CacheEntry build_cuda_kernel(const Graph& g, const FusedRegion& r, const std::string& arch, bool* compiled = nullptr);

// How many times this process has called nvrtcCompileProgram (the cache test's "no NVRTC call").
int nvrtc_compile_count();

class CudaKernel {
 public:
  // build_cuda_kernel for the device of the region's values, then the module loaded on it.
  static std::unique_ptr<CudaKernel> load(const Graph& g, const FusedRegion& r, bool* compiled = nullptr);
  ~CudaKernel();
  CudaKernel(const CudaKernel&) = delete;
  CudaKernel& operator=(const CudaKernel&) = delete;
  // Queues the kernel on `stream` (a cudaStream_t; null: the default stream). ins/outs as
  // CpuKernel::run; scalars: region_scalars of this step's capture. Column partials are taken
  // from `scratch` (null: the current context's workspace of the region's device).
  void run(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs, const std::vector<double>& scalars,
           void* stream, Workspace* scratch = nullptr) const;
  // Workspace bytes each run takes.
  size_t scratch_bytes() const { return shape_.scratch; }

 private:
  CudaKernel() = default;
  void* module_ = nullptr;    // CUmodule
  void* function_ = nullptr;  // CUfunction
  void* columns_ = nullptr;   // CUfunction adding the column partials (null: no column sums)
  Device device_;
  CudaLaunchShape shape_;
};

}  // namespace blu::compiler
