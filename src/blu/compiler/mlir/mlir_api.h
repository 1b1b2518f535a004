// compiler/mlir/mlir_api: the narrow door to the MLIR half of the compiler. Everything MLIR —
// the `blu` dialect (blu_ops.td), the translation from the captured graph, the fusion pass —
// lives in the internal library
// blutrain_mlir behind these functions, which take and return our own types only.
// Depends on compiler/graph.h, compiler/codegen/region.h. Keep: no MLIR or LLVM header here or in
// any file outside compiler/mlir/ (the GPU machine builds without MLIR); every failure is a
// blu::Error with MLIR's diagnostic text in it.
#pragma once
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/graph.h"

namespace blu::compiler::mlir_api {

// The captured step as a `blu` module: one func.func @step whose arguments are the graph inputs
// (attribute blu.vid) and the Philox seed/offset of each random op, one blu op per graph op
// (attributes blu.oid, blu.vids). Verified before it is returned.
std::string to_blu(const Graph& g);

// Parses a module (blu, func, linalg, arith, math, tensor), verifies it and prints it back.
// Throws blu::Error with the diagnostics when it does not parse or verify.
std::string round_trip(const std::string& text);

struct FusionOptions {
  std::vector<std::string> no_fuse;  // op names kept out of every region (the per-op opt-out)
  // A region is kept only when the intermediate bytes it saves exceed this many bytes.
  double min_bytes_saved = 1;
};

// The fusion pass on the graph's blu module: groups of fusible ops, never across a library call
// or collective, each with inputs/outputs in graph value ids. Greedy in schedule order: an op joins
// the region of the producer whose edge saves the most bytes (the intermediate's write and re-read)
// when its iteration space matches (same element count; rows of the same length for row
// reductions), joining makes no cycle through an op outside the region, and no library call or
// collective between the region's ops reads what the region makes (it would wait for the region,
// which runs at its last op, and the buffers live across it with it). No op is duplicated, so
// nothing is recomputed. Regions of one op are not returned (nothing saved).
std::vector<FusedRegion> fuse(const Graph& g, const FusionOptions& opt = {});

}  // namespace blu::compiler::mlir_api
