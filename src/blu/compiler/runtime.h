// compiler/runtime: replays a captured step as a flat list of launches over its memory plan.
// A Runtime is made once per compiled variant: it allocates the plan's arenas and turns the
// graph into a launch list — per op, what runs: a backend kernel (resolved once), an opaque
// collective, or a fused region (compiler/mlir/ plugs its generated kernels in as that kind of
// launch) — views run nothing. Each step's capture (same structure, this step's tensors and
// per-step scalars such as lr, the AdamW step count, Philox offsets) is then bound to the arena:
// every temporary storage the capture made is given its planned bytes, every step output a fresh
// allocation, and the launches run in capture order with the capture's own attributes.
// On CUDA the launch list is replayed through CUDA graphs on the context's stream (Note [Graph
// segments]): launches whose attributes change from step to step (AdamW's lr and step count) run
// directly, and each run of launches between them is one recorded graph, replayed unchanged while
// its addresses and attributes are those it was recorded with.
//
// Note [Graph segments]
// A CUDA graph bakes in every kernel argument. The arena's addresses are fixed, but some launches
// take per-step host scalars as arguments, and one such launch in a whole-step graph would make
// every step record the whole graph again (and update the executable in place) before it can
// launch — a host cost the GPU waits through. So the runtime hashes each launch's arguments
// (bound addresses, attributes) every step; a launch whose attributes differ from the previous
// step's becomes direct for good (it runs on the stream as an eager kernel would), and the
// launches between direct ones form segments, each recorded as its own graph. A segment whose
// addresses changed (a step output allocated elsewhere) is recorded again; its two most recent
// executables are kept, so outputs that alternate between two places record nothing after the
// second time. The order of launches on the stream is the capture's, so results stay bitwise.
// A temporary the plan left out of the arena (an excluded op's, compiler/exclude.h) is allocated
// right before its first launch and freed right after its last (MemoryPlan::releases_after), as
// eagerly; every launch that touches one runs directly, since a recording cannot allocate.
//
// Note [Speculative start]
// A streamed step (Note [Streamed replay], compile.h) issues a segment once the capture has
// recorded and checked its ops, so the GPU, idle after the previous step's loss was read, waits
// for the capture's set-up and its first ops before any kernel runs, and again while the first
// short segments are captured. The step's first segments are launched before the capture instead
// when running them twice cannot change anything but the arena: every launch in them writes only
// arena temporaries (never a parameter, state, a step input or output), reads nothing on the host,
// and reads outside the arena only buffers whose storages still hold the bytes the recording
// baked in — the step's inputs, found by their position in run()'s list, and what lives across
// steps, held weakly — checked in begin before anything is launched. Every temporary they read is
// written earlier in the same prefix, so the prefix computes the same bytes whenever it runs from
// its start. As the capture reaches each launched segment, advance confirms it: the same
// recording (the same addresses and per-step attributes) skips the launch; any other one is a
// miss, and the confirmed segments are launched again before the segment is issued as usual, so
// the stream holds a correct prefix after the speculative one. A step that leaves the compiled
// structure before every launched segment is confirmed runs whole and unplanned (salvage), the
// arena's bytes being all the prefix wrote. end picks the next step's prefix: the leading
// segments, each recorded and replayed this step, whose launches all qualify.
// Depends on compiler/{graph,capture,memory_plan}, backend/, memory/. Keep: the arena is never
// reallocated while the Runtime lives; a launch never allocates (outputs are bound before it).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/codegen/region.h"
#include "blu/compiler/memory_plan.h"

namespace blu::compiler {

// A fused region's launch (compiler/fused_step.h): inputs and outputs bound, the context's stream;
// `step` is this step's capture, whose ops carry the per-step kernel arguments (lr, step counts).
using FusedLaunch = std::function<void(const Graph& step, std::span<const Tensor> in, std::span<Tensor> out,
                                       const ExecContext& ctx)>;
struct FusedGraph;

struct Launch {
  OpKind kind = OpKind::kernel;
  int op = -1;              // index in the runtime's graph (the memory plan's schedule)
  int source = -1;          // kernel and collective launches: the op of each step's capture it runs
  std::vector<int> inputs, outputs;  // the value ids it binds (a fused launch: its region's)
  Kernel kernel = nullptr;  // kernel launches
  Device device;            // where the kernel runs
  FusedLaunch fused;        // fused launches
  std::vector<int> attr_ops;  // ops of each step's capture whose attributes it reads
};

struct RuntimeOptions {
  // Fill each temporary's arena bytes with 0xFF (a NaN in every float dtype) right after its last
  // use: a plan that let two live buffers share bytes then changes the step's results.
  bool poison_freed = false;
  bool cuda_graph = true;  // CUDA: replay through a CUDA graph (CPU ignores it)
  // CUDA graphs, streamed: launch the step's first segments before its capture (Note [Speculative
  // start]); BLU_COMPILE_SPECULATE=0 turns it off.
  bool speculate = true;
};

struct RuntimeStats {
  int64_t steps = 0;
  int64_t launches = 0;          // launch-list entries run (or recorded, on CUDA)
  int64_t graph_captures = 0;    // CUDA: segments recorded (Note [Graph segments])
  int64_t graph_launches = 0;    // CUDA: cudaGraphLaunch calls
  int64_t memsets_lowered = 0;   // CUDA: small memset nodes recorded as kernel nodes (backend/cuda/graph_memset.h)
  int64_t direct_launches = 0;   // CUDA: launches run outside a graph (their attributes change)
  int64_t steps_recorded = 0;    // CUDA: steps that recorded a segment
  int64_t segments = 0;          // CUDA: graphs a step launches now
  int64_t remade = 0;            // salvage: buffers a rewrite had dropped, made again (compiler/remat.h)
  int64_t released = 0;          // excluded temporaries freed right after their last launch
  int64_t speculated_steps = 0;  // CUDA: steps that launched their first segments before capture
  int64_t speculated_segments = 0;  // CUDA: segments so launched, all steps
  int64_t speculation_misses = 0;   // CUDA: steps whose capture did not confirm them (run again)
};

class Runtime {
 public:
  Runtime(const Graph& graph, MemoryPlan plan, RuntimeOptions options = {});
  // A graph rewritten by fusion (compiler/fused_step.h); `plan` is the plan of fused.graph.
  Runtime(FusedGraph fused, MemoryPlan plan, RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Binds a capture with this runtime's structure to the arena and runs it (`inputs`: begin's).
  void run(Capture& step, std::span<const Tensor> inputs = {});
  // Note [Streamed replay] (compiler/compile.h): the same in three calls while the step is being
  // captured. begin before the step's capture starts, with the step's inputs (Note [Speculative
  // start]: it may launch the step's first segments then); advance each time the capture has recorded
  // (and the caller checked against this structure) its first `captured_ops` ops — it issues every
  // segment whose ops are all among them; after the capture's finish, end when the structure is
  // this one (it issues the rest), or salvage when it is not (the ops not yet run run unplanned;
  // an error when a value they need was overwritten in the arena already).
  void begin(std::span<const Tensor> inputs = {});
  void advance(Capture& step, size_t captured_ops);
  void end(Capture& step);
  void salvage(Capture& step);
  size_t issued() const;  // launches issued in the step under way
  // Note [Speculative start]: segments launched before this step's capture are not all confirmed
  // yet (a salvage then runs the whole step unplanned).
  bool unconfirmed() const;
  // Runs a capture of any structure with a fresh allocation per buffer, kernels in capture order:
  // exactly the eager step's kernels (the fallback when a guard fails after capture).
  static void run_unplanned(Capture& step);

  const MemoryPlan& plan() const { return plan_; }
  const Graph& graph() const { return graph_; }  // the graph the plan is of (rewritten by passes)
  const std::vector<Launch>& launches() const { return launches_; }
  const RuntimeStats& stats() const { return stats_; }
  // Note [Speculative start]: the prefix the next step may launch before its capture, and where
  // and why it ends ("" while none is planned).
  struct Speculation {
    size_t segments = 0, launches = 0;
    std::string stop;
    bool operator==(const Speculation&) const = default;
  };
  Speculation speculation() const;

 private:
  static std::vector<Launch> build_launches(const Graph& g, const std::vector<int>* source = nullptr,
                                            const std::vector<FusedLaunch>* kernels = nullptr,
                                            const std::vector<FusedRegion>* regions = nullptr);
  // Runs `launches`; value v is tensors[v], or extra[v - base] for v >= base (a rewrite's own values).
  static void execute(const Graph& g, const std::vector<Tensor>& tensors, const std::vector<Tensor>& extra,
                      size_t base, std::span<const Launch> launches, const std::function<void(size_t op)>& after_op);
  void bind(Capture& step, int value);
  void bind_rewrite_values();
  void set_needs();
  void set_releases();
  void poison(size_t op);
  void plan_speculation(Capture& step);

  Graph graph_;  // the structure compiled (its tensors' bindings come from each step's capture)
  int capture_ops_ = 0;  // ops in each step's capture (graph_ has fewer when regions are fused)
  size_t capture_values_ = 0, capture_buffers_ = 0;  // graph_'s further ones are a rewrite's (remat.h)
  std::vector<Tensor> extra_;  // per value id >= capture_values_: bound to the arena once
  std::vector<int> remade_by_;  // FusedGraph::remade_by (salvage makes a dropped buffer again)
  MemoryPlan plan_;
  RuntimeOptions options_;
  std::vector<DataPtr> arenas_;  // per plan arena
  std::vector<Launch> launches_;
  size_t fused_scratch_ = 0;  // FusedGraph::kernel_scratch: reserved before a CUDA graph is recorded
  RuntimeStats stats_;
  std::vector<size_t> need_;  // per launch: the last op of each step's capture it runs
  std::vector<std::vector<int>> release_after_;  // per launch: the excluded temporaries freed after it
  std::vector<char> unplanned_;  // per launch: touches an excluded temporary (runs directly)
  struct Replay;
  std::unique_ptr<Replay> replay_;
};

}  // namespace blu::compiler
