// compiler/mlir/blu_ops.td: the `blu` dialect in ODS — one op per op kind of the captured step
// (compiler/graph.h), on statically shaped tensors.
// What the ops say:
//   - pointwise, broadcast and row-reduction ops are Pure (no memory effects): the fusion pass may
//     group, reorder and recompute them;
//   - library ops (GEMMs, attention) and collectives are opaque calls the fusion pass never crosses;
//     collectives read and write memory (MemRead/MemWrite on their operands);
//   - in-place ops name the operands they update (MemWrite), and their results are those operands
//     after the update (the translation ties them by value id);
//   - views alias their source (ViewLikeOpInterface), never copy;
//   - random ops take the Philox seed and offset as operands, never as attributes, so one compiled
//     step serves every step's random numbers.
// Every op may carry `blu.vids` (the graph value ids of its results) and `blu.oid` (the graph op
// index); function arguments carry `blu.vid`. Those are how regions map back to the graph.
// Generated with mlir-tblgen-22 (CMakeLists.txt, BLU_MLIR). Keep: no op here without a
// counterpart in graph.h's op kinds, and the effects stated here match what the kernels do.

include "mlir/IR/OpBase.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/ViewLikeInterface.td"

def Blu_Dialect : Dialect {
  let name = "blu";
  let summary = "BluTrain's captured training step: ops of the op table on static shapes";
  let cppNamespace = "::blu::mlir_blu";
}

class Blu_Op<string mnemonic, list<Trait> traits = []> : Op<Blu_Dialect, mnemonic, traits>;

// --- pointwise ------------------------------------------------------------------------------
// Unary: the result has the operand's shape; `scalar`/`scalar2` carry the op's scalars
// (clamp's bounds, pow_scalar's exponent, add_scalar/mul_scalar's operand).
class Blu_UnaryOp<string mnemonic> : Blu_Op<mnemonic, [Pure, SameOperandsAndResultShape]> {
  let arguments = (ins AnyRankedTensor:$x, OptionalAttr<F64Attr>:$scalar, OptionalAttr<F64Attr>:$scalar2);
  let results = (outs AnyRankedTensor:$out);
  let assemblyFormat = "$x attr-dict `:` type($x) `->` type($out)";
}
def Blu_NegOp : Blu_UnaryOp<"neg">;
def Blu_ExpOp : Blu_UnaryOp<"exp">;
def Blu_LogOp : Blu_UnaryOp<"log">;
def Blu_SqrtOp : Blu_UnaryOp<"sqrt">;
def Blu_RsqrtOp : Blu_UnaryOp<"rsqrt">;
def Blu_TanhOp : Blu_UnaryOp<"tanh">;
def Blu_SigmoidOp : Blu_UnaryOp<"sigmoid">;
def Blu_ReluOp : Blu_UnaryOp<"relu">;
def Blu_GeluOp : Blu_UnaryOp<"gelu">;
def Blu_SiluOp : Blu_UnaryOp<"silu">;
def Blu_AbsOp : Blu_UnaryOp<"abs">;
def Blu_SignOp : Blu_UnaryOp<"sign">;
def Blu_ClampOp : Blu_UnaryOp<"clamp">;
def Blu_PowScalarOp : Blu_UnaryOp<"pow_scalar">;
def Blu_AddScalarOp : Blu_UnaryOp<"add_scalar">;
def Blu_MulScalarOp : Blu_UnaryOp<"mul_scalar">;
// The dtype conversion: the result's element type is the target dtype.
def Blu_CastOp : Blu_UnaryOp<"cast">;

// Binary with numpy broadcasting: the result's shape is the broadcast of the operands' shapes
// (checked by the translation from the graph's shapes, which the op table's infer rules made).
class Blu_BinaryOp<string mnemonic> : Blu_Op<mnemonic, [Pure]> {
  let arguments = (ins AnyRankedTensor:$lhs, AnyRankedTensor:$rhs);
  let results = (outs AnyRankedTensor:$out);
  let assemblyFormat = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs) `->` type($out)";
}
def Blu_AddOp : Blu_BinaryOp<"add">;
def Blu_SubOp : Blu_BinaryOp<"sub">;
def Blu_MulOp : Blu_BinaryOp<"mul">;
def Blu_DivOp : Blu_BinaryOp<"div">;
def Blu_PowOp : Blu_BinaryOp<"pow">;
def Blu_EqOp : Blu_BinaryOp<"eq">;
def Blu_NeOp : Blu_BinaryOp<"ne">;
def Blu_LtOp : Blu_BinaryOp<"lt">;
def Blu_LeOp : Blu_BinaryOp<"le">;
def Blu_GtOp : Blu_BinaryOp<"gt">;
def Blu_GeOp : Blu_BinaryOp<"ge">;
// Pointwise with two or more operands (where, gelu_backward, silu_backward, swiglu and its
// backward): `kind` names the graph op.
def Blu_PointwiseOp : Blu_Op<"pointwise", [Pure]> {
  let arguments = (ins StrAttr:$kind, Variadic<AnyRankedTensor>:$inputs);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}

// --- row reductions (over the last dimension) -----------------------------------------------
// layer_norm, rms_norm, softmax, log_softmax, cross_entropy, sum over the last dim and their
// backwards: each row of the last dimension reduces independently; `kind` names the graph op,
// `eps` and the other scalars ride in the attribute dictionary.
def Blu_RowReduceOp : Blu_Op<"row_reduce", [Pure]> {
  let arguments = (ins StrAttr:$kind, Variadic<AnyRankedTensor>:$inputs);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}

// --- the optimizer update -------------------------------------------------------------------
// AdamW over groups of (param, grad, exp_avg, exp_avg_sq[, compute copy]) and, last, the gradient
// norm gate when `gate` >= 0 (ops/optim.cpp): param, the moments and the compute copy are updated
// in place, the gradient and the gate only read. Result i is the i-th updated operand afterwards.
def Blu_AdamWStepOp : Blu_Op<"adamw_step"> {
  let arguments = (ins Arg<Variadic<AnyRankedTensor>, "parameter groups", [MemRead, MemWrite]>:$inputs);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = "`(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}

// Any other in-place op (add_, copy_, fill_, mul_scalar_, …): `updated` lists the operand indices
// written; result i is operand updated[i] after the write.
def Blu_UpdateOp : Blu_Op<"update"> {
  let arguments = (ins StrAttr:$kind, DenseI64ArrayAttr:$updated,
                       Arg<Variadic<AnyType>, "operands", [MemRead, MemWrite]>:$inputs);
  let results = (outs Variadic<AnyType>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` `updated` $updated attr-dict `:` functional-type($inputs, $results)";
  let hasVerifier = 1;
}

// --- views ----------------------------------------------------------------------------------
// view, permute, narrow, expand, split: the result aliases the source's buffer.
def Blu_ViewOp : Blu_Op<"view", [Pure, DeclareOpInterfaceMethods<ViewLikeOpInterface>]> {
  let arguments = (ins StrAttr:$kind, AnyRankedTensor:$source);
  let results = (outs AnyRankedTensor:$out);
  let assemblyFormat = "$kind $source attr-dict `:` type($source) `->` type($out)";
}

// --- random numbers -------------------------------------------------------------------------
// rand, randn, randint, dropout: Philox numbers from (seed, offset), both operands (0-d i64).
def Blu_RandomOp : Blu_Op<"random"> {
  let arguments = (ins StrAttr:$kind, Variadic<AnyRankedTensor>:$inputs,
                       0DTensorOf<[I64]>:$seed, 0DTensorOf<[I64]>:$offset);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` `philox` `(` $seed `,` $offset `)` attr-dict `:` functional-type(operands, $results)";
}

// --- opaque ---------------------------------------------------------------------------------
// Library calls (matmul, linear, flash attention, embedding …): opaque to fusion; they read their
// operands and write fresh results.
def Blu_LibraryCallOp : Blu_Op<"library_call"> {
  let arguments = (ins StrAttr:$kind, Arg<Variadic<AnyType>, "operands", [MemRead]>:$inputs);
  let results = (outs Variadic<AnyType>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}
// Collectives (all_reduce, reduce_scatter, all_gather, broadcast): read and write their operands
// across ranks.
def Blu_CollectiveOp : Blu_Op<"collective"> {
  let arguments = (ins StrAttr:$kind, Arg<Variadic<AnyType>, "buffers", [MemRead, MemWrite]>:$inputs);
  let results = (outs Variadic<AnyType>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}
// Anything else of the op table (factories, cat, scatter, …): opaque, conservatively effectful.
def Blu_OpaqueOp : Blu_Op<"opaque"> {
  let arguments = (ins StrAttr:$kind, Arg<Variadic<AnyType>, "operands", [MemRead]>:$inputs);
  let results = (outs Variadic<AnyType>:$results);
  let assemblyFormat = "$kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $results)";
}
