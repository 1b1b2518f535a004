// compiler/compile: the compiled training step as its user drives it — guard, variants, capture,
// plan and replay put together. run(inputs, step) runs `step` (the host logic of one training
// step, e.g. a Strategy::step call) in one of three ways:
//   eager    the first step (the optimizer creates its state; the allocator and workspace warm
//            up), and any step whose guard fails before capture: the step runs as written;
//   compiled the guard key (every step input's shape, dtype, strides and device, and the
//            caller's configuration string) names a variant: the step is captured (host logic
//            only, no kernels), its structure is checked against the variant's graph, and the
//            runtime replays it on the variant's arena;
//   fallback the capture's structure differs from the variant's (the guard fails after capture):
//            the reason is logged and the captured kernels run unplanned, one allocation per
//            buffer, in eager order — the same kernels as the eager step.
// A new key compiles a new variant (a log line) up to max_variants; past that every step of an
// unknown key runs eager, each with a log line: never a silent recompile loop.
// BLU_COMPILE_LOG=1 (or CompileOptions::log) prints each variant's graph size, memory plan (peak,
// arena size, number of buffers) and compile time (capture, plan and runtime set-up) before its
// first compiled step, the excluded ops (compiler/exclude.h) it holds, and every guard failure.
// With CompileOptions::remat the variant's graph goes through the save-or-recompute pass
// (compiler/remat.h) after fusion and before the memory plan.
// Depends on compiler/{capture,graph,fused_step,remat,memory_plan,runtime}. Keep: a compiled step
// has the eager step's kernels in the eager step's order (a recomputed buffer's producer runs a
// second time on the same inputs), so its results are bitwise the eager ones.
//
// Note [Streamed replay]
// Capturing a step runs its host logic (5–10 ms for GPT-2 or Llama on a GPU), and a replay that
// starts only after the capture has finished leaves the GPU idle that long every step. Once a
// variant has replayed a whole step, its later steps stream: each op the capture records is checked
// at once against the variant's graph (what structure_hash covers: buffers, values, op names,
// wiring, effects and the attributes compiled into kernels), and every segment of launches whose
// ops are all recorded and checked is issued right away (Note [Graph segments], runtime.h), so the
// GPU runs the start of the step while its end is still being captured, as an eager step's kernels
// run while its host code goes on. The structure is compared once more after the capture's
// finish (which decides the step outputs); if the step left the variant's structure (at an op, or
// at the finish), what has run stays, the rest runs unplanned, and a value it needs that the
// arena has already reused is an error (it does not happen when only the end of a step differs,
// as when an optimizer creates state). BLU_COMPILE_STREAM=0 (CompileOptions::stream) turns it off.
#pragma once
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/fused_step.h"
#include "blu/compiler/runtime.h"

namespace blu::compiler {

struct CompileOptions {
  int max_variants = 4;
  bool stream = true;  // Note [Streamed replay]; BLU_COMPILE_STREAM=0 turns it off
  int warmup_steps = 1;       // eager steps before the first capture
  bool log = false;           // also on when BLU_COMPILE_LOG is set to a value other than 0
  std::ostream* log_stream = nullptr;  // null: std::cerr
  // Part of the guard key: everything besides the inputs that decides the step's graph
  // (precision, micro-batches, layout). A change is a new variant.
  std::string config;
  PlanOptions plan;  // plan.exclude empty: compiler::excluded_ops() (BLU_COMPILE_EXCLUDE)
  RuntimeOptions runtime;
  // The fusion pass (compiler/fused_step.h): given the captured graph, the regions to run fused
  // (mlir_api::fuse where MLIR is built, or the fusion plan read from the kernel cache). Null: no
  // fusion, every op runs its eager kernel.
  std::function<std::vector<FusedRegion>(const Graph&)> fusion;
  // The save-or-recompute pass (compiler/remat.h, Note [Recompute where it is free]): saved buffers
  // made again by their cheap producer where that costs no other buffer's life.
  bool remat = false;
  // GEMM epilogues chosen by the compiler (compiler/epilogue.h, Note [GEMM epilogues]): a linear
  // and the add that alone reads it run as one GEMM with a bias or residual epilogue.
  bool epilogues = true;
  // Check mode (also on when BLU_COMPILE_CHECK=1): each fused region's first launch is run against
  // its ops run eagerly on copies of the same inputs, and the largest difference is logged (always,
  // not only under `log`) and kept in CompiledStep::region_checks(). The replay then runs without
  // CUDA graphs (the eager copies allocate).
  bool check = false;
};

struct Variant {
  std::string key;
  uint64_t structure = 0;
  Graph graph;
  std::unique_ptr<Runtime> runtime;
  double capture_ms = 0, plan_ms = 0;  // the compile: the first capture, and planning + runtime set-up
  // The fusion (CompileOptions::fusion): FusedGraph::summary() and its counts; "" without fusion.
  std::string fusion;
  int regions = 0, kernels_compiled = 0, kernels_cached = 0;
  int epilogues = 0;  // of the regions, GEMM epilogues (compiler/epilogue.h)
  // The recompute pass (CompileOptions::remat): RematResult::summary(), its counts; "" without it.
  std::string remat;
  int remat_buffers = 0;
  size_t remat_bytes = 0;
  int64_t replays = 0;  // whole steps replayed (streamed ones included)
  Runtime::Speculation speculation;  // its runtime's speculative start, as last logged
};

class CompiledStep {
 public:
  explicit CompiledStep(CompileOptions options = {});
  ~CompiledStep();

  // Tensors that live across steps, named for the graph's buffer kinds (dump, plan summary).
  void set_named(BufferKind kind, const std::vector<std::pair<std::string, Tensor>>& tensors);
  void set_config(std::string config) {
    options_.config = std::move(config);
    key_.clear();
  }

  // One step (see the header comment). `inputs` are the step's batch tensors.
  void run(const std::vector<Tensor>& inputs, const std::function<void()>& step);
  // Whether the next run() is an eager warm-up step (CompileOptions::warmup_steps).
  bool warming_up() const { return step_ < options_.warmup_steps; }

  struct Counts {
    int64_t eager = 0, compiled = 0, fallback = 0, guard_failures = 0;
    int64_t streamed = 0;  // compiled steps replayed while being captured (Note [Streamed replay])
    // Host time of the compiled steps: capturing the step's host logic (with the guard's structure
    // check; streamed, also the launches issued during it), and the replay after the capture
    // (binding, argument hashes, recordings, graph launches; streamed, what was left to issue).
    double capture_ms = 0, replay_ms = 0;
  };
  const Counts& counts() const { return counts_; }
  const std::vector<std::unique_ptr<Variant>>& variants() const { return variants_; }
  // Every guard failure's reason, in order (also logged).
  const std::vector<std::string>& guard_failures() const { return failures_; }
  // Check mode (CompileOptions::check): one entry per fused region checked, in launch order.
  const std::vector<RegionCheck>& region_checks() const { return checks_; }

 private:
  void log(const std::string& line);
  // The variant's graph with options_.fusion's regions fused (compiler/fused_step.h), or unchanged.
  FusedGraph fuse_variant(const Graph& g);
  void fail(const std::string& reason);
  // Logs the variant's speculative start (Note [Speculative start], runtime.h) when it changed.
  void log_speculation(Variant& v);
  // The guard's key for `inputs`: their shapes, dtypes, strides and devices, and the configuration.
  // Formatted only when they differ from the last step's (~20 µs, before the step's first kernel).
  const std::string& key_of(const std::vector<Tensor>& inputs);
  // named_'s classes for the step's Capture: rebuilt when a named tensor's storage is not the one
  // it was built for (set_named again, a parameter given new storage), else kept from the last
  // step — on a GPU the step's first kernel waits for it.
  const BufferClasses& named_classes();

  CompileOptions options_;
  std::vector<std::pair<BufferKind, std::vector<std::pair<std::string, Tensor>>>> named_;
  BufferClasses named_classes_;
  std::vector<const Storage*> named_storages_;  // what named_classes_ was built from, in named_'s order
  struct InputMeta {
    Shape shape, strides;
    DType dtype;
    Device device;
  };
  std::vector<InputMeta> key_inputs_;  // what key_ was formatted for
  std::string key_;  // empty: format it again
  std::vector<std::unique_ptr<Variant>> variants_;
  std::vector<std::string> failures_;
  std::vector<RegionCheck> checks_;
  Counts counts_;
  int64_t step_ = 0;
};

// The first difference between two graphs' structures, for a guard failure's message.
std::string first_difference(const Graph& expected, const Graph& got);

// What compiling a step would change in its peak, before it is compiled: `step` is captured (its
// host logic runs, no kernel), `parameters` classified as such and `inputs` as step inputs; with
// `remat` the save-or-recompute pass (compiler/remat.h) decides on the capture; then its memory is
// planned. The step's host-side effects happen as in a capture (generator offsets advance; a
// gradient it leaves in .grad is an unbacked tensor): the caller puts them back. The memory budget
// planner counts --compile and --compile-remat with it (train/memory_probe.cpp).
struct CompiledPeakChange {
  size_t remat_saving = 0;  // the pass's live peak before less after (0 without remat)
  size_t arena_excess = 0;  // the arena's bytes beyond the live peak it packs (best-fit's gaps)
};
CompiledPeakChange compiled_peak_change(const std::function<void()>& step,
                                        const std::vector<std::pair<std::string, Tensor>>& parameters,
                                        const std::vector<Tensor>& inputs, const std::vector<std::string>& exclude,
                                        bool remat);

}  // namespace blu::compiler
