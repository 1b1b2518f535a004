#include "blu/backend/cuda/runtime.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

namespace blu::cuda {

void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw Error(detail::concat("cuBLAS error ", int(st), " in ", expr, " at ", file, ":", line));
}

namespace {

struct LoadedCublasLt {
  CublasLtApi api{};
  std::string path;
};

const LoadedCublasLt& loaded_cublaslt() {
  static const LoadedCublasLt lib = [] {
    LoadedCublasLt l;
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    // The CUDA runtime's directory, from the library that holds one of its functions.
    std::string dir;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&cudaGetDeviceCount), &info) && info.dli_fname)
      dir = std::filesystem::path(info.dli_fname).parent_path().string();
    void* h = nullptr;
    std::string why;
    if (!dir.empty()) {
      h = dlopen((dir + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) why = dlerror();
    }
    if (!h) {
      h = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        const char* e = dlerror();
        BLU_CHECK(false, "cuBLASLt: cannot load ", soname, " beside the CUDA runtime (", dir.empty() ? "unknown" : dir,
                  "): ", why, "; nor from the library search path: ", e ? e : "?");
      }
    }
    char where[4096] = "";
    l.path = dlinfo(h, RTLD_DI_ORIGIN, where) == 0 ? std::string(where) + "/" + soname : soname;
    auto get = [&](const char* name, auto& fn) {
      void* p = dlsym(h, name);
      BLU_CHECK(p, "cuBLASLt: ", l.path, " has no ", name);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    CublasLtApi& a = l.api;
    get("cublasLtGetVersion", a.GetVersion);
    get("cublasLtCreate", a.Create);
    get("cublasLtMatmul", a.Matmul);
    get("cublasLtMatmulAlgoGetHeuristic", a.MatmulAlgoGetHeuristic);
    get("cublasLtMatmulAlgoCheck", a.MatmulAlgoCheck);
    get("cublasLtMatmulDescCreate", a.MatmulDescCreate);
    get("cublasLtMatmulDescDestroy", a.MatmulDescDestroy);
    get("cublasLtMatmulDescSetAttribute", a.MatmulDescSetAttribute);
    get("cublasLtMatmulPreferenceCreate", a.MatmulPreferenceCreate);
    get("cublasLtMatmulPreferenceDestroy", a.MatmulPreferenceDestroy);
    get("cublasLtMatmulPreferenceSetAttribute", a.MatmulPreferenceSetAttribute);
    get("cublasLtMatrixLayoutCreate", a.MatrixLayoutCreate);
    get("cublasLtMatrixLayoutDestroy", a.MatrixLayoutDestroy);
    get("cublasLtMatrixLayoutSetAttribute", a.MatrixLayoutSetAttribute);
    // cuBLASLt's version is major * 10000 + minor * 100 + patch.
    const size_t v = a.GetVersion();
    BLU_CHECK(v / 10000 == CUBLAS_VER_MAJOR, "cuBLASLt: ", l.path, " is version ", v, ", built against ",
              CUBLAS_VERSION);
    return l;
  }();
  return lib;
}

constexpr int kMaxDevices = 64;
struct CublasLt {
  std::once_flag once;
  cublasLtHandle_t lt = nullptr;
};
CublasLt& per_device(int d) {
  static CublasLt devices[kMaxDevices];
  BLU_ASSERT(d >= 0 && d < kMaxDevices, "device index ", d);
  CublasLt& p = devices[d];
  std::call_once(p.once, [&] {
    // Lives for the process: freeing CUDA objects during static destruction races the driver.
    BLU_CUBLAS_CHECK(cublaslt().Create(&p.lt));
  });
  return p;
}
}  // namespace

const CublasLtApi& cublaslt() { return loaded_cublaslt().api; }
std::string cublaslt_path() { return loaded_cublaslt().path; }

cublasLtHandle_t cublaslt_handle() { return per_device(current_device()).lt; }

}  // namespace blu::cuda
