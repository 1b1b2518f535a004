// compiler/mlir/mlir_impl: helpers shared by the files of blutrain_mlir (translation, lowering,
// fusion). Internal: includes MLIR headers. Keep: included only by compiler/mlir/*.cpp.
#pragma once
#include <string>

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OwningOpRef.h"

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/graph.h"

namespace blu::compiler::mlir_impl {

// Collects the diagnostics MLIR emits while it lives, for error messages.
class DiagnosticCapture {
 public:
  explicit DiagnosticCapture(mlir::MLIRContext& ctx);
  const std::string& text() const { return text_; }

 private:
  std::string text_;
  mlir::ScopedDiagnosticHandler handler_;
};

mlir::Type element_type(mlir::MLIRContext& ctx, DType t);
mlir::OwningOpRef<mlir::ModuleOp> build_module(mlir::MLIRContext& ctx, const Graph& g);
mlir::OwningOpRef<mlir::ModuleOp> parse_module(mlir::MLIRContext& ctx, const std::string& text);
std::string print_op(mlir::Operation* op);
}  // namespace blu::compiler::mlir_impl

namespace blu::compiler::mlir_api {
struct FusionOptions;
}

namespace blu::compiler::mlir_impl {
std::vector<FusedRegion> fuse_module(mlir::ModuleOp module, const Graph& g, const mlir_api::FusionOptions& opt);

}  // namespace blu::compiler::mlir_impl
