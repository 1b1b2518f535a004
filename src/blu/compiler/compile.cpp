#include "blu/compiler/compile.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>

#include "blu/compiler/codegen/region_check.h"
#include "blu/compiler/epilogue.h"
#include "blu/compiler/fused_step.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/remat.h"
#include "blu/memory/allocator.h"

namespace blu::compiler {

CompiledStep::CompiledStep(CompileOptions options) : options_(std::move(options)) {
  if (const char* e = std::getenv("BLU_COMPILE_LOG"); e && *e && std::string(e) != "0") options_.log = true;
  if (const char* e = std::getenv("BLU_COMPILE_STREAM"); e && std::string(e) == "0") options_.stream = false;
  if (const char* e = std::getenv("BLU_COMPILE_SPECULATE"); e && std::string(e) == "0") options_.runtime.speculate = false;
  if (compile_check_enabled()) options_.check = true;
  if (options_.check) options_.runtime.cuda_graph = false;
  if (options_.plan.exclude.empty()) options_.plan.exclude = excluded_ops();
}

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string format_ms(double ms) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << ms << " ms";
  return os.str();
}

// Note [Streamed replay]: how far a capture under way has been checked against the variant.
struct Checked {
  size_t buffers = 0, values = 0, ops = 0;
};

// Runs a step's host logic under `cap` and completes the graph; a throw finishes the capture first,
// so its thread records nothing after it.
Graph& capture_step(Capture& cap, const std::function<void()>& step) {
  try {
    step();
  } catch (...) {
    cap.finish();
    throw;
  }
  return cap.finish();
}

bool same_attrs(const Attrs& a, const Attrs& b) {
  auto x = a.items().begin(), xe = a.items().end();
  auto y = b.items().begin(), ye = b.items().end();
  for (; x != xe && y != ye; ++x, ++y) {
    const auto& [k, u] = *x;
    const auto& [l, v] = *y;
    if (k != l || u.index() != v.index()) return false;
    if (!per_step_argument(k, u) && u != v) return false;
  }
  return x == xe && y == ye;
}

// Whether what the capture `got` recorded since `at` is the variant's `want` (a temporary may be
// the variant's step output: that is decided at the capture's finish); advances `at`.
bool same_so_far(const Graph& want, const Graph& got, Checked& at) {
  if (got.buffers.size() > want.buffers.size() || got.values.size() > want.values.size() ||
      got.ops.size() > want.ops.size())
    return false;
  for (; at.buffers < got.buffers.size(); ++at.buffers) {
    const Buffer& a = want.buffers[at.buffers];
    const Buffer& b = got.buffers[at.buffers];
    const bool kind = a.kind == b.kind || (b.kind == BufferKind::temporary && a.kind == BufferKind::step_output);
    if (a.nbytes != b.nbytes || a.device != b.device || !kind) return false;
  }
  for (; at.values < got.values.size(); ++at.values) {
    const Value& a = want.values[at.values];
    const Value& b = got.values[at.values];
    if (a.buffer != b.buffer || a.shape != b.shape || a.strides != b.strides || a.offset != b.offset ||
        a.dtype != b.dtype || a.producer != b.producer)
      return false;
  }
  for (; at.ops < got.ops.size(); ++at.ops) {
    const Op& a = want.ops[at.ops];
    const Op& b = got.ops[at.ops];
    if (a.kind != b.kind || a.name != b.name || a.inputs != b.inputs || a.outputs != b.outputs || a.views != b.views ||
        a.writes != b.writes || !same_attrs(a.attrs, b.attrs))
      return false;
  }
  return true;
}

}  // namespace

// Note [Host heap after a step]
// A step's capture makes and frees tens of thousands of small host objects (its graph, the meta
// tensors, autograd's nodes). glibc keeps small freed chunks unmerged ("fast bins") until a request
// too large for them, which first merges them all — and that request came early in the next step's
// capture, before its first kernel was issued, while the GPU waited. So the step makes one such
// request itself once its capture is freed, while the GPU still runs the step's kernels, and the
// merge happens there. Measured on the H200 machine's host (CUPTI timeline,
// scripts/lab/kernel_timeline.cpp; docs/performance.md, "Where the timed step waits"): from the
// batch's copy to the step's first kernel 211–223 µs for llama-250m and 170–281 µs for GPT-2 with
// it, 282–489 and 294–503 without it, 471–533 and 382–427 with neither it nor named_classes().
// The blutrain executable's heap is mimalloc's (Note [Host heap], apps/blutrain/host_heap.cpp),
// which has no such bins: there the pair is a few nanoseconds of nothing; glibc serves the tests
// and the Python module.
static void settle_host_heap() {
#ifdef __GLIBC__
  void* p = std::malloc(size_t(64) << 10);  // past the small-chunk sizes and the thread cache
  asm volatile("" : : "r"(p) : "memory");  // the pair is not optimised away
  std::free(p);
#endif
}

CompiledStep::~CompiledStep() = default;

void CompiledStep::set_named(BufferKind kind, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  named_.emplace_back(kind, tensors);
  named_storages_.clear();
}

const BufferClasses& CompiledStep::named_classes() {
  size_t i = 0;
  bool same = true;
  for (const auto& [kind, tensors] : named_)
    for (const auto& [name, t] : tensors) {
      const Storage* s = t.defined() ? t.storage().get() : nullptr;
      same = same && i < named_storages_.size() && named_storages_[i] == s;
      ++i;
    }
  if (same && i == named_storages_.size()) return named_classes_;
  named_classes_.clear();
  named_storages_.clear();
  for (const auto& [kind, tensors] : named_)
    for (const auto& [name, t] : tensors) {
      named_storages_.push_back(t.defined() ? t.storage().get() : nullptr);
      if (t.defined()) named_classes_[t.storage().get()] = {kind, name};  // a later name wins, as classify()
    }
  return named_classes_;
}

void CompiledStep::log(const std::string& line) {
  if (options_.log) (options_.log_stream ? *options_.log_stream : std::cerr) << "compile: " << line << "\n" << std::flush;
}

void CompiledStep::fail(const std::string& reason) {
  ++counts_.guard_failures;
  failures_.push_back(reason);
  // A guard failure is always reported, log or not: the step did not run compiled.
  (options_.log_stream ? *options_.log_stream : std::cerr) << "compile: guard failed at step " << step_ << ": "
                                                           << reason << "\n"
                                                           << std::flush;
}

const std::string& CompiledStep::key_of(const std::vector<Tensor>& inputs) {
  bool same = !key_.empty() && key_inputs_.size() == inputs.size();
  for (size_t i = 0; same && i < inputs.size(); ++i) {
    const InputMeta& m = key_inputs_[i];
    const Tensor& t = inputs[i];
    same = t.shape() == m.shape && t.strides() == m.strides && t.dtype() == m.dtype && t.device() == m.device;
  }
  if (same) return key_;
  key_inputs_.clear();
  for (const Tensor& t : inputs) key_inputs_.push_back({t.shape(), t.strides(), t.dtype(), t.device()});
  std::ostringstream os;
  for (const Tensor& t : inputs)
    os << to_string(t.shape()) << " " << t.dtype() << " strides " << to_string(t.strides()) << " " << t.device()
       << "; ";
  os << "config " << options_.config;
  key_ = os.str();
  return key_;
}

std::string first_difference(const Graph& a, const Graph& b) {
  const size_t n = std::min(a.ops.size(), b.ops.size());
  for (size_t i = 0; i < n; ++i) {
    const Op& x = a.ops[i];
    const Op& y = b.ops[i];
    if (x.name != y.name || x.kind != y.kind || x.inputs != y.inputs || x.outputs != y.outputs)
      return "op " + std::to_string(i) + " is " + y.name + ", the compiled graph has " + x.name;
    for (size_t j = 0; j < x.outputs.size(); ++j) {
      const Value& u = a.values[size_t(x.outputs[j])];
      const Value& v = b.values[size_t(y.outputs[j])];
      if (u.shape != v.shape || u.dtype != v.dtype || u.strides != v.strides)
        return "op " + std::to_string(i) + " (" + x.name + ") output " + std::to_string(j) + " is " +
               to_string(v.shape) + " " + std::string(dtype_name(v.dtype)) + ", the compiled graph has " +
               to_string(u.shape) + " " + std::string(dtype_name(u.dtype));
    }
  }
  if (a.ops.size() != b.ops.size())
    return "the step has " + std::to_string(b.ops.size()) + " ops, the compiled graph " + std::to_string(a.ops.size());
  return "buffers, values or attributes differ (" + std::to_string(b.buffers.size()) + " buffers, compiled " +
         std::to_string(a.buffers.size()) + ")";
}

FusedGraph CompiledStep::fuse_variant(const Graph& g) {
  std::vector<FusedRegion> regions;
  if (options_.epilogues) regions = epilogue_regions(g);
  if (options_.fusion) {
    // A generated region that holds an op of an epilogue gives way: the epilogue saves the
    // product's write and read, which a region after the GEMM cannot.
    std::vector<bool> taken(g.ops.size(), false);
    for (const FusedRegion& r : regions)
      for (int oi : r.ops) taken[size_t(oi)] = true;
    int dropped = 0;
    for (FusedRegion& r : options_.fusion(g)) {
      if (std::any_of(r.ops.begin(), r.ops.end(), [&](int oi) { return taken[size_t(oi)]; })) {
        ++dropped;
        continue;
      }
      regions.push_back(std::move(r));
    }
    if (dropped > 0) log("fusion: " + std::to_string(dropped) + " generated regions give way to GEMM epilogues");
  }
  if (regions.empty()) return unfused(g);
  FusedGraph f = fuse_step(g, std::move(regions));
  log("fusion: " + f.summary());
  for (const std::string& note : f.notes) log("fusion: " + note);
  if (options_.check)
    for (size_t i = 0; i < f.kernels.size(); ++i)
      f.kernels[i] = checked_launch(std::move(f.kernels[i]), f.regions[i], [this](const RegionCheck& c) {
        checks_.push_back(c);
        (options_.log_stream ? *options_.log_stream : std::cerr)
            << "compile: check: region " << c.region << " (" << c.ops << "): max |diff| " << c.max_diff << "\n"
            << std::flush;
      });
  return f;
}

void CompiledStep::run(const std::vector<Tensor>& inputs, const std::function<void()>& step) {
  ++step_;
  if (step_ <= options_.warmup_steps) {
    log("step " + std::to_string(step_) + " runs eager (warm-up: optimizer state, allocator, workspace)");
    ++counts_.eager;
    step();
    return;
  }
  const std::string& key = key_of(inputs);
  Variant* variant = nullptr;
  for (auto& v : variants_)
    if (v->key == key) variant = v.get();
  if (!variant && int(variants_.size()) >= options_.max_variants) {
    fail("no compiled variant for " + key + " and the limit of " + std::to_string(options_.max_variants) +
         " variants is reached; the step runs eager");
    ++counts_.eager;
    step();
    return;
  }
  if (!variant && !variants_.empty())
    fail("no compiled variant for " + key + " (the others: " + variants_.back()->key + "); compiling variant " +
         std::to_string(variants_.size() + 1) + " of at most " + std::to_string(options_.max_variants));

  const auto t_capture = std::chrono::steady_clock::now();
  // Note [Streamed replay]: a variant that has replayed a whole step replays the next ones while
  // they are captured; begin may launch the step's first segments at once (Note [Speculative
  // start], runtime.h), so it comes before the capture is set up.
  const bool stream = variant && options_.stream && variant->replays >= 1;
  if (stream) variant->runtime->begin(inputs);
  // Declared before the capture, so it runs after the capture's memory is freed: Note [Host heap
  // after a step].
  struct SettleHeap {
    ~SettleHeap() { settle_host_heap(); }
  } settle;
  Capture cap;
  cap.classify_all(&named_classes());
  for (const Tensor& t : inputs) cap.classify(t, BufferKind::step_input);
  if (variant) cap.reserve_like(variant->graph);
  Checked checked;
  bool left = false;  // the capture left the variant's structure
  if (stream) {
    cap.set_listener([&] {
      if (left) return;
      if (!same_so_far(variant->graph, cap.graph(), checked)) {
        left = true;
        return;
      }
      variant->runtime->advance(cap, cap.graph().ops.size());
    });
  }
  Graph& g = capture_step(cap, step);
  const uint64_t structure = g.structure_hash();
  if (stream) {
    counts_.capture_ms += ms_since(t_capture);
    const auto t_replay = std::chrono::steady_clock::now();
    if (!left && structure == variant->structure) {
      ++counts_.compiled;
      ++counts_.streamed;
      ++variant->replays;
      variant->runtime->end(cap);
      log_speculation(*variant);
    } else {
      fail("the step's capture differs from the compiled graph: " + first_difference(variant->graph, g) + "; " +
           (variant->runtime->unconfirmed()
                ? std::string("its first segments had run ahead of the capture, unconfirmed: the whole step runs unplanned")
                : std::to_string(variant->runtime->issued()) + " of its launches had run, the rest runs unplanned"));
      ++counts_.fallback;
      variant->runtime->salvage(cap);
    }
    counts_.replay_ms += ms_since(t_replay);
    return;
  }
  if (!variant) {
    auto v = std::make_unique<Variant>();
    v->capture_ms = ms_since(t_capture);
    const auto t_plan = std::chrono::steady_clock::now();
    v->key = key;
    v->structure = structure;
    v->graph = g;
    FusedGraph fused = fuse_variant(g);
    if (options_.fusion || !fused.regions.empty()) {
      v->fusion = fused.summary();
      v->regions = int(fused.regions.size());
      v->epilogues = fused.epilogues;
      v->kernels_compiled = fused.kernels_compiled;
      v->kernels_cached = fused.kernels_cached;
    }
    if (options_.remat) {
      RematOptions ro;
      ro.exclude = options_.plan.exclude;
      const RematResult rr = rematerialize(fused, ro);
      v->remat = rr.summary();
      v->remat_buffers = int(rr.choices.size());
      for (const RematChoice& c : rr.choices) v->remat_bytes += c.bytes;
      log("recompute: " + v->remat);
    }
    MemoryPlan plan = plan_memory(fused.graph, options_.plan);
    log("variant " + std::to_string(variants_.size() + 1) + " for " + key + ": " + g.summary());
    if (!options_.plan.exclude.empty()) {
      std::map<std::string, int> hits;
      for (const Op& op : g.ops) ++hits[op.name];
      std::string line = "excluded from compilation:";
      for (const std::string& name : options_.plan.exclude)
        line += " " + name + " (" + (hits.count(name) ? std::to_string(hits[name]) + " ops" : "no op of that name in this step") + ")";
      log(line);
    }
    log("memory plan: " + plan.summary());
    log("memory plan: live peak " + live_site(fused.graph, plan).describe(fused.graph));
    // The eager warm-up's activations are cached by the allocator and the replay never uses them:
    // they go back before the arena is allocated, which then gets a segment of its own instead of a
    // share of a larger one that could not be given back while the arena lives.
    for (const Arena& a : plan.arenas)
      if (!a.device.is_cpu()) allocator_for(a.device).release_cached();
    v->runtime = std::make_unique<Runtime>(std::move(fused), std::move(plan), options_.runtime);
    v->plan_ms = ms_since(t_plan);
    log("compile time: " + format_ms(v->capture_ms + v->plan_ms) + " (capture " + format_ms(v->capture_ms) +
        ", plan and runtime set-up " + format_ms(v->plan_ms) + ")");
    variants_.push_back(std::move(v));
    variant = variants_.back().get();
  } else if (variant->structure != structure) {
    fail("the step's capture differs from the compiled graph: " + first_difference(variant->graph, g) +
         "; its kernels run unplanned, in eager order");
    ++counts_.fallback;
    Runtime::run_unplanned(cap);
    return;
  }
  ++counts_.compiled;
  counts_.capture_ms += ms_since(t_capture);
  const auto t_replay = std::chrono::steady_clock::now();
  variant->runtime->run(cap, inputs);
  ++variant->replays;
  log_speculation(*variant);
  counts_.replay_ms += ms_since(t_replay);
}

void CompiledStep::log_speculation(Variant& v) {
  Runtime::Speculation s = v.runtime->speculation();
  if (s.stop.empty() || s == v.speculation) return;
  log("speculative start: " +
      (s.segments == 0 ? std::string("nothing")
                       : std::to_string(s.segments) + " segments (" + std::to_string(s.launches) + " launches)") +
      " launched before each capture; the prefix ends at " + s.stop);
  v.speculation = std::move(s);
}

CompiledPeakChange compiled_peak_change(const std::function<void()>& step,
                                        const std::vector<std::pair<std::string, Tensor>>& parameters,
                                        const std::vector<Tensor>& inputs, const std::vector<std::string>& exclude,
                                        bool remat) {
  Capture cap;
  for (const auto& [name, t] : parameters) cap.classify(t, BufferKind::parameter, name);
  for (const Tensor& t : inputs) cap.classify(t, BufferKind::step_input);
  FusedGraph f = unfused(capture_step(cap, step));
  CompiledPeakChange c;
  if (remat) {
    RematOptions ro;
    ro.exclude = exclude;
    const RematResult r = rematerialize(f, ro);
    c.remat_saving = r.peak_before > r.peak_after ? r.peak_before - r.peak_after : 0;
  }
  PlanOptions po;
  po.exclude = exclude;
  const MemoryPlan plan = plan_memory(f.graph, po);
  c.arena_excess = plan.arena_bytes() > plan.peak_live_bytes ? plan.arena_bytes() - plan.peak_live_bytes : 0;
  return c;
}

}  // namespace blu::compiler
