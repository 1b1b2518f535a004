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
};
CublasLt& per_device(int d) {
  static CublasLt devices[kMaxDevices];
  BLU_ASSERT(d >= 0 && d < kMaxDevices, "device index ", d);
  CublasLt& p = devices[d];
  std::call_once(p.once, [&] {
    // Lives for the process: freeing CUDA objects during static destruction races the driver.
    BLU_CUBLAS_CHECK(cublasLtCreate(&p.lt));
  });
  return p;
}
}  // namespace

cublasLtHandle_t cublaslt_handle() { return per_device(current_device()).lt; }

}  // namespace blu::cuda
