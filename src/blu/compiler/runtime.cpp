#include "blu/compiler/runtime.h"

#include <algorithm>
#include <cstring>

#include "blu/compiler/fused_step.h"
#include "blu/memory/allocator.h"
#include "blu/ops/dispatch.h"

#ifdef BLU_HAVE_CUDA
#include <cuda_runtime.h>

#include "blu/core/cuda/runtime.h"
#endif

namespace blu::compiler {

// Note [Graph segments]: per launch, the hashes of the previous step's attributes and whether it
// runs directly; the segments of launches between direct ones, each with its recent graphs.
struct Runtime::CudaGraphs {
  struct Recorded {
    uint64_t arguments = 0;  // hash of its launches' addresses and attributes
#ifdef BLU_HAVE_CUDA
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
#endif
  };
  struct Segment {
    size_t first = 0, end = 0;  // launches [first, end)
    bool direct = false;         // one launch, run outside a graph
    std::vector<Recorded> recorded;  // most recent first, at most kKept
  };
  static constexpr size_t kKept = 2;
  std::vector<uint64_t> attributes;  // per launch, the previous step's
  std::vector<bool> direct;          // per launch
  std::vector<Segment> segments;
  static void release(Recorded& r) {
#ifdef BLU_HAVE_CUDA
    if (r.exec) cudaGraphExecDestroy(r.exec);
    if (r.graph) cudaGraphDestroy(r.graph);
    r.exec = nullptr;
    r.graph = nullptr;
#endif
  }
  void clear() {
    for (Segment& seg : segments)
      for (Recorded& r : seg.recorded) release(r);
    segments.clear();
  }
  ~CudaGraphs() { clear(); }
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
      if (regions && size_t(op.region) < regions->size()) l.attr_ops = (*regions)[size_t(op.region)].ops;
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
    if (op.kind != OpKind::fused) l.attr_ops = {l.source};
    out.push_back(std::move(l));
  }
  return out;
}

Runtime::Runtime(const Graph& graph, MemoryPlan plan, RuntimeOptions options)
    : graph_(graph), capture_ops_(int(graph.ops.size())), plan_(std::move(plan)), options_(options),
      cuda_(std::make_unique<CudaGraphs>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_);
}

Runtime::Runtime(FusedGraph fused, MemoryPlan plan, RuntimeOptions options)
    : graph_(std::move(fused.graph)), capture_ops_(fused.capture_ops), plan_(std::move(plan)), options_(options),
      cuda_(std::make_unique<CudaGraphs>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_, &fused.source, &fused.kernels, &fused.regions);
}

Runtime::~Runtime() = default;

void Runtime::execute(const Graph& g, const std::vector<Tensor>& tensors, std::span<const Launch> launches,
                      const std::function<void(size_t)>& after_op) {
  std::vector<Tensor> in, out;
  for (const Launch& l : launches) {
    const bool fused = l.kind == OpKind::fused;
    const Op& op = g.ops[size_t(fused ? 0 : l.source)];
    in.clear();
    out.clear();
    for (int v : fused ? l.inputs : op.inputs) in.push_back(v >= 0 ? tensors[size_t(v)] : Tensor());
    for (int v : fused ? l.outputs : op.outputs) out.push_back(tensors[size_t(v)]);
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
  execute(g, step.tensors(), build_launches(g), {});
}

void Runtime::run(Capture& step) {
  const Graph& g = step.graph();
  BLU_ASSERT(g.ops.size() == size_t(capture_ops_) && g.buffers.size() == graph_.buffers.size(),
             "compiler runtime: a capture of another structure (", g.ops.size(), " ops, compiled ", capture_ops_, ")");
  bind_storages(g, step.storages(), &plan_, &arenas_);
  ++stats_.steps;
  stats_.launches += int64_t(launches_.size());
  const bool on_cuda = !plan_.arenas.empty() && !plan_.arenas[0].device.is_cpu();
  if (!on_cuda || !options_.cuda_graph) {
    execute(g, step.tensors(), launches_, options_.poison_freed ? [this](size_t op) { poison(op); }
                                                               : std::function<void(size_t)>());
    return;
  }
  run_cuda(step);
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

// The addresses a launch binds this step.
uint64_t address_hash(const Graph& g, const std::vector<Tensor>& tensors, const Launch& l) {
  Fnv f;
  const Op& op = g.ops[size_t(l.kind == OpKind::fused ? 0 : l.source)];
  for (int v : l.kind == OpKind::fused ? l.inputs : op.inputs)
    f.mix(v >= 0 ? uint64_t(reinterpret_cast<uintptr_t>(tensors[size_t(v)].raw_data())) : 0);
  for (int v : l.kind == OpKind::fused ? l.outputs : op.outputs)
    f.mix(uint64_t(reinterpret_cast<uintptr_t>(tensors[size_t(v)].raw_data())));
  return f.h;
}

}  // namespace

void Runtime::run_cuda(Capture& step) {
#ifdef BLU_HAVE_CUDA
  const Graph& g = step.graph();
  const std::vector<Tensor>& tensors = step.tensors();
  CudaGraphs& cg = *cuda_;
  const size_t n = launches_.size();
  std::vector<uint64_t> attrs(n), args(n);
  for (size_t i = 0; i < n; ++i) {
    attrs[i] = attribute_hash(g, launches_[i]);
    args[i] = attrs[i] ^ (address_hash(g, tensors, launches_[i]) * 31);
  }
  // Launches whose attributes changed since the previous step run directly from now on.
  bool resegment = cg.segments.empty() && n > 0;
  if (cg.direct.size() != n) cg.direct.assign(n, false);
  if (cg.attributes.size() == n)
    for (size_t i = 0; i < n; ++i)
      if (attrs[i] != cg.attributes[i] && !cg.direct[i]) {
        cg.direct[i] = true;
        resegment = true;
      }
  cg.attributes = attrs;
  if (resegment) {
    cg.clear();
    for (size_t i = 0; i < n;) {
      CudaGraphs::Segment seg;
      seg.first = i;
      seg.direct = cg.direct[i];
      if (seg.direct) {
        ++i;
      } else {
        while (i < n && !cg.direct[i]) ++i;
      }
      seg.end = seg.direct ? seg.first + 1 : i;
      cg.segments.push_back(std::move(seg));
    }
    stats_.segments = int64_t(std::count_if(cg.segments.begin(), cg.segments.end(),
                                            [](const CudaGraphs::Segment& s) { return !s.direct; }));
  }
  const std::function<void(size_t)> after_op =
      options_.poison_freed ? std::function<void(size_t)>([this](size_t op) { poison(op); }) : nullptr;
  const Device dev = plan_.arenas[0].device;
  const ExecContext& ctx = current_context(dev);
  const cudaStream_t stream = cuda::stream_of(ctx);  // null in the context means the device's default stream
  const std::span<const Launch> all(launches_);
  bool recorded = false;
  for (CudaGraphs::Segment& seg : cg.segments) {
    const std::span<const Launch> part = all.subspan(seg.first, seg.end - seg.first);
    if (seg.direct) {
      execute(g, tensors, part, after_op);
      ++stats_.direct_launches;
      continue;
    }
    Fnv f;
    for (size_t i = seg.first; i < seg.end; ++i) f.mix(args[i]);
    auto hit = std::find_if(seg.recorded.begin(), seg.recorded.end(),
                            [&](const CudaGraphs::Recorded& r) { return r.arguments == f.h; });
    if (hit != seg.recorded.end()) {
      std::rotate(seg.recorded.begin(), hit, hit + 1);  // most recent first
    } else {
      // Record the segment; the workspace may not grow inside the recording.
      ctx.scratch->reserve(ctx.scratch->high_water());
      const bool was_frozen = ctx.scratch->frozen();
      ctx.scratch->freeze();
      cudaGraph_t graph = nullptr;
      BLU_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      try {
        execute(g, tensors, part, after_op);
      } catch (...) {
        cudaStreamEndCapture(stream, &graph);
        if (graph) cudaGraphDestroy(graph);
        if (!was_frozen) ctx.scratch->unfreeze();
        throw;
      }
      BLU_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      if (!was_frozen) ctx.scratch->unfreeze();
      CudaGraphs::Recorded r;
      if (seg.recorded.size() >= CudaGraphs::kKept) {  // update the least recent in place
        r = seg.recorded.back();
        seg.recorded.pop_back();
        cudaGraphExecUpdateResultInfo info{};
        if (cudaGraphExecUpdate(r.exec, graph, &info) != cudaSuccess) {
          (void)cudaGetLastError();
          cudaGraphExecDestroy(r.exec);
          r.exec = nullptr;
        }
        if (r.graph) cudaGraphDestroy(r.graph);
      }
      if (!r.exec) BLU_CUDA_CHECK(cudaGraphInstantiate(&r.exec, graph, 0));
      r.graph = graph;
      r.arguments = f.h;
      seg.recorded.insert(seg.recorded.begin(), r);
      ++stats_.graph_captures;
      recorded = true;
    }
    BLU_CUDA_CHECK(cudaGraphLaunch(seg.recorded.front().exec, stream));
    ++stats_.graph_launches;
  }
  if (recorded) ++stats_.steps_recorded;
#else
  (void)step;
#endif
}

}  // namespace blu::compiler
