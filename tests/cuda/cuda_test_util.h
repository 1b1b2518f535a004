// What the GPU tests (tests/cuda/*.cpp) share: kGPU, the device they run on (cuda:0);
// SKIP_WITHOUT_CUDA(), which skips a test where no CUDA device is visible; dev(t), a copy on kGPU;
// and host(t), a copy on the CPU that then waits for the device, so the host reads finished data.
#pragma once
#include <gtest/gtest.h>

#include "blu/blu.h"
#include "blu/core/cuda/runtime.h"

#define SKIP_WITHOUT_CUDA()                                                 \
  do {                                                                      \
    if (::blu::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace blu::test {

inline constexpr Device kGPU{DeviceType::cuda, 0};

inline Tensor dev(const Tensor& t) { return to_device(t, kGPU); }
inline Tensor host(const Tensor& t) {
  Tensor h = to_device(t, kCPU);
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  return h;
}

}  // namespace blu::test
