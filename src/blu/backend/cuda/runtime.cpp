#include "blu/backend/cuda/runtime.h"

#include <mutex>

namespace blu::cuda {

void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw Error(detail::concat("cuBLAS error ", int(st), " in ", expr, " at ", file, ":", line));
}

namespace {
constexpr int kMaxDevices = 64;
struct CublasLt {
  std::once_flag once;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 32u << 20;
};
CublasLt& per_device(int d) {
  static CublasLt devices[kMaxDevices];
  BLU_ASSERT(d >= 0 && d < kMaxDevices, "device index ", d);
  CublasLt& p = devices[d];
  std::call_once(p.once, [&] {
    // Lives for the process: freeing CUDA objects during static destruction races the driver.
    BLU_CUBLAS_CHECK(cublasLtCreate(&p.lt));
    BLU_CUDA_CHECK(cudaMalloc(&p.workspace, p.workspace_bytes));
  });
  return p;
}
}  // namespace

cublasLtHandle_t cublaslt_handle() { return per_device(current_device()).lt; }
void* cublaslt_workspace(size_t* bytes) {
  CublasLt& p = per_device(current_device());
  *bytes = p.workspace_bytes;
  return p.workspace;
}

}  // namespace blu::cuda
