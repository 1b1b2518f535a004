#include "blu/core/precision.h"

#include <atomic>

#include "blu/core/error.h"

namespace blu {

namespace {
std::atomic<MatmulPrecision> g_precision{MatmulPrecision::ieee};
}  // namespace

void set_matmul_precision(std::string_view name) {
  if (name == "ieee" || name == "highest") {
    set_matmul_precision(MatmulPrecision::ieee);
  } else if (name == "tf32" || name == "high") {
    set_matmul_precision(MatmulPrecision::tf32);
  } else {
    BLU_CHECK(false, "set_matmul_precision: expected \"ieee\" or \"tf32\", got \"", name, "\"");
  }
}
void set_matmul_precision(MatmulPrecision p) { g_precision.store(p, std::memory_order_relaxed); }
MatmulPrecision matmul_precision() { return g_precision.load(std::memory_order_relaxed); }
std::string_view matmul_precision_name(MatmulPrecision p) { return p == MatmulPrecision::ieee ? "ieee" : "tf32"; }

}  // namespace blu
