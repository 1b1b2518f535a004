// cuBLASLt is loaded on the first GPU GEMM, not at process start (backend/cuda/runtime.h): a
// process that does no GPU work never maps it, and the first use loads the library of the
// header's major version with every entry point the backend calls. Needs the CUDA toolkit's
// libraries, not a GPU, so the CPU suite runs it in every CUDA build.
#include <gtest/gtest.h>

#if BLU_HAVE_CUDA
#include <filesystem>
#include <fstream>
#include <string>

#include "blu/backend/cuda/runtime.h"

namespace blu::cuda {
namespace {

bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}

TEST(CudaLibraries, CublasLtLoadsOnFirstUseNotAtStart) {
  // Nothing in this binary's other tests runs a GPU GEMM; ctest runs each test in its own process.
  EXPECT_FALSE(mapped("libcublasLt")) << "cuBLASLt is mapped before any GEMM asked for it";
  const CublasLtApi& lt = cublaslt();
  EXPECT_TRUE(mapped("libcublasLt"));
  EXPECT_EQ(lt.GetVersion() / 10000, size_t(CUBLAS_VER_MAJOR));
  EXPECT_TRUE(std::filesystem::exists(cublaslt_path())) << cublaslt_path();
  EXPECT_NE(lt.Matmul, nullptr);
  EXPECT_NE(lt.MatrixLayoutSetAttribute, nullptr);
}

}  // namespace
}  // namespace blu::cuda
#endif
