// compiler/memory_plan: the static memory plan of a captured step. The graph's op order is the
// schedule; a buffer the step makes and drops (BufferKind::temporary) is live from the op that
// first defines a value on it to the last op that reads or writes any value on it — views and
// in-place updates share their buffer, so they extend one interval instead of making another.
// Temporaries are placed best-fit-decreasing into one arena per device: largest first, each at
// the smallest gap (aligned) that no buffer live at the same time occupies, else after them.
// Buffers that live across steps — parameters, gradients, optimizer state, step inputs,
// constants — are placed once, where they already are, and counted as held bytes; step outputs
// (read after the step: the loss, gradients kept as .grad) get their own allocation per step, so
// nothing read after the step ever sits in bytes the next step reuses. A temporary that an op named
// in PlanOptions::exclude defines or writes (compiler/exclude.h) is left out of the arena too: it
// gets its own allocation per step and is freed after its last use, as eagerly (releases_after;
// one that a collective touches is held until the step ends, as the collective may still read it).
// Depends on compiler/graph. Keep: two temporaries whose intervals overlap never overlap in the
// arena (check_plan verifies it; the runtime's poison mode shows it end to end).
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "blu/compiler/graph.h"

namespace blu::compiler {

struct PlanOptions {
  size_t alignment = 256;
  // Debug only: a deliberately broken plan — the first two floating-point temporaries that are
  // live at the same time (the largest first) get the same offset, so that the poison test can
  // show a replay that does not match eager.
  bool debug_overlap = false;
  // Op names whose temporaries stay out of the arena (compiler/exclude.h; CompiledStep fills it
  // from excluded_ops()).
  std::vector<std::string> exclude;
};

struct Placement {
  bool in_arena = false;  // temporaries
  int arena = -1;         // index into MemoryPlan::arenas
  size_t offset = 0, nbytes = 0;
  int first = -1, last = -1;  // live interval in op indices (inclusive)
};

struct Arena {
  Device device;
  size_t bytes = 0;
};

struct MemoryPlan {
  std::vector<Placement> placements;     // per buffer id
  std::vector<Arena> arenas;             // one per device with temporaries
  std::vector<std::vector<int>> frees_after;  // per op: the temporaries whose last use it is
  // Per op: the excluded temporaries whose last use it is (the runtime frees them after it).
  std::vector<std::vector<int>> releases_after;
  size_t peak_live_bytes = 0;   // the most temporary bytes live at one op (a lower bound for the arena)
  int peak_op = -1;             // the first op at which that many temporary bytes are live
  size_t held_bytes = 0;        // placed once: parameters, gradients, state, inputs, constants
  size_t output_bytes = 0;      // step outputs, allocated per step
  size_t excluded_bytes = 0;    // the most excluded temporary bytes live at one op (each is
                                // allocated before its first use and freed after its last)
  int arena_buffers = 0, excluded_buffers = 0;
  size_t arena_bytes() const;
  // What the step holds at its peak: the arenas, the held buffers, the step outputs and the
  // excluded temporaries at their peak.
  size_t peak_bytes() const { return arena_bytes() + held_bytes + output_bytes + excluded_bytes; }
  // "peak 1.2 MiB (arena 800 KiB for 212 buffers, live peak 790 KiB; held 400 KiB; outputs 8 B)"
  std::string summary() const;
};

MemoryPlan plan_memory(const Graph& g, const PlanOptions& options = {});

// What the arena holds at one op (the live peak by default), for the compile log: the live
// temporaries split into gradients (read at or after that op, with a parameter's shape, by an op
// that writes that parameter in place: the optimizer's update) and the rest grouped by the name of the op that defined them.
struct LiveGroup {
  std::string name;  // "gradients", or the defining op's name
  size_t bytes = 0;
  int buffers = 0;
};
struct LiveSite {
  int op = -1;
  size_t bytes = 0;              // all live temporaries in the arena at `op`
  LiveGroup gradients{"gradients"};
  std::vector<LiveGroup> rest;   // largest first
  // "at op 1502 of 2973 (matmul): gradients 612.0 MiB (84 buffers); matmul 301.0 MiB (40); …"
  std::string describe(const Graph& g) const;
};
LiveSite live_site(const Graph& g, const MemoryPlan& plan, int op = -1);

// "" when no two temporaries that are live at the same op overlap in an arena; otherwise a
// description of the first pair that does.
std::string check_plan(const Graph& g, const MemoryPlan& plan);

std::string format_bytes(size_t bytes);  // "1.5 MiB"

}  // namespace blu::compiler
