// compiler/codegen/emit_common: what the CPU and CUDA emitters (cpu_kernel, cuda_kernel) share —
// which ops each region shape can hold, a region's iteration space and the broadcast index map.
// Depends on compiler/codegen/region.h. Keep: both emitters ask the same predicates, so an op
// the CUDA emitter leaves out is the only difference between the devices' regions.
#pragma once
#include <string>

#include "blu/compiler/codegen/region.h"

namespace blu::compiler {

bool is_float_dtype(DType t);
// eq, ne, lt, le, gt, ge: two operands of one float dtype, a bool out (compared in the
// accumulation type, as the eager kernels compare).
bool is_comparison(const std::string& name);
// A comparison's expression on two operand expressions of one type, in C++ and CUDA C alike.
std::string comparison_expr(const std::string& name, const std::string& a, const std::string& b);
// clamp_backward's expression: g where lo <= x <= hi (bounds included, as the eager kernels), else
// zero of type A; the same text in C++ and CUDA C.
std::string clamp_backward_expr(const std::string& g, const std::string& x, const std::string& lo,
                                const std::string& hi, const std::string& A);
// Pointwise ops with an emitter (one or more outputs, each element on its own).
bool emit_pointwise_supported(const Op& op);
// Whether the emitters take op's operand dtypes in region r: float values, plus a cross-entropy's
// integer target, a bool condition of where, and the bool out of a comparison in a pointwise
// region (a rows region's arrays and vectors are of float values).
bool emit_dtypes_supported(const Graph& g, const FusedRegion& r, const Op& op);
// Whether the emitters take op's layout in region r: the (log-)softmaxes over the last dim only,
// the two-output gradient ops (swiglu_backward, gelu_and_backward) in pointwise regions only.
bool emit_layout_supported(const Graph& g, const FusedRegion& r, const Op& op);
// Row ops (reductions over the last dimension) with an emitter.
bool emit_row_supported(const Op& op);
// An adamw_step both generators emit: one ungated parameter group of contiguous tensors (parameter,
// gradient, two f32 moments, and the 16-bit copy when `copies`) in a pointwise region.
bool emit_adamw_supported(const Graph& g, const FusedRegion& r, const Op& op);
// Whether a rows region's pointwise values each fit its row loop: a row (a value of the whole
// space) or one scalar. A value of another size made in the region (one per row: the [rows]
// gradient of cross_entropy(reduction none)) has no place in it. Pointwise regions: true.
bool rows_region_values_fit(const Graph& g, const FusedRegion& r);
// The region's iteration space: the largest value its ops read or write (rows: the row op's input).
Shape region_space(const Graph& g, const FusedRegion& r);
// The element index of value v at linear index `i` of `space` (v broadcast to it by NumPy rules):
// `i` when v covers the space, else a sum of (i / inner) % size * stride terms.
std::string index_expr(const Value& v, const Shape& space, const std::string& i);

}  // namespace blu::compiler
