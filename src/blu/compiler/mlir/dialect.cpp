// compiler/mlir/dialect: the `blu` dialect's registration, its verifiers and interface methods.
#include "blu/compiler/mlir/dialect.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/Linalg/IR/Linalg.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/Tensor/IR/Tensor.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"

#include "blu/compiler/mlir/blu_dialect.cpp.inc"
#define GET_OP_CLASSES
#include "blu/compiler/mlir/blu_ops.cpp.inc"

namespace blu::mlir_blu {

void BluDialect::initialize() {
  addOperations<
#define GET_OP_LIST
#include "blu/compiler/mlir/blu_ops.cpp.inc"
      >();
}

// Every index in `updated` names an operand.
mlir::LogicalResult UpdateOp::verify() {
  const int64_t n = int64_t(getInputs().size());
  for (int64_t i : getUpdated())
    if (i < 0 || i >= n)
      return emitOpError() << "updated operand " << i << " out of range: the op has " << n << " operands";
  return mlir::success();
}

mlir::Value ViewOp::getViewSource() { return getSource(); }

}  // namespace blu::mlir_blu

namespace blu::compiler::mlir_impl {

void load_dialects(mlir::MLIRContext& ctx) {
  ctx.loadDialect<blu::mlir_blu::BluDialect, mlir::func::FuncDialect, mlir::linalg::LinalgDialect,
                  mlir::arith::ArithDialect, mlir::math::MathDialect, mlir::tensor::TensorDialect>();
}

}  // namespace blu::compiler::mlir_impl
