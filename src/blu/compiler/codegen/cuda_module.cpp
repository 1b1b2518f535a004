// compiler/codegen/cuda_module: see cuda_module.h.
#include "blu/compiler/codegen/cuda_module.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>

#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/core/error.h"

#if BLU_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime.h>
#include <nvrtc.h>
#endif

namespace blu::compiler {
std::string cuda_target(const std::string& arch) { return "cuda-" + arch; }

namespace {
std::atomic<int> g_nvrtc_compiles{0};
}
int nvrtc_compile_count() { return g_nvrtc_compiles.load(); }

#if BLU_HAVE_CUDA

#define BLU_NVRTC_CHECK(expr, what)                                                                \
  do {                                                                                             \
    const nvrtcResult rc_ = (expr);                                                                \
    BLU_CHECK(rc_ == NVRTC_SUCCESS, "cuda codegen: ", what, ": ", nvrtcGetErrorString(rc_));       \
  } while (0)

std::string nvrtc_version() {
  int major = 0, minor = 0;
  BLU_NVRTC_CHECK(nvrtcVersion(&major, &minor), "nvrtcVersion");
  return "nvrtc " + std::to_string(major) + "." + std::to_string(minor);
}

std::string cuda_device_arch(int device_index) {
  int major = 0, minor = 0;
  BLU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index) == cudaSuccess &&
                cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index) == cudaSuccess,
            "cuda codegen: cannot read the compute capability of cuda:", device_index);
  return "sm_" + std::to_string(major) + std::to_string(minor) + (major == 9 && minor == 0 ? "a" : "");
}

namespace {

std::string nvrtc_compile(const std::string& src, const std::string& arch, int region) {
  nvrtcProgram prog;
  BLU_NVRTC_CHECK(nvrtcCreateProgram(&prog, src.c_str(), "blu_region.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  const std::string arch_opt = "--gpu-architecture=" + arch;
  const char* opts[] = {arch_opt.c_str(), "--fmad=false", "--std=c++17", "-default-device"};
  ++g_nvrtc_compiles;
  const nvrtcResult rc = nvrtcCompileProgram(prog, 4, opts);
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 1) nvrtcGetProgramLog(prog, log.data());
  if (rc != NVRTC_SUCCESS) {
    nvrtcDestroyProgram(&prog);
    BLU_CHECK(false, "cuda codegen: NVRTC failed on region ", region, " for ", arch, " (", nvrtcGetErrorString(rc), "):\n", log,
              "\nsource:\n", src);
  }
  size_t n = 0;
  BLU_NVRTC_CHECK(nvrtcGetCUBINSize(prog, &n), "nvrtcGetCUBINSize");
  std::string cubin(n, '\0');
  BLU_NVRTC_CHECK(nvrtcGetCUBIN(prog, cubin.data()), "nvrtcGetCUBIN");
  nvrtcDestroyProgram(&prog);
  return cubin;
}

// The driver entry points, through the runtime (no link against libcuda: the runtime finds the
// driver the process already uses).
struct Driver {
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*module_unload)(CUmodule) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    auto get = [](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
      const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
      BLU_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && p, "cuda codegen: no driver entry point ", name);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuModuleLoadData", x.module_load_data);
    get("cuModuleGetFunction", x.module_get_function);
    get("cuModuleUnload", x.module_unload);
    get("cuLaunchKernel", x.launch_kernel);
    return x;
  }();
  return d;
}

#define BLU_CU_CHECK(expr, what)                                              \
  do {                                                                        \
    const CUresult rc_ = (expr);                                              \
    BLU_CHECK(rc_ == CUDA_SUCCESS, "cuda codegen: ", what, " failed (CUresult ", int(rc_), ")"); \
  } while (0)

}  // namespace

CacheEntry build_cuda_kernel(const Graph& g, const FusedRegion& r, const std::string& arch, bool* compiled) {
  const std::string text = region_text(g, r);
  const std::string src = emit_cuda_source(g, r);
  // The source is in the key: a change of the emitter misses.
  const std::string key = kernel_cache_key(text + "\n" + src, cuda_target(arch), nvrtc_version());
  std::optional<CacheEntry> hit = kernel_cache_find(key, "cubin", text);
  if (compiled) *compiled = !hit;
  if (hit) return std::move(*hit);
  std::string cubin = nvrtc_compile(src, arch, r.index);
  std::string path = kernel_cache_store(key, "cubin", cubin, text);
  return CacheEntry{std::move(path), std::move(cubin)};
}

std::unique_ptr<CudaKernel> CudaKernel::load(const Graph& g, const FusedRegion& r, bool* compiled) {
  Device dev = kCPU;
  for (int v : r.inputs)
    if (!g.values[size_t(v)].device.is_cpu()) dev = g.values[size_t(v)].device;
  for (int v : r.outputs)
    if (!g.values[size_t(v)].device.is_cpu()) dev = g.values[size_t(v)].device;
  BLU_CHECK(dev.is_cuda(), "cuda codegen: region ", r.index, " is not on a CUDA device");
  const CacheEntry cubin = build_cuda_kernel(g, r, cuda_device_arch(dev.index), compiled);
  int current = 0;
  BLU_CHECK(cudaGetDevice(&current) == cudaSuccess && current == dev.index, "cuda codegen: region ", r.index, " is on ",
            dev.str(), ", the current device is cuda:", current);
  BLU_CHECK(cudaFree(nullptr) == cudaSuccess, "cuda codegen: no CUDA context on ", dev.str());  // the primary context
  std::unique_ptr<CudaKernel> k(new CudaKernel());
  CUmodule m = nullptr;
  BLU_CU_CHECK(driver().module_load_data(&m, cubin.bytes.data()), "cuModuleLoadData(" + cubin.path + ")");
  k->module_ = m;
  CUfunction fn = nullptr;
  BLU_CU_CHECK(driver().module_get_function(&fn, m, "blu_region"), "cuModuleGetFunction(blu_region)");
  k->function_ = fn;
  k->device_ = dev;
  k->shape_ = cuda_launch_shape(g, r);
  if (k->shape_.sums > 0) {
    CUfunction cf = nullptr;
    BLU_CU_CHECK(driver().module_get_function(&cf, m, "blu_region_columns"), "cuModuleGetFunction(blu_region_columns)");
    k->columns_ = cf;
  }
  return k;
}

CudaKernel::~CudaKernel() {
  if (module_) driver().module_unload(static_cast<CUmodule>(module_));
}

void CudaKernel::run(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs, const std::vector<double>& scalars,
                     void* stream, Workspace* scratch) const {
  const CudaLaunchShape& sh = shape_;
  BLU_CHECK(int(scalars.size()) == sh.scalars, "fused region: expected ", sh.scalars, " per-step scalars, got ",
            scalars.size());
  // Args: the pointers, the scalars (at least one slot), the vector flag, the column partials — as
  // the emitted struct.
  const size_t np = ins.size() + outs.size();
  std::vector<unsigned char> args(np * 8 + size_t(std::max(sh.scalars, 1)) * 8 + 16, 0);
  const std::vector<void*> p = region_operand_pointers(ins, outs);
  std::memcpy(args.data(), p.data(), np * 8);
  if (!scalars.empty()) std::memcpy(args.data() + np * 8, scalars.data(), scalars.size() * 8);
  int64_t vec = 0;
  if (sh.rows ? sh.vector > 1 : sh.work % sh.vector == 0) {
    vec = 1;
    for (int s : sh.full)
      if (reinterpret_cast<uintptr_t>(p[size_t(s)]) % 16 != 0) vec = 0;
  }
  std::memcpy(args.data() + args.size() - 16, &vec, 8);
  if (sh.work == 0) return;
  void* part = nullptr;
  if (sh.scratch > 0) {
    if (!scratch) scratch = current_context(device_).scratch;
    part = scratch->take(sh.scratch);
  }
  std::memcpy(args.data() + args.size() - 8, &part, 8);
  unsigned grid;
  if (sh.rows) {
    grid = unsigned(sh.grid);
  } else {
    static const int sms = [] {
      int dev = 0, n = 0;
      cudaGetDevice(&dev);
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
      return std::max(n, 1);
    }();
    const int64_t items = vec ? sh.work / sh.vector : sh.work;
    grid = unsigned(std::clamp<int64_t>((items + sh.threads - 1) / sh.threads, 1, int64_t(sms) * 16));
  }
  void* params[] = {args.data()};
  BLU_CU_CHECK(driver().launch_kernel(static_cast<CUfunction>(function_), grid, 1, 1, unsigned(sh.threads), 1, 1, 0,
                                      static_cast<CUstream>(stream), params, nullptr),
               "cuLaunchKernel(fused region)");
  if (sh.sums > 0)
    BLU_CU_CHECK(driver().launch_kernel(static_cast<CUfunction>(columns_), unsigned((sh.row_len + 31) / 32),
                                        unsigned(sh.sums), 1, 32, 32, 1, 0, static_cast<CUstream>(stream), params, nullptr),
                 "cuLaunchKernel(fused region's column sums)");
}

#else  // no CUDA in this build

std::string nvrtc_version() { return "none"; }
std::string cuda_device_arch(int) { BLU_CHECK(false, "cuda codegen: this build has no CUDA"); }
CacheEntry build_cuda_kernel(const Graph&, const FusedRegion& r, const std::string& arch, bool*) {
  BLU_CHECK(false, "cuda codegen: this build has no NVRTC (BLU_CUDA=OFF); region ", r.index, " for ", arch,
            " needs a CUDA build");
}
std::unique_ptr<CudaKernel> CudaKernel::load(const Graph&, const FusedRegion& r, bool*) {
  BLU_CHECK(false, "cuda codegen: this build has no CUDA; region ", r.index, " cannot be loaded");
}
CudaKernel::~CudaKernel() = default;
void CudaKernel::run(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<double>&, void*,
                     Workspace*) const {}

#endif

}  // namespace blu::compiler
