// compiler/epilogue: GEMM epilogues chosen by the compiler (Note [GEMM epilogues]). The pass finds,
// in a captured step, each `linear` whose output only an `add` reads, and makes the pair a region
// that runs as one `linear` with the add as its epilogue: a bias (the add's other operand is a
// vector over the output features, and the linear has none) or a residual (the other operand has
// the output's shape) — cuBLASLt's bias epilogue and its C operand with beta = 1 on the GPU, the
// accumulation's initial value on the CPU. A `linear` with a bias whose output a tanh `gelu` reads
// first becomes one GEMM that writes the GELU and keeps the product for the GELU's gradient
// (cuBLASLt's GELU_AUX_BIAS, 16-bit on the GPU; the two kernels in turn elsewhere). In the
// backward, a GELU's gradient whose whole output a weight gradient with a bias sums next becomes
// one region whose GELU kernel also takes that column sum (Note [Bias gradient in the GELU's]).
// compiler/fused_step.h puts the regions into the step beside the fusion pass's generated kernels.
// Depends on compiler/{graph,runtime,exclude}, compiler/codegen/region.h, backend/. Keep: the
// region runs the backend's own kernels (no generated code); an add fold's only output is the
// add's and the linear's output gets no bytes; a GELU fold's outputs are the GELU's and the
// product; a bias-gradient fold is bitwise the two ops it replaces.
#pragma once
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/graph.h"
#include "blu/compiler/runtime.h"

namespace blu::compiler {

// Note [GEMM epilogues]
// A model written plainly — `x + proj(y)`, `matmul`-free `linear(x, w) + b` — pays for the add as
// a separate pass over the output: the linear writes y, the add reads it back with the other
// operand and writes the sum. Folded into the GEMM, the other operand is read once by the GEMM's
// epilogue and y never exists: one kernel and two passes over [rows, out] less, and y's bytes are
// not planned at all. Only the forward changes: add's backward passes its gradient through, and
// linear's backward reads x and w, never y. The arithmetic differs from eager in its order only
// (the residual is the GEMM's initial value instead of a sum after the rounding of y), so compiled
// and eager agree within rounding, not bitwise, where a fold happens. GPT-2 and the Llama family
// pass their skip connections to the projections by hand (nn::Linear's residual), which eager
// mode needs for its speed; the pass makes the same GEMM for any model. `--compile-exclude
// linear` or `add` keeps the pair as it is.
// The GELU after a linear is the third epilogue cuBLASLt offers: in training the product is still
// needed (GELU's gradient reads it), so the fold saves one read of it and a launch, not its bytes.
// In 16 bits the GELU is computed from the fp32 sum before the rounding, so it agrees with eager
// within rounding; on the CPU and in fp32 it runs eager's two kernels and is bitwise.
// `--compile-exclude gelu` keeps them apart.

// Note [Bias gradient in the GELU's]
// In GPT-2's MLP backward, gelu_and_backward writes gu = dL/du ([rows, 4C]) and c_fc's weight
// gradient then reads all of it twice: once in its GEMM, once more for the bias gradient's column
// sum (100 MB a layer at B=16, T=1024, bf16). The region {gelu_and_backward, views of gu, the
// weight gradient} runs the GELU kernel with the bias gradient as a third output, summed as the
// kernel writes gu in the partition and order of the weight-gradient kernel's own column sum
// (backend/cuda/colsum.cuh), then the weight gradient without its bias: the same bits, one read of
// gu fewer. Only on the GPU in 16 bits or fp32 with rows of whole 16-byte vectors; elsewhere the
// region runs the two kernels as captured. Alone the fused kernel runs about as fast as the two
// apart (H200: 142.7 against 140.4 µs a layer in one trace, 124.8 against 145.0 in another); the
// step gains from the bytes it does not move (docs/performance.md). `--compile-exclude
// gelu_and_backward` or `linear_weight_grad_into` keeps them apart.

// Regions of kind gemm_epilogue: {linear, the views of its output, add}; inputs x, w, the bias (the
// linear's or the add's), the residual when there is one; output the add's. Or {linear, views,
// gelu}: inputs x, w, the bias; outputs the GELU's and the whole product. Or {gelu_and_backward,
// views, linear_weight_grad[_into]}: the weight gradient's and the GELU's outputs.
std::vector<FusedRegion> epilogue_regions(const Graph& g);

// The region's launch: the backend's `linear` kernel on the region's device with the bias and the
// residual in their slots, the add's output as the linear's [rows, out] output.
FusedLaunch epilogue_launch(const Graph& g, const FusedRegion& r);

}  // namespace blu::compiler
