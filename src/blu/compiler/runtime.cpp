#include "blu/compiler/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "blu/compiler/fused_step.h"
#include "blu/memory/allocator.h"
#include "blu/ops/dispatch.h"

#ifdef BLU_HAVE_CUDA
#include <cuda_runtime.h>

#include "blu/backend/cuda/graph_memset.h"
#include "blu/core/cuda/runtime.h"
#endif

namespace blu::compiler {

// Note [Graph segments]: per launch, the previous step's attribute hash and whether it runs
// directly; the segments (a direct launch, or a chunk of at most kChunk graph launches), each
// with its recent recordings; and what the step under way has issued (Note [Streamed replay]).
struct Runtime::Replay {
  struct Recorded {
    uint64_t arguments = 0;  // hash of its launches' addresses and attributes
#ifdef BLU_HAVE_CUDA
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
#endif
  };
  struct Segment {
    size_t first = 0, end = 0;       // launches [first, end)
    bool direct = false;             // run outside a graph
    std::vector<Recorded> recorded;  // most recent first, at most kKept
  };
  static constexpr size_t kKept = 2;
  // Graph launches per segment: the GPU starts on a segment while the rest of the step is still
  // being captured, so a segment's first kernel waits for the capture of the whole segment. A step
  // that begins on an idle GPU (the trainer and bench read the loss after every step) waits for its
  // first segment's capture, so the step's first segments are short and double up to kChunk:
  // first_chunk, 2·first_chunk, … (BLU_COMPILE_FIRST_SEGMENT sets first_chunk; 0 or ≥ kChunk
  // makes every segment kChunk long). The default, 2, ran llama-250m 0.8% faster than 4 and GPT-2
  // level with it (H200, docs/performance.md, "Memset nodes made kernels").
  static constexpr size_t kChunk = 64;
  size_t first_chunk = first_chunk_from_env();
  static size_t first_chunk_from_env() {
    const char* e = std::getenv("BLU_COMPILE_FIRST_SEGMENT");
    if (!e || !*e) return 2;
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    BLU_CHECK(end && *end == '\0' && v >= 0, "BLU_COMPILE_FIRST_SEGMENT: expected a count of launches (0 or more), got '",
              e, "'");
    return size_t(v);
  }
  bool graphs = false;               // CUDA graphs (else every launch runs directly)
  std::vector<uint64_t> attributes;  // per launch, the previous step's
  std::vector<bool> direct;          // per launch
  std::vector<Segment> segments;
  // The step under way.
  std::vector<uint64_t> step_attributes;
  std::vector<char> bound;           // per buffer
  size_t ready = 0, next_segment = 0;
  bool recorded = false;
  // Note [Speculative start]: the next step's prefix (leading segments) and what it reads outside
  // the arena; this step's inputs' storages; the segments launched before this step's capture,
  // and whether one of them was not confirmed.
  struct Guard {
    int input = -1;                  // a step input: its position in begin's list
    std::weak_ptr<Storage> storage;  // otherwise: a storage that lives across steps
    const void* ptr = nullptr;
    size_t nbytes = 0;
  };
  size_t spec_segments = 0;
  std::vector<Guard> spec_guards;
  std::string spec_stop;  // where and why the prefix ends (Runtime::speculation)
  std::vector<const Storage*> inputs;
  size_t speculated = 0;
  bool spec_missed = false;
  void drop_speculation() {
    spec_segments = 0;
    spec_guards.clear();
    spec_stop.clear();
  }

  static void release(Recorded& r) {
#ifdef BLU_HAVE_CUDA
    if (r.exec) cudaGraphExecDestroy(r.exec);
    if (r.graph) cudaGraphDestroy(r.graph);
    r.exec = nullptr;
    r.graph = nullptr;
#endif
  }
  // Segments from `direct`; a segment whose launches are unchanged keeps its recordings.
  void resegment(size_t n) {
    std::vector<Segment> old = std::move(segments);
    segments.clear();
    drop_speculation();
    size_t limit = first_chunk == 0 ? kChunk : std::min(first_chunk, kChunk);
    for (size_t i = 0; i < n;) {
      Segment seg;
      seg.first = i;
      seg.direct = !graphs || direct[i];
      if (seg.direct) {
        ++i;
      } else {
        while (i < n && !direct[i] && i - seg.first < limit) ++i;
        limit = std::min(2 * limit, kChunk);
      }
      seg.end = seg.direct ? seg.first + 1 : i;
      for (Segment& o : old)
        if (!o.direct && !seg.direct && o.first == seg.first && o.end == seg.end) std::swap(seg.recorded, o.recorded);
      segments.push_back(std::move(seg));
    }
    for (Segment& o : old)
      for (Recorded& r : o.recorded) release(r);
  }
  ~Replay() {
    for (Segment& seg : segments)
      for (Recorded& r : seg.recorded) release(r);
  }
};

// The device a kernel runs on: the accelerator when one is involved (as ops/dispatch decides).
static Device kernel_device(const Graph& g, const Op& op) {
  Device d = kCPU;
  bool have = false;
  for (int v : op.inputs)
    if (v >= 0 && !have) {
      d = g.values[size_t(v)].device;
      have = true;
    }
  if (!have && !op.outputs.empty()) d = g.values[size_t(op.outputs[0])].device;
  for (int v : op.outputs)
    if (!g.values[size_t(v)].device.is_cpu()) d = g.values[size_t(v)].device;
  for (int v : op.inputs)
    if (v >= 0 && !g.values[size_t(v)].device.is_cpu()) d = g.values[size_t(v)].device;
  return d;
}

std::vector<Launch> Runtime::build_launches(const Graph& g, const std::vector<int>* source,
                                            const std::vector<FusedLaunch>* kernels,
                                            const std::vector<FusedRegion>* regions) {
  std::vector<Launch> out;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    if (op.kind == OpKind::view) continue;
    Launch l;
    l.kind = op.kind;
    l.op = int(i);
    l.source = source ? (*source)[i] : int(i);
    if (op.kind == OpKind::fused) {
      BLU_CHECK(kernels && op.region >= 0 && size_t(op.region) < kernels->size(), "compiler runtime: fused op ", i,
                " has no kernel for region ", op.region);
      l.fused = (*kernels)[size_t(op.region)];
      BLU_CHECK(regions && size_t(op.region) < regions->size() && !(*regions)[size_t(op.region)].ops.empty(),
                "compiler runtime: fused op ", i, " has no region ", op.region);
      l.attr_ops = (*regions)[size_t(op.region)].ops;
      l.inputs = op.inputs;
      l.outputs = op.outputs;
      l.device = kCPU;
      for (int v : op.outputs)
        if (!g.values[size_t(v)].device.is_cpu()) l.device = g.values[size_t(v)].device;
    }
    if (op.kind == OpKind::kernel) {
      l.device = kernel_device(g, op);
      l.kernel = backend(l.device.type).find(op.name);
      BLU_CHECK(l.kernel, "compiler runtime: ", op.name, " has no kernel for device ", l.device);
    }
    if (op.kind != OpKind::fused) {
      l.attr_ops = {l.source};
      l.inputs = op.inputs;
      l.outputs = op.outputs;
    }
    out.push_back(std::move(l));
  }
  return out;
}

Runtime::Runtime(const Graph& graph, MemoryPlan plan, RuntimeOptions options)
    : graph_(graph), capture_ops_(int(graph.ops.size())), capture_values_(graph.values.size()),
      capture_buffers_(graph.buffers.size()), plan_(std::move(plan)), options_(options),
      replay_(std::make_unique<Replay>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_);
  set_needs();
  set_releases();
}

Runtime::Runtime(FusedGraph fused, MemoryPlan plan, RuntimeOptions options)
    : graph_(std::move(fused.graph)), capture_ops_(fused.capture_ops), capture_values_(size_t(fused.capture_values)),
      capture_buffers_(size_t(fused.capture_buffers)), remade_by_(std::move(fused.remade_by)), plan_(std::move(plan)),
      options_(options), fused_scratch_(fused.kernel_scratch), replay_(std::make_unique<Replay>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_, &fused.source, &fused.kernels, &fused.regions);
  set_needs();
  set_releases();
  bind_rewrite_values();
}

// A rewrite's own buffers (compiler/remat.h) are no capture's: they get their bytes once, and
// their values tensors over them, for the runtime's life.
void Runtime::bind_rewrite_values() {
  std::vector<std::shared_ptr<Storage>> storages(graph_.buffers.size());
  for (size_t b = capture_buffers_; b < graph_.buffers.size(); ++b) {
    const Buffer& buf = graph_.buffers[b];
    const Placement& p = plan_.placements[b];
    DataPtr d = p.in_arena ? DataPtr(static_cast<char*>(arenas_[size_t(p.arena)].get()) + p.offset, buf.nbytes,
                                     buf.device, nullptr, nullptr)
                           : allocator_for(buf.device).allocate(buf.nbytes);
    storages[b] = std::make_shared<Storage>(std::move(d));
  }
  for (size_t v = capture_values_; v < graph_.values.size(); ++v) {
    const Value& val = graph_.values[v];
    BLU_ASSERT(size_t(val.buffer) >= capture_buffers_, "compiler runtime: value ", v,
               " of a rewrite lies on the capture's buffer ", val.buffer);
    extra_.emplace_back(storages[size_t(val.buffer)], val.shape, val.strides, val.offset, val.dtype);
  }
}

void Runtime::set_needs() {
  need_.clear();
  for (const Launch& l : launches_) need_.push_back(size_t(*std::max_element(l.attr_ops.begin(), l.attr_ops.end())));
}

Runtime::~Runtime() = default;

void Runtime::execute(const Graph& g, const std::vector<Tensor>& tensors, const std::vector<Tensor>& extra,
                      size_t base, std::span<const Launch> launches, const std::function<void(size_t)>& after_op) {
  std::vector<Tensor> in, out;
  auto tensor = [&](int v) -> const Tensor& { return size_t(v) >= base ? extra[size_t(v) - base] : tensors[size_t(v)]; };
  for (const Launch& l : launches) {
    const bool fused = l.kind == OpKind::fused;
    const Op& op = g.ops[size_t(fused ? 0 : l.source)];
    in.clear();
    out.clear();
    for (int v : l.inputs) in.push_back(v >= 0 ? tensor(v) : Tensor());
    for (int v : l.outputs) out.push_back(tensor(v));
    switch (l.kind) {
      case OpKind::kernel: {
        const ExecContext& ctx = current_context(l.device);
        ctx.scratch->reset();
        l.kernel(KernelCall{op.name, in, out, op.attrs, ctx});
        break;
      }
      case OpKind::collective:
        op.call(in);
        break;
      case OpKind::fused: {
        const ExecContext& ctx = current_context(l.device);
        ctx.scratch->reset();
        l.fused(g, in, out, ctx);
        break;
      }
      case OpKind::view:
        break;
    }
    if (after_op) after_op(size_t(l.op));
  }
}

void Runtime::poison(size_t op) {
  for (int b : plan_.frees_after[op]) {
    const Placement& p = plan_.placements[size_t(b)];
    char* at = static_cast<char*>(arenas_[size_t(p.arena)].get()) + p.offset;
    const Device d = plan_.arenas[size_t(p.arena)].device;
    if (d.is_cpu()) {
      std::memset(at, 0xFF, p.nbytes);
    } else {
#ifdef BLU_HAVE_CUDA
      BLU_CUDA_CHECK(cudaMemsetAsync(at, 0xFF, p.nbytes, cuda::stream_of(current_context(d))));
#endif
    }
  }
}

// Binds every storage the capture made: temporaries to their arena bytes (from `arenas`, or a
// fresh allocation when null), step outputs to a fresh allocation. With a plan, a temporary that
// no op of the plan touches (a fused region's intermediate) gets no bytes.
static void bind_storages(const Graph& g, const std::vector<std::shared_ptr<Storage>>& storages, const MemoryPlan* plan,
                 const std::vector<DataPtr>* arenas) {
  for (size_t b = 0; b < g.buffers.size(); ++b) {
    const Buffer& buf = g.buffers[b];
    if (buf.kind != BufferKind::temporary && buf.kind != BufferKind::step_output) continue;
    Storage& s = *storages[b];
    if (plan && buf.kind == BufferKind::temporary && plan->placements[b].first < 0) continue;
    if (plan && buf.kind == BufferKind::temporary && plan->placements[b].in_arena) {
      const Placement& p = plan->placements[b];
      s.data = DataPtr(static_cast<char*>((*arenas)[size_t(p.arena)].get()) + p.offset, buf.nbytes, buf.device,
                       nullptr, nullptr);
    } else {
      s.data = allocator_for(buf.device).allocate(buf.nbytes);
    }
  }
}

void Runtime::run_unplanned(Capture& step) {
  const Graph& g = step.graph();
  bind_storages(g, step.storages(), nullptr, nullptr);
  execute(g, step.tensors(), {}, g.values.size(), build_launches(g), {});
}

namespace {

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void mix(uint64_t x) { h = (h ^ x) * 1099511628211ull; }
};

// The attributes a launch reads this step (the float, integer and bool ones: kernel arguments).
uint64_t attribute_hash(const Graph& g, const Launch& l) {
  Fnv f;
  for (int i : l.attr_ops)
    for (const auto& [k, val] : g.ops[size_t(i)].attrs.items())
      std::visit(
          [&](const auto& x) {
            using T = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<T, double>) {
              uint64_t bits;
              std::memcpy(&bits, &x, sizeof bits);
              f.mix(bits);
            } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, bool>) {
              f.mix(uint64_t(x));
            }
          },
          val);
  return f.h;
}

// The values a launch binds.
template <typename F>
void for_each_value(const Launch& l, F&& f) {
  for (int v : l.inputs) f(v);
  for (int v : l.outputs) f(v);
}

// The addresses a launch binds this step (a rewrite's own values are bound for good: not hashed);
// a CUDA graph's recordings are told apart by them.
[[maybe_unused]] uint64_t address_hash(const std::vector<Tensor>& tensors, size_t base, const Launch& l) {
  Fnv f;
  for_each_value(l, [&](int v) {
    f.mix(v >= 0 && size_t(v) < base ? uint64_t(reinterpret_cast<uintptr_t>(tensors[size_t(v)].raw_data())) : 0);
  });
  return f.h;
}

}  // namespace

// The excluded temporaries (placed outside the arena): which launches touch one, and after which
// launch each is freed — the plan's releases_after, an op's moved to the first launch at or after
// it (a view launches nothing).
void Runtime::set_releases() {
  const size_t n = launches_.size();
  release_after_.assign(n, {});
  unplanned_.assign(n, 0);
  std::vector<char> unplanned(graph_.buffers.size(), 0);
  for (size_t b = 0; b < capture_buffers_; ++b) {
    const Placement& p = plan_.placements[b];
    unplanned[b] = graph_.buffers[b].kind == BufferKind::temporary && p.first >= 0 && !p.in_arena;
  }
  size_t op = 0;
  for (size_t i = 0; i < n; ++i) {
    for_each_value(launches_[i], [&](int v) {
      if (v >= 0 && size_t(v) < capture_values_ && unplanned[size_t(graph_.values[size_t(v)].buffer)]) unplanned_[i] = 1;
    });
    for (; op <= size_t(launches_[i].op); ++op)
      for (int b : plan_.releases_after[op])
        if (size_t(b) < capture_buffers_) release_after_[i].push_back(b);  // a rewrite's own are bound for good
  }
}

void Runtime::run(Capture& step, std::span<const Tensor> inputs) {
  begin(inputs);
  end(step);
}

void Runtime::begin(std::span<const Tensor> inputs) {
  Replay& r = *replay_;
  r.graphs = options_.cuda_graph && !plan_.arenas.empty() && !plan_.arenas[0].device.is_cpu();
#ifndef BLU_HAVE_CUDA
  r.graphs = false;
#endif
  const size_t n = launches_.size();
  if (r.direct.size() != n || r.segments.empty()) {
    // Collectives and their waits run outside the graphs: a collective recorded into a graph would
    // be joined back into it before the graph ends, so the compute after it would wait for it
    // (Note [Deferred collective waits], capture.cpp).
    r.direct.assign(n, false);
    // So do the launches that touch an excluded temporary: it is allocated and freed around them.
    for (size_t i = 0; i < n; ++i) r.direct[i] = launches_[i].kind == OpKind::collective || unplanned_[i];
    r.resegment(n);
    stats_.segments = int64_t(std::count_if(r.segments.begin(), r.segments.end(),
                                            [](const Replay::Segment& s) { return !s.direct; }));
  }
  r.step_attributes.assign(n, 0);
  r.bound.assign(graph_.buffers.size(), 0);
  r.ready = 0;
  r.next_segment = 0;
  r.recorded = false;
  r.speculated = 0;
  r.spec_missed = false;
  r.inputs.clear();
  for (const Tensor& t : inputs) r.inputs.push_back(t.defined() ? t.storage().get() : nullptr);
#ifdef BLU_HAVE_CUDA
  // Note [Speculative start]: launch the prefix if what it reads outside the arena is where its
  // recordings read it.
  if (!r.graphs || r.spec_segments == 0) return;
  for (const Replay::Guard& g : r.spec_guards) {
    std::shared_ptr<Storage> held;
    const Storage* s = nullptr;
    if (g.input >= 0) {
      if (size_t(g.input) >= inputs.size() || !inputs[size_t(g.input)].defined()) return;
      s = inputs[size_t(g.input)].storage().get();
    } else {
      held = g.storage.lock();
      s = held.get();
    }
    if (!s || s->ptr() != g.ptr || s->nbytes() != g.nbytes) return;
  }
  const cudaStream_t stream = cuda::stream_of(current_context(plan_.arenas[0].device));
  for (size_t k = 0; k < r.spec_segments; ++k) {
    BLU_CUDA_CHECK(cudaGraphLaunch(r.segments[k].recorded.front().exec, stream));
    ++stats_.graph_launches;
  }
  r.speculated = r.spec_segments;
  ++stats_.speculated_steps;
  stats_.speculated_segments += int64_t(r.speculated);
#endif
}

// Note [Speculative start]: the leading segments the next step may launch before its capture, and
// the storages outside the arena their launches read, from this step's capture.
void Runtime::plan_speculation(Capture& step) {
  Replay& r = *replay_;
  r.drop_speculation();
  if (!r.graphs || !options_.speculate) return;
  std::vector<int> guarded;  // buffer ids
  std::vector<Replay::Guard> guards;
  auto buffer_text = [&](int b) {
    const Buffer& buf = graph_.buffers[size_t(b)];
    return std::string(buffer_kind_name(buf.kind)) + (buf.name.empty() ? "" : " '" + buf.name + "'");
  };
  // Why launch i does not qualify ("" when it does); adds the guards of what it reads outside the
  // arena.
  auto disqualifies = [&](size_t i) -> std::string {
    const Launch& l = launches_[i];
    if (l.kind == OpKind::collective) return "a collective";
    if (l.device.is_cpu()) return "runs on the CPU";
    if (unplanned_[i]) return "touches a temporary outside the arena";
    const Op& op = graph_.ops[size_t(l.op)];
    auto in_arena = [&](int b) {
      return size_t(b) >= capture_buffers_ ||
             (graph_.buffers[size_t(b)].kind == BufferKind::temporary && plan_.placements[size_t(b)].in_arena);
    };
    for (int b : written_buffers(graph_, op))
      if (!in_arena(b)) return "writes a " + buffer_text(b);
    for (int v : l.inputs) {
      if (v < 0 || size_t(v) >= capture_values_) continue;
      const int b = graph_.values[size_t(v)].buffer;
      if (in_arena(b)) continue;
      const Buffer& buf = graph_.buffers[size_t(b)];
      if (buf.kind == BufferKind::temporary || buf.kind == BufferKind::step_output || buf.kind == BufferKind::rng_state ||
          buf.device.is_cpu())
        return "reads a " + buffer_text(b) + (buf.device.is_cpu() ? " on the CPU" : "");
      if (std::find(guarded.begin(), guarded.end(), b) != guarded.end()) continue;
      const std::shared_ptr<Storage>& s = step.storages()[size_t(b)];
      Replay::Guard guard;
      guard.ptr = s->ptr();
      guard.nbytes = s->nbytes();
      if (buf.kind == BufferKind::step_input) {
        const auto at = std::find(r.inputs.begin(), r.inputs.end(), s.get());
        if (at == r.inputs.end()) return "reads a step input not in run()'s list";
        guard.input = int(at - r.inputs.begin());
      } else {
        guard.storage = s;
      }
      guarded.push_back(b);
      guards.push_back(std::move(guard));
    }
    return "";
  };
  std::string stop = "the end of the step";
  size_t kept = 0;  // guards of the accepted segments
  for (size_t k = 0; k < r.segments.size(); ++k) {
    const Replay::Segment& seg = r.segments[k];
    if (seg.direct || seg.recorded.empty()) {
      stop = "launch " + std::to_string(seg.first) + " (" + graph_.ops[size_t(launches_[seg.first].op)].name +
             "): " + (seg.direct ? "runs directly (a collective, or attributes that change from step to step)" : "not recorded");
      break;
    }
    std::string why;
    size_t i = seg.first;
    for (; i < seg.end && why.empty(); ++i) why = disqualifies(i);
    if (!why.empty()) {
      stop = "launch " + std::to_string(i - 1) + " (" + graph_.ops[size_t(launches_[i - 1].op)].name + "): " + why;
      break;
    }
    r.spec_segments = k + 1;
    kept = guards.size();
  }
  guards.resize(kept);
  r.spec_guards = std::move(guards);
  r.spec_stop = std::move(stop);
}

Runtime::Speculation Runtime::speculation() const {
  const Replay& r = *replay_;
  return {r.spec_segments, r.spec_segments == 0 ? 0 : r.segments[r.spec_segments - 1].end, r.spec_stop};
}

// A buffer's bytes for this step, from the compiled structure's kinds (the capture's own kinds are
// final only at finish): a temporary its place in the arena (or a fresh allocation when the plan
// left it out), a step output a fresh allocation; what lives across steps is already bound.
void Runtime::bind(Capture& step, int value) {
  if (value < 0 || size_t(value) >= capture_values_) return;
  const int b = step.graph().values[size_t(value)].buffer;
  Replay& r = *replay_;
  if (r.bound[size_t(b)]) return;
  r.bound[size_t(b)] = 1;
  const Buffer& buf = graph_.buffers[size_t(b)];
  Storage& s = *step.storages()[size_t(b)];
  if (buf.kind == BufferKind::temporary) {
    const Placement& p = plan_.placements[size_t(b)];
    if (p.first < 0) return;  // a fused region's intermediate: no op touches it
    if (p.in_arena) {
      s.data = DataPtr(static_cast<char*>(arenas_[size_t(p.arena)].get()) + p.offset, buf.nbytes, buf.device,
                       nullptr, nullptr);
      return;
    }
    s.data = allocator_for(buf.device).allocate(buf.nbytes);
  } else if (buf.kind == BufferKind::step_output) {
    s.data = allocator_for(buf.device).allocate(buf.nbytes);
  }
}

void Runtime::advance(Capture& step, size_t captured_ops) {
  Replay& r = *replay_;
  const Graph& g = step.graph();
  const std::vector<Tensor>& tensors = step.tensors();
  while (r.ready < launches_.size() && need_[r.ready] < captured_ops) ++r.ready;
  const std::function<void(size_t)> after_op =
      options_.poison_freed ? std::function<void(size_t)>([this](size_t op) { poison(op); }) : nullptr;
  const std::span<const Launch> all(launches_);
  // An excluded temporary goes back to its allocator once its last launch is on the stream (the
  // caching allocator reuses it in stream order).
  auto release = [&](const Replay::Segment& seg) {
    for (size_t i = seg.first; i < seg.end; ++i)
      for (int b : release_after_[i]) {
        if (r.bound[size_t(b)] != 1) continue;
        step.storages()[size_t(b)]->data = DataPtr();
        r.bound[size_t(b)] = 2;
        ++stats_.released;
      }
  };
  while (r.next_segment < r.segments.size() && r.segments[r.next_segment].end <= r.ready) {
    Replay::Segment& seg = r.segments[r.next_segment++];
    for (size_t i = seg.first; i < seg.end; ++i) {
      r.step_attributes[i] = attribute_hash(g, launches_[i]);
      for_each_value(launches_[i], [&](int v) { bind(step, v); });
    }
    const std::span<const Launch> part = all.subspan(seg.first, seg.end - seg.first);
    if (seg.direct) {
      execute(g, tensors, extra_, capture_values_, part, after_op);
      if (r.graphs) ++stats_.direct_launches;
      release(seg);
      continue;
    }
#ifdef BLU_HAVE_CUDA
    Fnv f;
    for (size_t i = seg.first; i < seg.end; ++i)
      f.mix(r.step_attributes[i] ^ (address_hash(tensors, capture_values_, launches_[i]) * 31));
    const Device dev = plan_.arenas[0].device;
    const ExecContext& ctx = current_context(dev);
    const cudaStream_t stream = cuda::stream_of(ctx);  // null in the context means the device's default stream
    auto hit = std::find_if(seg.recorded.begin(), seg.recorded.end(),
                            [&](const Replay::Recorded& x) { return x.arguments == f.h; });
    // Note [Speculative start]: a segment launched before the capture is confirmed, or a miss.
    const size_t k = r.next_segment - 1;
    if (k < r.speculated && !r.spec_missed) {
      if (hit == seg.recorded.begin()) {
        release(seg);
        continue;
      }
      r.spec_missed = true;
      ++stats_.speculation_misses;
      for (size_t j = 0; j < k; ++j) {
        BLU_CUDA_CHECK(cudaGraphLaunch(r.segments[j].recorded.front().exec, stream));
        ++stats_.graph_launches;
      }
    }
    if (hit != seg.recorded.end()) {
      std::rotate(seg.recorded.begin(), hit, hit + 1);  // most recent first
    } else {
      // Record the segment; the workspace may not grow inside the recording (the fused kernels'
      // column partials included, which no eager step has taken yet).
      ctx.scratch->reserve(std::max(ctx.scratch->high_water(), fused_scratch_));
      const bool was_frozen = ctx.scratch->frozen();
      ctx.scratch->freeze();
      cudaGraph_t graph = nullptr;
      // Thread-local: other threads keep their CUDA calls while this one records — the NCCL group's
      // watchdog queries the events of the collectives issued between the graphs.
      BLU_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        execute(g, tensors, extra_, capture_values_, part, after_op);
      } catch (...) {
        cudaStreamEndCapture(stream, &graph);
        if (graph) cudaGraphDestroy(graph);
        if (!was_frozen) ctx.scratch->unfreeze();
        throw;
      }
      BLU_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      if (!was_frozen) ctx.scratch->unfreeze();
      stats_.memsets_lowered += cuda::lower_small_memsets(graph);
      Replay::Recorded rec;
      if (seg.recorded.size() >= Replay::kKept) {  // update the least recent in place
        rec = seg.recorded.back();
        seg.recorded.pop_back();
        cudaGraphExecUpdateResultInfo info{};
        if (cudaGraphExecUpdate(rec.exec, graph, &info) != cudaSuccess) {
          (void)cudaGetLastError();
          cudaGraphExecDestroy(rec.exec);
          rec.exec = nullptr;
        }
        if (rec.graph) cudaGraphDestroy(rec.graph);
      }
      if (!rec.exec) BLU_CUDA_CHECK(cudaGraphInstantiate(&rec.exec, graph, 0));
      rec.graph = graph;
      rec.arguments = f.h;
      seg.recorded.insert(seg.recorded.begin(), rec);
      ++stats_.graph_captures;
      r.recorded = true;
    }
    BLU_CUDA_CHECK(cudaGraphLaunch(seg.recorded.front().exec, stream));
    ++stats_.graph_launches;
#endif
    release(seg);
  }
}

void Runtime::end(Capture& step) {
  const Graph& g = step.graph();
  BLU_ASSERT(g.ops.size() == size_t(capture_ops_) && g.buffers.size() == capture_buffers_,
             "compiler runtime: a capture of another structure (", g.ops.size(), " ops, compiled ", capture_ops_, ")");
  advance(step, g.ops.size());
  Replay& r = *replay_;
  ++stats_.steps;
  stats_.launches += int64_t(launches_.size());
  if (r.recorded) ++stats_.steps_recorded;
  // Launches whose attributes changed since the previous step run directly from the next one on.
  bool changed = false;
  if (r.attributes.size() == launches_.size())
    for (size_t i = 0; i < launches_.size(); ++i)
      if (r.graphs && r.step_attributes[i] != r.attributes[i] && !r.direct[i]) {
        r.direct[i] = true;
        changed = true;
      }
  r.attributes = r.step_attributes;
  if (changed) {
    r.resegment(launches_.size());
    stats_.segments = int64_t(std::count_if(r.segments.begin(), r.segments.end(),
                                            [](const Replay::Segment& s) { return !s.direct; }));
  }
  plan_speculation(step);
}

bool Runtime::unconfirmed() const {
  const Replay& r = *replay_;
  return r.speculated > r.next_segment && !r.spec_missed;
}

size_t Runtime::issued() const {
  const Replay& r = *replay_;
  return r.next_segment == 0 ? 0 : r.segments[r.next_segment - 1].end;
}

// Note [Streamed replay]: the step left the compiled structure after `issued()` launches ran.
// What the rest of the step needs of their results is moved out of the arena (the rest runs
// unplanned, and the arena's bytes must not change under it), unless a later launch of the plan
// already wrote over it: then the step cannot be completed and the error says so.
void Runtime::salvage(Capture& step) {
  wait_issued_collectives();  // what the arena holds is complete before it moves
  const Graph& g = step.graph();
  const std::vector<Tensor>& tensors = step.tensors();
  Replay& r = *replay_;
  r.bound.resize(std::max(g.buffers.size(), graph_.buffers.size()), 0);  // the capture may have made more
  // Note [Speculative start]: segments launched before the capture and not all confirmed wrote
  // only arena temporaries; the whole step runs unplanned, in fresh bytes.
  const bool whole = unconfirmed();
  if (whole)
    for (size_t b = 0; b < g.buffers.size() && b < capture_buffers_; ++b)
      if (r.bound[b] == 1 && (graph_.buffers[b].kind == BufferKind::temporary ||
                              graph_.buffers[b].kind == BufferKind::step_output)) {
        step.storages()[b]->data = DataPtr();
        r.bound[b] = 0;
      }
  r.drop_speculation();
  const size_t done = whole ? 0 : issued();
  // Every launched launch's buffers (the plan's: launched ones are the variant's), with the first
  // and last launch that touched each.
  const size_t nb = g.buffers.size(), np = graph_.buffers.size();
  std::vector<int64_t> first(np, -1), last(np, -1);
  std::vector<char> ran(g.ops.size(), 0);
  for (size_t k = 0; k < done; ++k) {
    for (int o : launches_[k].attr_ops) ran[size_t(o)] = 1;
    for_each_value(launches_[k], [&](int v) {
      if (v < 0) return;
      const int b = graph_.values[size_t(v)].buffer;
      if (first[size_t(b)] < 0) first[size_t(b)] = int64_t(k);
      last[size_t(b)] = int64_t(k);
    });
  }
  // What the rest reads or writes, and what is read after the step.
  std::vector<char> needed(nb, 0);
  for (size_t i = 0; i < g.ops.size(); ++i) {
    if (ran[i] || g.ops[i].kind == OpKind::view) continue;
    for (int v : g.ops[i].inputs)
      if (v >= 0) needed[size_t(g.values[size_t(v)].buffer)] = 1;
  }
  for (size_t b = 0; b < nb; ++b)
    if (g.buffers[b].kind == BufferKind::step_output) needed[b] = 1;
  // Whether a launch after b's last one wrote over b's arena bytes.
  auto overwritten = [&](size_t b) {
    if (b >= np || first[b] < 0 || !r.bound[b] || graph_.buffers[b].kind != BufferKind::temporary) return false;
    const Placement& p = plan_.placements[b];
    if (!p.in_arena) return false;
    for (size_t c = 0; c < np; ++c) {
      if (c == b || first[c] <= last[b]) continue;  // launched buffers are the variant's: placed by the plan
      const Placement& q = plan_.placements[c];
      if (q.in_arena && q.arena == p.arena && q.offset < p.offset + p.nbytes && p.offset < q.offset + q.nbytes)
        return true;
    }
    return false;
  };
  auto cannot = [&](size_t b) {
    BLU_CHECK(false, "compiled step: the step's capture left the compiled structure after ", done, " of ",
              launches_.size(), " launches had run, and a value it still needs (", g.buffers[b].nbytes, " bytes, buffer ",
              b, ") was already ", r.bound[b] == 2 ? "freed after its last launch (an excluded op's)" : "overwritten in the arena",
              "; it cannot be completed. Run with BLU_COMPILE_STREAM=0 to replay only after the whole step is captured");
  };
  for (size_t b = 0; b < nb; ++b)
    if (needed[b] && r.bound[b] == 2) cannot(b);
  // A buffer the plan dropped across a gap (compiler/remat.h) is made again by its producer, whose
  // inputs the plan keeps until after the gap: checked here, and moved with the rest below.
  std::vector<int> remake;
  for (size_t b = 0; b < nb; ++b) {
    if (!needed[b] || !overwritten(b)) continue;
    const int op = b < remade_by_.size() ? remade_by_[b] : -1;
    if (op < 0) cannot(b);
    for (int v : g.ops[size_t(op)].inputs)
      if (v >= 0 && overwritten(size_t(g.values[size_t(v)].buffer))) cannot(b);
    for (int v : g.ops[size_t(op)].inputs)
      if (v >= 0) needed[size_t(g.values[size_t(v)].buffer)] = 1;
    if (std::find(remake.begin(), remake.end(), op) == remake.end()) remake.push_back(op);
  }
  for (int op : remake)
    for (int v : g.ops[size_t(op)].outputs) needed[size_t(g.values[size_t(v)].buffer)] = 0;
  for (size_t b = 0; b < nb; ++b) {
    if (!needed[b] || b >= np || first[b] < 0) continue;
    const Placement& p = plan_.placements[b];
    if (!r.bound[b] || graph_.buffers[b].kind != BufferKind::temporary || !p.in_arena) continue;
    if (overwritten(b)) cannot(b);
    // Move it out of the arena.
    Storage& s = *step.storages()[b];
    DataPtr fresh = allocator_for(g.buffers[b].device).allocate(g.buffers[b].nbytes);
    if (g.buffers[b].device.is_cpu()) {
      std::memcpy(fresh.get(), s.data.get(), g.buffers[b].nbytes);
    } else {
#ifdef BLU_HAVE_CUDA
      BLU_CUDA_CHECK(cudaMemcpyAsync(fresh.get(), s.data.get(), g.buffers[b].nbytes, cudaMemcpyDeviceToDevice,
                                     cuda::stream_of(current_context(g.buffers[b].device))));
#endif
    }
    s.data = std::move(fresh);
  }
  // The rest, unplanned: a fresh allocation for each buffer not bound yet, kernels in capture order.
  for (size_t b = 0; b < nb; ++b) {
    const Buffer& buf = g.buffers[b];
    if (r.bound[b] || (buf.kind != BufferKind::temporary && buf.kind != BufferKind::step_output)) continue;
    r.bound[b] = 1;
    step.storages()[b]->data = allocator_for(buf.device).allocate(buf.nbytes);
  }
  // The dropped buffers made again (their producers' outputs in fresh bytes: the same values),
  // then the rest, unplanned: kernels in capture order.
  std::vector<Launch> again, rest;
  for (int op : remake)
    for (int v : g.ops[size_t(op)].outputs) {
      const int b = g.values[size_t(v)].buffer;
      step.storages()[size_t(b)]->data = allocator_for(g.buffers[size_t(b)].device).allocate(g.buffers[size_t(b)].nbytes);
    }
  for (Launch& l : build_launches(g)) {
    if (std::find(remake.begin(), remake.end(), l.source) != remake.end()) again.push_back(l);
    if (!ran[size_t(l.source)]) rest.push_back(std::move(l));
  }
  execute(g, tensors, {}, g.values.size(), again, {});
  stats_.remade += int64_t(again.size());
  execute(g, tensors, {}, g.values.size(), rest, {});
}

}  // namespace blu::compiler
