// compiler/mlir/dialect: the C++ side of the `blu` dialect (blu_ops.td): the generated dialect
// and op classes, and the registry of every dialect the compiler's modules use.
// Internal to blutrain_mlir (includes MLIR headers). Keep: included only by compiler/mlir/*.cpp.
#pragma once
#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "mlir/Interfaces/ViewLikeInterface.h"

#include "blu/compiler/mlir/blu_dialect.h.inc"
#define GET_OP_CLASSES
#include "blu/compiler/mlir/blu_ops.h.inc"

namespace blu::compiler::mlir_impl {

// A context with blu, func, linalg, arith, math and tensor loaded.
void load_dialects(mlir::MLIRContext& ctx);

}  // namespace blu::compiler::mlir_impl
