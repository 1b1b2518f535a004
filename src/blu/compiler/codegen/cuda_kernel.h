// compiler/codegen/cuda_kernel: a fused region as a CUDA kernel — emitted CUDA C compiled by NVRTC
// for the device's architecture (sm_90a on an H100) to a cubin, kept in the kernel cache (keyed by
// the region text, "cuda-<arch>" and nvrtcVersion) and loaded with the driver API
// (cuModuleLoadData, cuModuleGetFunction; cuLaunchKernel on the execution context's stream).
// The emitted source includes no header (its own bf16/f16 conversions in PTX, its own integer
// types), so NVRTC needs no include path and a cold compile is a fraction of a second.
// Kernel shapes:
//   pointwise  a grid-stride loop; when every full-size operand is 16-byte aligned and the element
//              count divides into vectors, 16-byte loads and stores (V elements of the narrowest
//              operand per iteration, as backend/cuda/loops.cuh's contiguous path); broadcast
//              operands are read through their index map;
//   rows       a group of TPR threads per row of the last dimension: one warp (4 rows to a
//              block) while each thread then holds at most 8 vectors, else a block of up to 1024.
//              Thread t of a group owns the row's vectors t, t + TPR, … (V elements each, 16 bytes
//              of the narrowest row operand) in every op, so a row intermediate lives in its
//              registers; the row's float inputs are read as 16-byte vectors at the row's start
//              (a norm weight once, before the rows), outputs written as vectors (element-wise
//              when an operand is not 16-byte aligned); only reductions communicate (warp
//              shuffles; for a block, one shared slot per warp);
//   rows with column sums (a norm backward's weight and bias gradients): G = min(ceil(R / rows
//              per block), 1024) blocks; group g of block b runs rows b·RPB + g, then every G·RPB
//              with the same per-row code, adding each element's terms into its group's shared
//              sums (a thread alone touches its addresses); the block adds its groups' sums in
//              group order into its partial row in the call's workspace, and a second kernel adds
//              the G partial rows of each column in block order (in double) — the same order on
//              every GPU and every run. The groups' sums must fit 40 KiB of shared memory
//              (else the region is not emitted).
// Arithmetic: 16-bit floats compute in float and round to their dtype where eager stores them (each
// op's result), NaN encoded as the CPU encodes it; compiled with --fmad=false, so no multiply-add
// is contracted — the eager kernels keep contraction out of their multi-step formulas with __f*_rn;
// GELU on 16-bit outputs takes tanh from the same fast formula as eager (elementwise.cu); row
// statistics (norm mean/variance, softmax and cross-entropy sums) accumulate in double over a
// fixed tree, which is not eager's order (a stated tolerance, tests/cuda/codegen_cuda_test.cpp).
// Covered: every pointwise op of emit_common, AdamW (with its copies), layer/RMS norm forward and
// backward, softmax (+backward), cross-entropy with reduction none (+backward, none or sum). Not
// covered (the region runs its eager kernels): cross-entropy with reduction mean.
// Depends on compiler/codegen/{region,emit_common,kernel_cache}.h; NVRTC and the CUDA runtime only
// in BLU_HAVE_CUDA builds (the emitter itself builds everywhere). Keep: region inputs and outputs
// are contiguous (fused_step refuses strided ones); a launch never allocates or synchronises.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/core/exec_context.h"
#include "blu/core/tensor.h"

namespace blu::compiler {

// Whether every op of the region has a CUDA emitter.
bool cuda_emitter_supports(const Graph& g, const FusedRegion& r);
// The region's kernel, `extern "C" __global__ void blu_region(Args)` (and, with column sums,
// `blu_region_columns(Args)`), as CUDA C.
std::string emit_cuda_source(const Graph& g, const FusedRegion& r);

// The cache target for an architecture: "cuda-sm_90a".
std::string cuda_target(const std::string& arch);

// NVRTC's identity for the cache key ("nvrtc 13.0"); "none" in a build without CUDA.
std::string nvrtc_version();

// The architecture NVRTC compiles for on `device_index` ("sm_90a" for compute capability 9.0,
// "sm_<major><minor>" otherwise).
std::string cuda_device_arch(int device_index);

// The region's cubin for `arch` in the kernel cache: found there, or compiled with NVRTC and stored.
// Needs no GPU. Returns the cubin's path; `compiled` says whether NVRTC ran.
std::string build_cuda_kernel(const Graph& g, const FusedRegion& r, const std::string& arch, bool* compiled = nullptr);

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
  size_t scratch_bytes() const { return scratch_; }

 private:
  CudaKernel() = default;
  void* module_ = nullptr;    // CUmodule
  void* function_ = nullptr;  // CUfunction
  void* columns_ = nullptr;   // CUfunction adding the column partials (null: no column sums)
  Device device_;
  bool rows_ = false;
  int64_t row_len_ = 1;       // C (rows)
  int64_t grid_ = 1;          // blocks (rows)
  int threads_ = 256;         // threads per block
  int sums_ = 0;              // column sums
  size_t scratch_ = 0;
  int64_t work_ = 0;          // elements (pointwise) or rows
  int vector_ = 1;            // elements per vector access
  int scalars_ = 0;
  std::vector<int> full_;     // operand slots (inputs then outputs) accessed as vectors
};

}  // namespace blu::compiler
