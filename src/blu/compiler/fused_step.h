// compiler/fused_step: the fusion pass's regions (compiler/mlir/ fuse(), or a fusion plan read
// from the kernel cache) and the GEMM epilogues (compiler/epilogue.h) made part of the compiled
// step. fuse_step rewrites the captured graph:
// each accepted region's ops become one `fused` op (inputs: the region's inputs, outputs: its
// outputs) placed where the region's last op was; ops between the region's first and last op that
// read a value the region makes move to just after it. The region's intermediate values are then
// touched by no op of the rewritten graph, so the memory plan (compiler/memory_plan.h) gives them
// no bytes and the runtime never binds them. A region is refused (and the refusal counted, with
// its reason) when: its ops have no emitter for the device, an input or output is strided, or the
// rewritten order would reorder two accesses to one buffer of which one writes it (checked per
// buffer over the whole schedule), or its kernel does not compile or load (the message is the
// reason: an emitter gap never stops the step, its ops run their eager kernels).
// The per-step kernel arguments (float attributes such as lr, AdamW's step) are read from each
// step's capture at launch, never baked into a kernel (region_scalars, compiler/codegen/region.h),
// so a kernel is compiled once per region text and a new lr is no recompile.
// Depends on compiler/{graph,runtime}, compiler/codegen/. No MLIR: a build without MLIR replays
// regions read from the cache. Keep: the rewritten graph's values and buffers are the capture's
// (same ids), so each step's capture binds to it unchanged; `source` maps every non-fused op back
// to the op of the capture it runs.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/graph.h"
#include "blu/compiler/runtime.h"

namespace blu::compiler {

// The regions a fusion pass found in a captured step (mlir_api::fuse, or the cached plan).
using FusionFn = std::function<std::vector<FusedRegion>(const Graph&)>;

struct FusedGraph {
  Graph graph;                       // the capture's values and buffers; ops rewritten
  std::vector<int> source;           // per op of graph: the capture's op it runs, -1 for fused ops
  std::vector<FusedRegion> regions;  // the accepted regions; a fused op's Op::region indexes it
  std::vector<FusedLaunch> kernels;  // per accepted region
  size_t kernel_scratch = 0;         // the most workspace bytes one kernel's launch takes
  int capture_ops = 0;               // ops in each step's capture
  // Values and buffers in each step's capture; the graph's further ones are a rewrite's own
  // (compiler/remat.h), bound by the runtime once.
  int capture_values = 0, capture_buffers = 0;
  // Per capture buffer that a rewrite drops across a gap (compiler/remat.h): the capture op that
  // makes it, which can make it again; -1 for the others (empty: none dropped).
  std::vector<int> remade_by;
  int refused = 0;                   // regions not accepted (reasons in `notes`)
  int epilogues = 0;                 // accepted regions that are GEMM epilogues (compiler/epilogue.h)
  std::vector<std::string> notes;
  // "12 regions (58 ops → 12 kernels), 2 refused; kernels: 3 compiled, 9 from the cache"
  std::string summary() const;
  int kernels_compiled = 0, kernels_cached = 0;
};

// The graph unchanged: every op runs as captured.
FusedGraph unfused(const Graph& g);

// How an accepted region's kernel becomes a launch: sets *compiled (made now, not found in the
// cache) and *scratch (workspace bytes a launch takes), or throws with the reason its region is
// refused.
using KernelLoader = std::function<FusedLaunch(const Graph&, const FusedRegion&, bool* compiled, size_t* scratch)>;

// Accepts what it can of `regions` (see the header comment) and loads each accepted region's
// kernel (emitted C++, compiler/codegen/cpu_kernel.h; on a CUDA device emitted CUDA C through
// NVRTC, compiler/codegen/cuda_module.h) from the kernel cache or compiles it into the cache. A
// region with an op its device's emitter does not cover is refused and runs its eager kernels.
// `load` replaces the cache and the compilers (fuzz/fusion_plan.cpp: a plan's regions taken
// through the same acceptance and rewrite without compiling them).
FusedGraph fuse_step(const Graph& g, std::vector<FusedRegion> regions, const KernelLoader& load = {});

// Check mode (BLU_COMPILE_CHECK=1; compiler/codegen/region_check.h) in the compiled step: the
// first time the returned launch runs it copies its inputs, runs `launch`, then runs the region's
// ops eagerly through dispatch on the copies and gives `report` the largest difference over the
// region's outputs and the inputs it updates in place; later runs are `launch` alone. The copies
// and the eager ops allocate, so it must not run while a CUDA graph is recorded (CompiledStep
// replays without graphs in check mode).
struct RegionCheck {
  int region = -1;
  std::string ops;        // the region's op names, in order
  double max_diff = 0;    // max |fused - eager|, NaN when one side has a NaN the other has not
};
FusedLaunch checked_launch(FusedLaunch launch, FusedRegion region, std::function<void(const RegionCheck&)> report);

// The rewritten op order for `accepted` regions of g (an op index, or -(r + 1) for region r), or
// an empty result with the reason in `why` when the order would break a buffer's read/write
// order.
std::vector<int> fused_schedule(const Graph& g, const std::vector<FusedRegion>& accepted, std::string* why);

}  // namespace blu::compiler
