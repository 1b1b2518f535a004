// compiler/remat: the compiler's own save-or-recompute decision on the captured joint
// forward/backward step. A buffer saved by the forward for the backward is dropped after its last
// forward use and made again, by running its producing op once more, just before its first
// backward use — when that op is cheap (pointwise, a normalisation, a cast, an embedding gather:
// never a GEMM, attention, a collective, or an op that draws random numbers) and every input it
// reads is held at that point anyway. Recomputing it then adds no bytes beside the op's other
// outputs for an instant, and removes the buffer from every op in between.
//
// Note [Recompute where it is free]
// Inductor's partitioner chooses the saved set by a min-cut over the joint graph, with the
// recompute of cheap ops allowed and their inputs' lifetimes charged. The pass here is the part
// of that cut that never extends another buffer's life: a buffer qualifies only when each input of
// its producer is live (in the current plan) at the insertion point and not written in place
// between, and the inputs of a chosen producer are pinned (never themselves dropped), so decisions
// never chain. It is greedy over the live-bytes profile, as XLA's heap simulator reasons: at the
// op where the most temporary bytes are live, take the qualifying buffer whose gap covers that op
// with the most bytes, update the profile, and repeat until no buffer covers the peak (or the
// peak is at most RematOptions::target_bytes). The cost is one memory-bound op per choice; the
// kernel and its inputs are the same, so the step's results are bitwise the eager ones.
// The rewrite keeps the capture's values and buffers (same ids) and appends: each recompute op's
// outputs are new values on new temporary buffers, and every op from the insertion point on that
// touched the dropped buffer reads the new one instead (a view of it made before the gap becomes
// an `alias` view op of the new buffer, right after the recompute op). The runtime binds the new
// values to the arena once (compiler/runtime.h).
// Depends on compiler/{graph,fused_step}. Keep: only appends values and buffers; an op of the
// capture keeps its `source`; a recompute op's `source` is its producer's, so it reads that op's
// per-step attributes.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "blu/compiler/fused_step.h"

namespace blu::compiler {

// The ops the pass may run twice (by dispatch name): memory-bound and deterministic.
const std::vector<std::string>& remat_ops();

struct RematOptions {
  std::vector<std::string> ops;      // empty: remat_ops()
  std::vector<std::string> exclude;  // never recomputed (compiler/exclude.h's list)
  size_t target_bytes = 0;           // stop once the live peak is at most this; 0: as low as it goes
};

struct RematChoice {
  int buffer = -1;   // the saved buffer, dropped across its gap
  int op = -1;       // its producer, run again (index in the graph before the rewrite)
  int before = -1;   // the recompute runs just before this op (same indexing)
  size_t bytes = 0;  // the buffer's bytes
  std::string name;  // the producer's op name
};

struct RematResult {
  std::vector<RematChoice> choices;
  size_t peak_before = 0, peak_after = 0;  // the most temporary bytes live at one op
  size_t written_bytes = 0;                // what the recompute ops write per step
  // "24 buffers recomputed (layer_norm 24; 72.0 MiB), live peak 96.0 MiB → 24.0 MiB; recompute
  // writes 73.1 MiB per step"
  std::string summary() const;
};

// Decides and rewrites f.graph in place (see the header comment); f.source gains the recompute
// ops' producers.
RematResult rematerialize(FusedGraph& f, const RematOptions& options = {});

}  // namespace blu::compiler
