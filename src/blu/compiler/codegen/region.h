// compiler/codegen/region: a fused region — a set of ops of the captured step (compiler/graph.h)
// that runs as one kernel — and its canonical text, the key of the kernel cache.
// The fusion pass (compiler/mlir/fusion.cpp) makes regions; the emitters (emit_cpu, emit_cuda)
// turn one into source; the runtime replaces the region's ops by one launch.
// Depends on compiler/graph.h only (no MLIR: a build without MLIR reads regions from the cache's
// plan and still computes the same keys). Keep: inputs are the values the region reads that it
// does not define, outputs the values it defines that something outside it (a later op or the
// step's outputs) reads; ops are in schedule order; region_text() is the same on every machine
// for the same region (no pointers, no ids that depend on the capture's numbering beyond the
// region itself).
#pragma once
#include <string>
#include <vector>

#include "blu/compiler/graph.h"

namespace blu::compiler {

// The shape of the region's iteration: every op pointwise over one shape, or rows of the last
// dimension (at least one row reduction: layer/RMS norm, softmax, cross-entropy, AdamW is
// pointwise).
enum class RegionShape : uint8_t { pointwise, rows };

// How a region runs: one kernel generated from its ops (the fusion pass's regions), or a library
// GEMM with the region's add as its epilogue (compiler/epilogue.h).
enum class RegionKind : uint8_t { generated, gemm_epilogue };

struct FusedRegion {
  int index = -1;
  RegionKind kind = RegionKind::generated;
  RegionShape shape = RegionShape::pointwise;
  std::vector<int> ops;      // op indices into Graph::ops, schedule order
  std::vector<int> inputs;   // value ids read from outside the region
  std::vector<int> outputs;  // value ids defined inside and read outside
  double bytes_saved = 0;    // the cost model's estimate: intermediate bytes not written and re-read
};

// How the compiler sees an op of the op table (by its OpDef name): which blu op it becomes and
// whether a region may hold it. unary/binary/pointwise/row/adamw are fusible; library ops (GEMMs,
// attention, embedding) and everything else are not.
enum class OpClass : uint8_t { unary, binary, pointwise, row, adamw, library, other };
OpClass op_class(const std::string& name);
inline bool is_fusible_op(const std::string& name) { return op_class(name) <= OpClass::adamw; }

// The region's canonical text: its ops with attributes, shapes, dtypes and wiring, values
// renumbered in order of appearance (in0.., t0..). Equal texts compute the same function.
std::string region_text(const Graph& g, const FusedRegion& r);

// The region's per-step kernel arguments, in order: every float attribute of its ops and every int
// attribute named step (AdamW's count) — the attributes Graph::structure_hash leaves out, so a new
// lr reuses the kernel. region_text prints them as `name=?`; a kernel reads them from an array.
bool is_step_scalar(std::string_view name, const AttrValue& v);
std::vector<double> region_scalars(const Graph& g, const FusedRegion& r);
// The slot of op `oi`'s attribute `name` in region_scalars (BLU_CHECK: it is one).
int region_scalar_slot(const Graph& g, const FusedRegion& r, int oi, std::string_view name);

// Fills inputs/outputs from ops (reads not defined inside; definitions read outside or graph
// outputs).
void compute_region_io(const Graph& g, FusedRegion& r);

// A region kernel's operand pointers: the inputs, then the outputs. BLU_CHECK: each is contiguous.
std::vector<void*> region_operand_pointers(const std::vector<Tensor>& ins, const std::vector<Tensor>& outs);

}  // namespace blu::compiler
