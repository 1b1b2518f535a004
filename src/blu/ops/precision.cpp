#include "blu/ops/precision.h"

#include <atomic>

#include "blu/core/error.h"

namespace blu {

static std::atomic<bool> g_tf32{false};

void set_matmul_precision(const std::string& mode) {
  BLU_CHECK(mode == "ieee" || mode == "tf32", "matmul precision must be 'ieee' or 'tf32', got '", mode, "'");
  g_tf32 = mode == "tf32";
}

bool matmul_allow_tf32() { return g_tf32; }

}  // namespace blu
