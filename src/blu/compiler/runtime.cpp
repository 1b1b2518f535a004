#include "blu/compiler/runtime.h"

#include <cstring>

#include "blu/compiler/fused_step.h"
#include "blu/memory/allocator.h"
#include "blu/ops/dispatch.h"

#ifdef BLU_HAVE_CUDA
#include <cuda_runtime.h>

#include "blu/core/cuda/runtime.h"
#endif

namespace blu::compiler {

// The recorded CUDA graph and the kernel arguments it was recorded with.
struct Runtime::CudaGraph {
#ifdef BLU_HAVE_CUDA
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~CudaGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
#endif
  uint64_t arguments = 0;  // hash of every launch's tensor addresses and attributes
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
                                            const std::vector<FusedLaunch>* kernels) {
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
    out.push_back(std::move(l));
  }
  return out;
}

Runtime::Runtime(const Graph& graph, MemoryPlan plan, RuntimeOptions options)
    : graph_(graph), capture_ops_(int(graph.ops.size())), plan_(std::move(plan)), options_(options),
      cuda_(std::make_unique<CudaGraph>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_);
}

Runtime::Runtime(FusedGraph fused, MemoryPlan plan, RuntimeOptions options)
    : graph_(std::move(fused.graph)), capture_ops_(fused.capture_ops), plan_(std::move(plan)), options_(options),
      cuda_(std::make_unique<CudaGraph>()) {
  for (const Arena& a : plan_.arenas) arenas_.push_back(allocator_for(a.device).allocate(a.bytes));
  launches_ = build_launches(graph_, &fused.source, &fused.kernels);
}

Runtime::~Runtime() = default;

void Runtime::execute(const Graph& g, const std::vector<Tensor>& tensors, const std::vector<Launch>& launches,
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
#ifdef BLU_HAVE_CUDA
  // The kernel arguments of this step: every bound address and every attribute.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (const Launch& l : launches_) {
    const Op& op = g.ops[size_t(l.kind == OpKind::fused ? 0 : l.source)];
    for (int v : l.kind == OpKind::fused ? l.inputs : op.inputs) mix(v >= 0 ? uint64_t(reinterpret_cast<uintptr_t>(step.tensors()[size_t(v)].raw_data())) : 0);
    for (int v : l.kind == OpKind::fused ? l.outputs : op.outputs)
      mix(uint64_t(reinterpret_cast<uintptr_t>(step.tensors()[size_t(v)].raw_data())));
  }
  // Every op's attributes, those inside fused regions included (their kernels read them per step).
  for (const Op& op : g.ops) {
    for (const auto& [k, val] : op.attrs.items())
      std::visit(
          [&](const auto& x) {
            using T = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<T, double>) {
              uint64_t bits;
              std::memcpy(&bits, &x, sizeof bits);
              mix(bits);
            } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, bool>) {
              mix(uint64_t(x));
            }
          },
          val);
  }
  const Device dev = plan_.arenas[0].device;
  const ExecContext& ctx = current_context(dev);
  const cudaStream_t stream = cuda::stream_of(ctx);  // null in the context means the device's default stream
  if (!cuda_->exec || cuda_->arguments != h) {
    // Record the launch list; the workspace may not grow inside the recording.
    ctx.scratch->reserve(ctx.scratch->high_water());
    const bool was_frozen = ctx.scratch->frozen();
    ctx.scratch->freeze();
    cudaGraph_t graph = nullptr;
    BLU_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      execute(g, step.tensors(), launches_, options_.poison_freed ? [this](size_t op) { poison(op); }
                                                                 : std::function<void(size_t)>());
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      if (!was_frozen) ctx.scratch->unfreeze();
      throw;
    }
    BLU_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    if (!was_frozen) ctx.scratch->unfreeze();
    bool updated = false;
    if (cuda_->exec) {
      cudaGraphExecUpdateResultInfo info{};
      updated = cudaGraphExecUpdate(cuda_->exec, graph, &info) == cudaSuccess;
      if (!updated) {
        (void)cudaGetLastError();
        cudaGraphExecDestroy(cuda_->exec);
        cuda_->exec = nullptr;
      }
    }
    if (!updated) BLU_CUDA_CHECK(cudaGraphInstantiate(&cuda_->exec, graph, 0));
    if (cuda_->graph) cudaGraphDestroy(cuda_->graph);
    cuda_->graph = graph;
    cuda_->arguments = h;
    ++stats_.graph_captures;
  }
  BLU_CUDA_CHECK(cudaGraphLaunch(cuda_->exec, stream));
  ++stats_.graph_launches;
#endif
}

}  // namespace blu::compiler
