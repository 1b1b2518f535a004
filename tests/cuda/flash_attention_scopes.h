// Scope guards for the flash-attention GPU tests (flash_attention_test.cpp, and the timings in
// flash_attention_perf_test.cpp): each sets a kernel-selection switch of backend/cuda/
// flash_attention.h for its scope and restores it at exit, even when a check fails.
#pragma once
#include <initializer_list>
#include <utility>
#include <vector>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/ops/precision.h"

namespace blu::test {

// The f32 kernel family and numeric mode for the scope; restores the defaults (TF32 kernels,
// "ieee") even when a check fails.
enum class F32Path { ieee_3xtf32, tf32_1x };
struct F32PathScope {
  explicit F32PathScope(F32Path path) {
    set_matmul_precision(path == F32Path::tf32_1x ? MatmulPrecision::tf32 : MatmulPrecision::ieee);
  }
  ~F32PathScope() { set_matmul_precision(MatmulPrecision::ieee); }
};

// Whether bf16/f16 take the wgmma forward and backward where they are available; off, the
// mma.sync kernels (both restored to on at exit).
struct WgmmaScope {
  explicit WgmmaScope(bool fwd, bool bwd) {
    cuda::set_flash_attention_wgmma(fwd);
    cuda::set_flash_attention_wgmma_backward(bwd);
  }
  explicit WgmmaScope(bool on) : WgmmaScope(on, on) {}
  ~WgmmaScope() {
    cuda::set_flash_attention_wgmma(true);
    cuda::set_flash_attention_wgmma_backward(true);
  }
};

// Sets the CTA order's head group (Note [head groups]) of the forwards and the backward for a
// scope, restoring the previous ones.
struct HeadGroupScope {
  int saved[2] = {cuda::flash_attention_head_group(false), cuda::flash_attention_head_group(true)};
  HeadGroupScope(int fwd, int bwd) {
    cuda::set_flash_attention_head_group(false, fwd);
    cuda::set_flash_attention_head_group(true, bwd);
  }
  ~HeadGroupScope() {
    cuda::set_flash_attention_head_group(false, saved[0]);
    cuda::set_flash_attention_head_group(true, saved[1]);
  }
};

}  // namespace blu::test
