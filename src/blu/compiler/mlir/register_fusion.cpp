// compiler/mlir/register_fusion: makes mlir_api::fuse this build's fusion pass
// (compiler/fusion_plan.h) when the program starts. Built into the executables that link
// blutrain_mlir (the blutrain app, test_compiler_mlir) as their own source, not into the static
// library, where no symbol would pull it in.
// Depends on compiler/mlir/mlir_api.h, compiler/fusion_plan.h. Keep: no MLIR header here; the
// registered pass is mlir_api::fuse with the per-op opt-out of compiler/exclude.h.
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/compiler/mlir/mlir_api.h"

namespace blu::compiler {
namespace {

const bool registered = [] {
  register_fusion_pass([](const Graph& g) {
    mlir_api::FusionOptions o;
    o.no_fuse = excluded_ops();
    return mlir_api::fuse(g, o);
  });
  return true;
}();

}  // namespace
}  // namespace blu::compiler
