// compiler/mlir/translate: the captured graph (compiler/graph.h) as a `blu` module, and the
// text round trip (parse → verify → print).
// Each graph op becomes one blu op chosen by its class (codegen/region.h's op_class): unary and
// binary pointwise ops their own blu op, other pointwise ops blu.pointwise, row reductions
// blu.row_reduce, AdamW blu.adamw_step, library calls blu.library_call, collectives
// blu.collective, views one blu.view per output, other in-place ops blu.update, Philox ops
// blu.random with their seed and offset as function arguments, the rest blu.opaque. Graph
// attributes ride in the attribute dictionary under their own names; blu.oid / blu.vids map back.
#include <sstream>

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"

#include "blu/compiler/mlir/dialect.h"
#include "blu/compiler/mlir/mlir_impl.h"
#include "blu/core/error.h"

namespace blu::compiler::mlir_impl {

mlir::Type element_type(mlir::MLIRContext& ctx, DType t) {
  mlir::Builder b(&ctx);
  switch (t) {
    case DType::f32: return b.getF32Type();
    case DType::f64: return b.getF64Type();
    case DType::bf16: return b.getBF16Type();
    case DType::f16: return b.getF16Type();
    case DType::i32: return b.getI32Type();
    case DType::i64: return b.getI64Type();
    case DType::u8: return mlir::IntegerType::get(&ctx, 8, mlir::IntegerType::Unsigned);
    case DType::b8: return b.getI1Type();
  }
  BLU_ASSERT(false, "element_type: unknown dtype");
}

mlir::RankedTensorType tensor_type(mlir::MLIRContext& ctx, const Value& v) {
  return mlir::RankedTensorType::get(llvm::ArrayRef<int64_t>(v.shape.data(), v.shape.size()),
                                     element_type(ctx, v.dtype));
}

DiagnosticCapture::DiagnosticCapture(mlir::MLIRContext& ctx)
    : handler_(&ctx, [this](mlir::Diagnostic& d) {
        text_ += d.str();
        text_ += "\n";
        return mlir::success();
      }) {}

std::string print_op(mlir::Operation* op) {
  std::string s;
  llvm::raw_string_ostream os(s);
  op->print(os);
  return s;
}

namespace {

const char* blu_op_name(const Op& op) {
  if (op.kind == OpKind::collective) return "blu.collective";
  if (op.kind == OpKind::view) return "blu.view";
  if (op.rng) return "blu.random";
  switch (op_class(op.name)) {
    case OpClass::unary:
    case OpClass::binary: return nullptr;  // "blu." + name
    case OpClass::pointwise: return "blu.pointwise";
    case OpClass::row: return "blu.row_reduce";
    case OpClass::adamw: return "blu.adamw_step";
    case OpClass::library: return "blu.library_call";
    case OpClass::other: break;
  }
  return op.writes.empty() ? "blu.opaque" : "blu.update";
}

mlir::Attribute attr_value(mlir::Builder& b, const AttrValue& v) {
  if (auto* i = std::get_if<int64_t>(&v)) return b.getI64IntegerAttr(*i);
  if (auto* d = std::get_if<double>(&v)) return b.getF64FloatAttr(*d);
  if (auto* f = std::get_if<bool>(&v)) return b.getBoolAttr(*f);
  if (auto* t = std::get_if<DType>(&v)) return b.getStringAttr(std::string(dtype_name(*t)));
  const Shape& s = std::get<Shape>(v);
  return b.getDenseI64ArrayAttr(llvm::ArrayRef<int64_t>(s.data(), s.size()));
}

}  // namespace

mlir::OwningOpRef<mlir::ModuleOp> build_module(mlir::MLIRContext& ctx, const Graph& g) {
  load_dialects(ctx);
  mlir::OpBuilder b(&ctx);
  const mlir::Location loc = b.getUnknownLoc();
  mlir::OwningOpRef<mlir::ModuleOp> module = mlir::ModuleOp::create(loc);

  // Arguments: the graph inputs, then a (seed, offset) pair per Philox op.
  std::vector<mlir::Type> arg_types;
  for (int vid : g.inputs) arg_types.push_back(tensor_type(ctx, g.values.at(size_t(vid))));
  const auto i64_scalar = mlir::RankedTensorType::get({}, b.getI64Type());
  int n_rng = 0;
  for (const Op& op : g.ops) n_rng += op.rng ? 1 : 0;
  for (int i = 0; i < 2 * n_rng; ++i) arg_types.push_back(i64_scalar);
  std::vector<mlir::Type> result_types;
  for (int vid : g.outputs) result_types.push_back(tensor_type(ctx, g.values.at(size_t(vid))));

  b.setInsertionPointToEnd(module->getBody());
  auto func = mlir::func::FuncOp::create(b, loc, "step", b.getFunctionType(arg_types, result_types));
  mlir::Block* body = func.addEntryBlock();
  std::vector<mlir::Value> env(g.values.size());
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    env[size_t(g.inputs[i])] = body->getArgument(unsigned(i));
    func.setArgAttr(unsigned(i), "blu.vid", b.getI64IntegerAttr(g.inputs[i]));
  }
  b.setInsertionPointToEnd(body);
  unsigned next_rng_arg = unsigned(g.inputs.size());

  for (size_t oi = 0; oi < g.ops.size(); ++oi) {
    const Op& op = g.ops[oi];
    std::vector<mlir::Value> operands;
    std::vector<int64_t> absent;
    for (size_t k = 0; k < op.inputs.size(); ++k) {
      const int vid = op.inputs[k];
      if (vid < 0) {
        absent.push_back(int64_t(k));
        continue;
      }
      BLU_ASSERT(env.at(size_t(vid)), "to_blu: op ", oi, " (", op.name, ") reads value %", vid,
                 " before its definition");
      operands.push_back(env[size_t(vid)]);
    }
    auto common_attrs = [&](mlir::OperationState& st, llvm::ArrayRef<int> vids) {
      for (const auto& [name, v] : op.attrs.items()) {
        if (op.rng && (name == "seed" || name == "offset")) continue;  // operands instead
        st.addAttribute(llvm::StringRef(name.data(), name.size()), attr_value(b, v));
      }
      st.addAttribute("blu.oid", b.getI64IntegerAttr(int64_t(oi)));
      st.addAttribute("blu.vids", b.getDenseI64ArrayAttr(std::vector<int64_t>(vids.begin(), vids.end())));
      if (!absent.empty()) st.addAttribute("blu.absent", b.getDenseI64ArrayAttr(absent));
    };
    if (op.kind == OpKind::view) {
      // One blu.view per output (split makes several), each aliasing its source.
      for (size_t j = 0; j < op.outputs.size(); ++j) {
        int src = op.inputs.empty() ? -1 : 0;
        for (auto [out, in] : op.views)
          if (size_t(out) == j) src = in;
        BLU_ASSERT(src >= 0 && size_t(src) < operands.size(), "to_blu: view op ", oi, " (", op.name,
                   ") output ", j, " has no source");
        mlir::OperationState st(loc, "blu.view");
        st.addOperands(operands[size_t(src)]);
        st.addTypes(tensor_type(ctx, g.values.at(size_t(op.outputs[j]))));
        st.addAttribute("kind", b.getStringAttr(op.name));
        common_attrs(st, {op.outputs[j]});
        env[size_t(op.outputs[j])] = b.create(st)->getResult(0);
      }
      continue;
    }
    const char* name = blu_op_name(op);
    const std::string full = name ? std::string(name) : "blu." + op.name;
    mlir::OperationState st(loc, full);
    st.addOperands(operands);
    if (op.rng) {
      st.addOperands({body->getArgument(next_rng_arg), body->getArgument(next_rng_arg + 1)});
      func.setArgAttr(next_rng_arg, "blu.seed_of", b.getI64IntegerAttr(int64_t(oi)));
      func.setArgAttr(next_rng_arg + 1, "blu.offset_of", b.getI64IntegerAttr(int64_t(oi)));
      next_rng_arg += 2;
    }
    for (int vid : op.outputs) st.addTypes(tensor_type(ctx, g.values.at(size_t(vid))));
    if (name && std::string(name) != "blu.adamw_step") st.addAttribute("kind", b.getStringAttr(op.name));
    if (full == "blu.update") {
      std::vector<int64_t> updated;
      for (int w : op.writes)
        for (size_t k = 0, pos = 0; k < op.inputs.size(); ++k) {
          if (op.inputs[k] < 0) continue;
          if (op.inputs[k] == w) updated.push_back(int64_t(pos));
          ++pos;
        }
      st.addAttribute("updated", b.getDenseI64ArrayAttr(updated));
    }
    common_attrs(st, op.outputs);
    mlir::Operation* made = b.create(st);
    for (size_t j = 0; j < op.outputs.size(); ++j) env[size_t(op.outputs[j])] = made->getResult(unsigned(j));
  }
  std::vector<mlir::Value> results;
  for (int vid : g.outputs) {
    BLU_ASSERT(env.at(size_t(vid)), "to_blu: graph output %", vid, " is never defined");
    results.push_back(env[size_t(vid)]);
  }
  mlir::func::ReturnOp::create(b, loc, results);
  DiagnosticCapture diag(ctx);
  if (mlir::failed(mlir::verify(module.get())))
    BLU_CHECK(false, "to_blu: the blu module does not verify:\n", diag.text());
  return module;
}

mlir::OwningOpRef<mlir::ModuleOp> parse_module(mlir::MLIRContext& ctx, const std::string& text) {
  load_dialects(ctx);
  DiagnosticCapture diag(ctx);
  mlir::OwningOpRef<mlir::ModuleOp> m = mlir::parseSourceString<mlir::ModuleOp>(text, &ctx);
  BLU_CHECK(m, "blu module: does not parse:\n", diag.text());
  BLU_CHECK(mlir::succeeded(mlir::verify(m.get())), "blu module: does not verify:\n", diag.text());
  return m;
}

}  // namespace blu::compiler::mlir_impl

namespace blu::compiler::mlir_api {

std::string to_blu(const Graph& g) {
  mlir::MLIRContext ctx;
  return mlir_impl::print_op(mlir_impl::build_module(ctx, g).get());
}

std::string round_trip(const std::string& text) {
  mlir::MLIRContext ctx;
  return mlir_impl::print_op(mlir_impl::parse_module(ctx, text).get());
}

}  // namespace blu::compiler::mlir_api
