// ops/precision: the process-wide matmul precision setting (read by the CUDA gemm; the CPU
// ignores it).
#include <gtest/gtest.h>

#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/precision.h"

namespace blu {
namespace {

TEST(MatmulPrecision, NamesDefaultAndErrors) {
  EXPECT_EQ(matmul_precision(), MatmulPrecision::ieee) << "IEEE fp32 is the default";
  set_matmul_precision("tf32");
  EXPECT_EQ(matmul_precision(), MatmulPrecision::tf32);
  EXPECT_EQ(matmul_precision_name(matmul_precision()), "tf32");
  set_matmul_precision("highest");  // PyTorch's name for IEEE
  EXPECT_EQ(matmul_precision(), MatmulPrecision::ieee);
  set_matmul_precision("high");  // PyTorch's name for TF32
  EXPECT_EQ(matmul_precision(), MatmulPrecision::tf32);
  EXPECT_THROW(set_matmul_precision("medium"), Error);
  EXPECT_EQ(matmul_precision(), MatmulPrecision::tf32) << "a rejected name changes nothing";
  set_matmul_precision(MatmulPrecision::ieee);
}

TEST(MatmulPrecision, CpuIgnoresIt) {
  manual_seed(3);
  const Tensor a = randn({17, 33}), b = randn({33, 9});
  const auto ieee = to_vector(matmul(a, b));
  set_matmul_precision("tf32");
  const auto tf32 = to_vector(matmul(a, b));
  set_matmul_precision("ieee");
  EXPECT_EQ(ieee, tf32);
}

}  // namespace
}  // namespace blu
