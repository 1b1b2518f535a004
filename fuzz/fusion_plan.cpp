// Fuzz target: a fusion plan read from the kernel cache (compiler/portable_graph's
// parse_fusion_plan) for the captured step it belongs to — gpt2:tiny's training step on the CPU
// (fuzz/corpus/exported_graph/gpt2_tiny_step, as `bench --compile --compile-export` wrote it) —
// then taken through fuse_step's acceptance and rewrite (compiler/fused_step.h) with a loader that
// emits each region's CPU source instead of compiling it, and the memory plan of the rewritten
// step. The graph is the runtime's own capture, so only the plan comes from the input. Aborts
// when the rewritten step reads a value before the op that makes it, loses or repeats an op of the
// capture, or gets a memory plan with two live temporaries in the same bytes.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/region.h"
#include "blu/compiler/fused_step.h"
#include "blu/compiler/memory_plan.h"
#include "blu/compiler/portable_graph.h"
#include "fuzz_util.h"

namespace {

const blu::compiler::Graph& step() {
  static const blu::compiler::Graph g = [] {
    const std::string path = std::string(BLU_FUZZ_CORPUS) + "/exported_graph/gpt2_tiny_step";
    std::ifstream f(path, std::ios::binary);
    std::ostringstream os;
    os << f.rdbuf();
    if (!f) std::abort();
    return blu::compiler::parse_exported_graph(os.str(), path).graph;
  }();
  return g;
}

// What fuse_step's callers rely on in its result.
void check_rewrite(const blu::compiler::Graph& g, const blu::compiler::FusedGraph& f) {
  using namespace blu::compiler;
  if (f.source.size() != f.graph.ops.size()) std::abort();
  std::vector<int> runs(g.ops.size(), 0);  // per capture op: how often the rewrite runs it
  for (const FusedRegion& r : f.regions)
    for (int oi : r.ops) ++runs[size_t(oi)];
  int fused = 0;
  for (size_t i = 0; i < f.graph.ops.size(); ++i) {
    if (f.source[i] >= 0) ++runs[size_t(f.source[i])];
    else if (f.graph.ops[i].kind != OpKind::fused || f.graph.ops[i].region != fused++) std::abort();
  }
  if (size_t(fused) != f.regions.size() || f.kernels.size() != f.regions.size()) std::abort();
  for (int n : runs)
    if (n != 1) std::abort();
  // Each input is made before it is read: by an earlier op of the rewrite, or outside the step.
  std::vector<char> made(g.values.size(), 0);
  for (const Op& op : f.graph.ops) {
    for (int v : op.inputs)
      if (v >= 0 && g.values[size_t(v)].producer >= 0 && !made[size_t(v)]) std::abort();
    for (int v : op.outputs) made[size_t(v)] = 1;
  }
}

}  // namespace

BLU_FUZZ_TARGET({
  using namespace blu::compiler;
  const Graph& g = step();
  std::vector<FusedRegion> regions = parse_fusion_plan(g, std::string(blu::fuzz::as_text(data, size)));
  // The region's text (the cache's key) and its CPU source; an emitter that refuses throws, and
  // fuse_step refuses the region with that reason as it does for a kernel that fails to compile.
  const KernelLoader emit_only = [](const Graph& graph, const FusedRegion& r, bool* compiled, size_t* scratch) {
    *compiled = true;
    *scratch = region_text(graph, r).size() + emit_cpu_source(graph, r).size();
    return FusedLaunch{};
  };
  const FusedGraph f = fuse_step(g, std::move(regions), emit_only);
  check_rewrite(g, f);
  if (!f.regions.empty() && !check_plan(f.graph, plan_memory(f.graph)).empty()) std::abort();
})
