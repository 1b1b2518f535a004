// Fuzz target: a fusion plan read from the kernel cache (compiler/portable_graph's
// parse_fusion_plan) for the captured step it belongs to — gpt2:tiny's training step on the CPU
// (fuzz/corpus/exported_graph/gpt2_tiny_step, as `bench --compile --compile-export` wrote it) — then what the
// runtime does with its regions before it compiles one (compiler/fused_step.h's fuse_step): each
// region's text (the kernel cache's key), whether the CPU emitter takes it and the source it
// emits, and the schedule of the regions accepted so far. The graph is the runtime's own capture,
// so only the plan comes from the input.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/region.h"
#include "blu/compiler/fused_step.h"
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

}  // namespace

BLU_FUZZ_TARGET({
  using namespace blu::compiler;
  const Graph& g = step();
  const std::vector<FusedRegion> regions = parse_fusion_plan(g, std::string(blu::fuzz::as_text(data, size)));
  std::vector<FusedRegion> accepted;
  size_t chars = 0;
  for (const FusedRegion& r : regions) {
    chars += region_text(g, r).size();
    if (!cpu_emitter_supports(g, r)) continue;
    try {
      chars += emit_cpu_source(g, r).size();
    } catch (const blu::Error&) {
      continue;  // the runtime keeps such a region's ops eager
    }
    accepted.push_back(r);
    std::string why;
    if (fused_schedule(g, accepted, &why).empty()) {
      if (why.empty()) std::abort();  // a refused schedule says why
      accepted.pop_back();
    }
  }
  (void)chars;
})
