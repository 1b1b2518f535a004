// compiler/codegen/cuda_kernel: a fused region as CUDA C — the emitter, and the launch shape the
// emitted code expects (cuda_module.h compiles it with NVRTC, loads it and launches it).
// The emitted source includes no header (its own bf16/f16 conversions in PTX, its own integer
// types), so NVRTC needs no include path and a cold compile is a fraction of a second.
// Kernel shapes:
//   pointwise  a grid-stride loop; when every full-size operand is 16-byte aligned and the element
//              count divides into vectors, 16-byte loads and stores (V elements of the narrowest
//              operand per iteration, as backend/cuda/loops.cuh's contiguous path); broadcast
//              operands are read through their index map;
//   rows       a group of TPR threads per row of the last dimension: one warp (4 rows to a
//              block) while each thread then holds at most 8 vectors, else a block of up to 1024.
//              Thread t of a group owns the row's vectors t, t + TPR, … (V elements each, 16 bytes
//              of the narrowest row operand) in every op, so a row intermediate lives in its
//              registers; the row's float inputs are read as 16-byte vectors at the row's start
//              (a norm weight once, before the rows), outputs written as vectors (element-wise
//              when an operand is not 16-byte aligned); only reductions communicate (warp
//              shuffles; for a block, one shared slot per warp);
//   rows with column sums (a norm backward's weight and bias gradients): G = min(ceil(R / rows
//              per block), 1024) blocks; group g of block b runs rows b·RPB + g, then every G·RPB
//              with the same per-row code, adding each element's terms into its group's shared
//              sums (a thread alone touches its addresses); the block adds its groups' sums in
//              group order into its partial row in the call's workspace, and a second kernel adds
//              the G partial rows of each column in block order (in double) — the same order on
//              every GPU and every run. The groups' sums must fit 40 KiB of shared memory
//              (else the region is not emitted).
// Arithmetic: 16-bit floats compute in float and round to their dtype where eager stores them (each
// op's result), NaN encoded as the CPU encodes it; compiled with --fmad=false, so no multiply-add
// is contracted — the eager kernels keep contraction out of their multi-step formulas with __f*_rn;
// GELU on 16-bit outputs takes tanh from the same fast formula as eager (elementwise.cu); row
// statistics (norm mean/variance, softmax and cross-entropy sums) accumulate in double over a
// fixed tree, which is not eager's order (a stated tolerance, tests/cuda/codegen_cuda_test.cpp).
// Covered: every pointwise op of emit_common, AdamW (with its copies), layer/RMS norm forward and
// backward, softmax (+backward), cross-entropy with reduction none (+backward, none or sum). Not
// covered (the region runs its eager kernels): cross-entropy with reduction mean.
// Depends on compiler/codegen/{region,emit_common}.h only: it builds everywhere, CUDA or not.
// Keep: region inputs and outputs are contiguous (fused_step refuses strided ones).
#pragma once
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"

namespace blu::compiler {

// Whether every op of the region has a CUDA emitter.
bool cuda_emitter_supports(const Graph& g, const FusedRegion& r);
// The region's kernel, `extern "C" __global__ void blu_region(Args)` (and, with column sums,
// `blu_region_columns(Args)`), as CUDA C.
std::string emit_cuda_source(const Graph& g, const FusedRegion& r);

// How the emitted kernel is launched: its Args struct is the operand pointers (inputs, then
// outputs), `scalars` doubles (at least one slot), the vector flag and the column partials.
struct CudaLaunchShape {
  bool rows = false;       // a rows kernel (a group of threads per row) rather than a grid-stride loop
  int64_t work = 0;        // elements (pointwise) or rows
  int vector = 1;          // elements per vector access
  int64_t grid = 1;        // blocks of a rows kernel (a pointwise grid is sized at launch by the SMs)
  int threads = 256;       // threads per block
  int64_t row_len = 1;     // C (rows)
  int sums = 0;            // column sums: a second kernel, blu_region_columns, adds their partials
  size_t scratch = 0;      // workspace bytes a launch takes (the column partials)
  int scalars = 0;         // per-step scalars (region_scalars)
  std::vector<int> full;   // operand slots accessed as vectors (when every one is 16-byte aligned)
};
CudaLaunchShape cuda_launch_shape(const Graph& g, const FusedRegion& r);

}  // namespace blu::compiler
