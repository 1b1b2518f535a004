// compiler/exclude: the per-op opt-out of compilation. BLU_COMPILE_EXCLUDE=gelu,layer_norm (or
// `--compile-exclude`, which sets the same list) names dispatch ops (OpDef names, as the graph's
// dump shows them) that the compiler must leave as they are eagerly:
//   memory plan  a temporary buffer that an excluded op defines or writes is not packed into the
//                arena; it gets its own allocation every step, made right before its first launch
//                and freed right after its last, as eagerly (the plan counts their live peak; the
//                launches that touch one run outside the CUDA graphs);
//   fusion       an excluded op is never part of a fused region (compiler/mlir/ asks op_excluded
//                before it puts an op into a region) and runs its backend kernel alone.
// What the step computes does not change: a compiled step runs the eager kernels either way; the
// opt-out narrows down which op a suspected plan or fusion problem comes from, and keeps an op
// out of the compiler's hands when it must be.
// A name that is no dispatch op at all (no kernel of that name on the CPU or, in a CUDA build, on
// the GPU: every op a captured step holds has one) is a typo, refused with the flag or variable
// and the name; a real op that a step does not have is only logged (compile.cpp: "no op of that
// name in this step").
// Depends on backend/ (the kernel registry) and the standard library. Keep: op_excluded is cheap
// (a short list) and the list is read once per process from the environment unless
// set_excluded_ops replaces it.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace blu::compiler {

// "gelu, layer_norm,,matmul" -> {"gelu", "layer_norm", "matmul"}: comma-separated, blanks trimmed,
// empty entries dropped.
std::vector<std::string> parse_op_list(std::string_view spec);

// parse_op_list(spec), each name checked to be a dispatch op; `source` (the flag, or
// BLU_COMPILE_EXCLUDE) names where the list came from in the error.
std::vector<std::string> checked_op_list(std::string_view spec, std::string_view source);

// The excluded op names: BLU_COMPILE_EXCLUDE's, or the last set_excluded_ops call's.
const std::vector<std::string>& excluded_ops();
void set_excluded_ops(std::vector<std::string> names);

// Whether dispatch op `name` is kept out of compilation (planning and fusion).
bool op_excluded(std::string_view name);

}  // namespace blu::compiler
