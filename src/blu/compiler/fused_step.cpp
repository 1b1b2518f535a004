// compiler/fused_step: see fused_step.h.
#include "blu/compiler/fused_step.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/cuda_module.h"
#include "blu/compiler/codegen/region_check.h"
#include "blu/compiler/epilogue.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/view.h"
#ifdef BLU_HAVE_CUDA
#include "blu/core/cuda/runtime.h"
#endif

namespace blu::compiler {

// The stream a fused CUDA kernel runs on: the context's, where null names the device's default
// stream (never the legacy stream, which a CUDA-graph capture refuses).
static void* launch_stream(const ExecContext& ctx) {
#ifdef BLU_HAVE_CUDA
  return cuda::stream_of(ctx);
#else
  return ctx.stream;
#endif
}

std::string FusedGraph::summary() const {
  int ops = 0, epilogue_ops = 0;
  for (const FusedRegion& r : regions) (r.kind == RegionKind::gemm_epilogue ? epilogue_ops : ops) += int(r.ops.size());
  const size_t generated = regions.size() - size_t(epilogues);
  std::ostringstream os;
  os << generated << " regions (" << ops << " ops → " << generated << " kernels), " << refused
     << " refused; kernels: " << kernels_compiled << " compiled, " << kernels_cached << " from the cache";
  if (epilogues > 0) os << "; " << epilogues << " GEMM epilogues (" << epilogue_ops << " ops → " << epilogues << " GEMMs)";
  return os.str();
}

FusedGraph unfused(const Graph& g) {
  FusedGraph f;
  f.graph = g;
  f.capture_ops = int(g.ops.size());
  f.capture_values = int(g.values.size());
  f.capture_buffers = int(g.buffers.size());
  for (size_t i = 0; i < g.ops.size(); ++i) f.source.push_back(int(i));
  return f;
}

// Nodes: an op index (>= 0), or -(r + 1) for accepted region r.
std::vector<int> fused_schedule(const Graph& g, const std::vector<FusedRegion>& accepted, std::string* why) {
  const size_t n = g.ops.size();
  std::vector<int> owner(n, -1);
  for (size_t r = 0; r < accepted.size(); ++r)
    for (int oi : accepted[r].ops) {
      if (owner[size_t(oi)] >= 0) {
        if (why) *why = "op " + std::to_string(oi) + " is in two regions";
        return {};
      }
      owner[size_t(oi)] = int(r);
    }
  std::vector<int> first(accepted.size()), last(accepted.size());
  for (size_t r = 0; r < accepted.size(); ++r) {
    first[r] = *std::min_element(accepted[r].ops.begin(), accepted[r].ops.end());
    last[r] = *std::max_element(accepted[r].ops.begin(), accepted[r].ops.end());
  }
  // Values made by a region (or by an op deferred behind it) that is not yet placed.
  std::vector<int> pending_of(g.values.size(), -1);
  std::vector<std::vector<int>> deferred(accepted.size());
  std::vector<bool> placed(accepted.size(), false);
  std::vector<int> order;
  std::function<void(int)> place_region = [&](int r) {
    order.push_back(-(r + 1));
    placed[size_t(r)] = true;
    for (int oi : deferred[size_t(r)]) order.push_back(oi);
  };
  for (size_t i = 0; i < n; ++i) {
    const Op& op = g.ops[i];
    if (owner[i] >= 0) {
      const int r = owner[i];
      for (int v : op.outputs) pending_of[size_t(v)] = r;
      if (int(i) == last[size_t(r)]) place_region(r);
      continue;
    }
    int wait = -1;  // the unplaced region this op reads from
    for (int v : op.inputs)
      if (v >= 0 && pending_of[size_t(v)] >= 0 && !placed[size_t(pending_of[size_t(v)])]) {
        const int r = pending_of[size_t(v)];
        if (wait < 0 || last[size_t(r)] > last[size_t(wait)]) wait = r;
      }
    if (wait >= 0) {
      deferred[size_t(wait)].push_back(int(i));
      for (int v : op.outputs) pending_of[size_t(v)] = wait;
    } else {
      order.push_back(int(i));
    }
  }
  (void)first;
  // Every buffer's accesses keep their order: a reader after the writer before it, a writer after
  // every access before it. Positions: the node's index in `order`.
  std::vector<int> pos(n, -1);
  for (size_t k = 0; k < order.size(); ++k) {
    if (order[k] >= 0)
      pos[size_t(order[k])] = int(k);
    else
      for (int oi : accepted[size_t(-order[k] - 1)].ops) pos[size_t(oi)] = int(k);
  }
  std::vector<int> last_writer(g.buffers.size(), -1), max_touch(g.buffers.size(), -1);
  for (size_t i = 0; i < n; ++i) {
    const Op& op = g.ops[i];
    const int p = pos[i];
    for (int v : op.inputs) {
      if (v < 0) continue;
      const int b = g.values[size_t(v)].buffer;
      if (last_writer[size_t(b)] > p) {
        if (why) *why = "op " + std::to_string(i) + " (" + op.name + ") would read buf" + std::to_string(b) + " after a later write";
        return {};
      }
    }
    for (int b : written_buffers(g, op))
      if (max_touch[size_t(b)] > p) {
        if (why) *why = "op " + std::to_string(i) + " (" + op.name + ") would write buf" + std::to_string(b) + " before an earlier access";
        return {};
      }
    for (int v : op.inputs)
      if (v >= 0) max_touch[size_t(g.values[size_t(v)].buffer)] = std::max(max_touch[size_t(g.values[size_t(v)].buffer)], p);
    for (int v : op.outputs) max_touch[size_t(g.values[size_t(v)].buffer)] = std::max(max_touch[size_t(g.values[size_t(v)].buffer)], p);
    for (int b : written_buffers(g, op)) last_writer[size_t(b)] = std::max(last_writer[size_t(b)], p);
  }
  return order;
}

namespace {

// Why a region cannot run fused on its device, or "".
std::string unsupported(const Graph& g, const FusedRegion& r) {
  Device dev = kCPU;
  for (int v : r.inputs) dev = g.values[size_t(v)].device.is_cpu() ? dev : g.values[size_t(v)].device;
  for (int v : r.outputs) dev = g.values[size_t(v)].device.is_cpu() ? dev : g.values[size_t(v)].device;
  if (dev.is_cpu()) {
    if (!cpu_emitter_supports(g, r)) return "an op without a CPU emitter";
  } else {
#if BLU_HAVE_CUDA
    if (!dev.is_cuda()) return "a region on " + dev.str() + ": fused kernels are generated for the CPU and CUDA only";
    if (!cuda_emitter_supports(g, r)) return "an op without a CUDA emitter";
#else
    return "a region on " + dev.str() + ": this build has no CUDA";
#endif
  }
  for (int v : r.inputs)
    if (!g.values[size_t(v)].contiguous()) return "a strided input (value %" + std::to_string(v) + ")";
  for (int v : r.outputs)
    if (!g.values[size_t(v)].contiguous()) return "a strided output (value %" + std::to_string(v) + ")";
  return "";
}

bool on_cpu(const Graph& g, const FusedRegion& r) {
  for (int v : r.inputs)
    if (!g.values[size_t(v)].device.is_cpu()) return false;
  for (int v : r.outputs)
    if (!g.values[size_t(v)].device.is_cpu()) return false;
  return true;
}

// The region's kernel (the cache's, or compiled into it) as a launch: emitted C++ on the CPU,
// NVRTC's cubin on the context's stream for a CUDA region (unsupported() let it through only in a
// CUDA build). The region's scalars are read from each step's capture.
FusedLaunch load_launch(const Graph& g, const FusedRegion& r, bool* compiled, size_t* scratch) {
  *scratch = 0;
  if (on_cpu(g, r)) {
    std::shared_ptr<CpuKernel> k = CpuKernel::load(g, r, compiled);
    return [k, region = r](const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext&) {
      k->run(std::vector<Tensor>(in.begin(), in.end()), std::vector<Tensor>(out.begin(), out.end()),
             region_scalars(step, region));
    };
  }
  std::shared_ptr<CudaKernel> k = CudaKernel::load(g, r, compiled);
  *scratch = k->scratch_bytes();
  return [k, region = r](const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext& ctx) {
    k->run(std::vector<Tensor>(in.begin(), in.end()), std::vector<Tensor>(out.begin(), out.end()),
           region_scalars(step, region), launch_stream(ctx), ctx.scratch);
  };
}

}  // namespace

FusedLaunch checked_launch(FusedLaunch launch, FusedRegion region, std::function<void(const RegionCheck&)> report) {
  auto done = std::make_shared<bool>(false);
  return [launch = std::move(launch), r = std::move(region), report = std::move(report), done](
             const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext& ctx) {
    if (*done) return launch(step, in, out, ctx);
    *done = true;
    NoGradGuard no_grad;
    std::vector<Tensor> copies;
    for (const Tensor& t : in) copies.push_back(t.defined() ? clone(t) : Tensor());
    launch(step, in, out, ctx);
    const std::vector<Tensor> eager = run_region_eager(step, r, copies);
    RegionCheck c;
    c.region = r.index;
    for (int oi : r.ops) c.ops += (c.ops.empty() ? "" : ", ") + step.ops[size_t(oi)].name;
    for (size_t j = 0; j < out.size(); ++j) c.max_diff = worse_diff(c.max_diff, max_abs_diff(out[j], eager.at(j)));
    // What the region updates in place (AdamW's state): the fused result in the input itself, the
    // eager one in its copy.
    for (int oi : r.ops)
      for (int w : step.ops[size_t(oi)].writes) {
        const auto it = std::find(r.inputs.begin(), r.inputs.end(), step.ops[size_t(oi)].inputs[size_t(w)]);
        if (it == r.inputs.end()) continue;
        const size_t k = size_t(it - r.inputs.begin());
        c.max_diff = worse_diff(c.max_diff, max_abs_diff(in[k], copies[k]));
      }
    report(c);
  };
}

FusedGraph fuse_step(const Graph& g, std::vector<FusedRegion> regions, const KernelLoader& load) {
  FusedGraph f;
  f.capture_ops = int(g.ops.size());
  f.capture_values = int(g.values.size());
  f.capture_buffers = int(g.buffers.size());
  std::vector<FusedRegion> accepted;
  std::vector<FusedLaunch> launches;  // per accepted region
  std::vector<int> order;
  for (FusedRegion& r : regions) {
    // A GEMM epilogue runs linear's own kernel: epilogue_regions checked what it needs.
    const bool epilogue = r.kind == RegionKind::gemm_epilogue;
    std::string why = epilogue ? "" : unsupported(g, r);
    if (why.empty()) {
      accepted.push_back(r);
      std::vector<int> o = fused_schedule(g, accepted, &why);
      if (o.empty() && !g.ops.empty()) {
        accepted.pop_back();
      } else {
        // A kernel that does not compile or load refuses its region (its ops run eager), with the
        // emitter's or loader's message as the reason.
        if (epilogue) {
          launches.push_back(epilogue_launch(g, r));
          ++f.epilogues;
          order = std::move(o);
          continue;
        }
        try {
          bool compiled = false;
          size_t scratch = 0;
          launches.push_back(load ? load(g, r, &compiled, &scratch) : load_launch(g, r, &compiled, &scratch));
          f.kernel_scratch = std::max(f.kernel_scratch, scratch);
          (compiled ? f.kernels_compiled : f.kernels_cached) += 1;
          order = std::move(o);
          continue;
        } catch (const std::exception& e) {
          accepted.pop_back();
          why = std::string("its kernel failed: ") + e.what();
          why = why.substr(0, why.find('\n'));
        }
      }
    }
    ++f.refused;
    f.notes.push_back("region " + std::to_string(r.index) + " (" + std::to_string(r.ops.size()) + " ops, first " +
                      g.ops[size_t(r.ops.front())].name + ") refused: " + why);
  }
  if (accepted.empty()) {
    FusedGraph u = unfused(g);
    u.refused = f.refused;
    u.notes = std::move(f.notes);
    return u;
  }
  f.graph.buffers = g.buffers;
  f.graph.values = g.values;
  f.graph.inputs = g.inputs;
  f.graph.outputs = g.outputs;
  for (int node : order) {
    if (node >= 0) {
      f.graph.ops.push_back(g.ops[size_t(node)]);
      f.source.push_back(node);
      continue;
    }
    const int ri = -node - 1;
    FusedRegion r = accepted[size_t(ri)];
    Op op;
    op.kind = OpKind::fused;
    op.name = "fused";
    op.inputs = r.inputs;
    op.outputs = r.outputs;
    op.region = int(f.regions.size());
    // In-place updates inside (AdamW): the inputs whose buffers the region writes.
    for (int oi : r.ops)
      for (int w : g.ops[size_t(oi)].writes) {
        const int v = g.ops[size_t(oi)].inputs[size_t(w)];
        auto it = std::find(r.inputs.begin(), r.inputs.end(), v);
        if (it != r.inputs.end()) op.writes.push_back(int(it - r.inputs.begin()));
      }
    f.graph.ops.push_back(std::move(op));
    f.source.push_back(-1);
    r.index = int(f.regions.size());
    f.kernels.push_back(std::move(launches[size_t(ri)]));
    f.regions.push_back(std::move(r));
  }
  return f;
}

}  // namespace blu::compiler
