// Fuzz target: a captured step exported for fusing elsewhere (`blutrain compile --from-graph FILE`,
// compiler/portable_graph): the header, the target line and the portable graph text — buffers,
// values with their layouts, ops with their ids, views, writes and attributes. A graph that reads
// is written back, and what is written must read back as itself with the same plan key: that is
// how `compile --from-graph` decides the key its plan is stored under.
#include <cstdlib>
#include <string>

#include "blu/compiler/fusion_plan.h"
#include "blu/compiler/graph.h"
#include "blu/compiler/portable_graph.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  using namespace blu::compiler;
  const std::string text(blu::fuzz::as_text(data, size));
  const ExportedGraph e = parse_exported_graph(text, "<fuzz>.graph");
  const std::string again = exported_graph_text(e.graph, e.target);
  try {
    const ExportedGraph back = parse_exported_graph(again, "<written back>");
    if (exported_graph_text(back.graph, back.target) != again) std::abort();
    if (fusion_plan_key(back.graph, back.target) != fusion_plan_key(e.graph, e.target)) std::abort();
  } catch (const blu::Error&) {
    std::abort();  // a graph that was accepted was written as a text that is not
  }
  // What the passes read of every op: the buffers it writes.
  size_t written = 0;
  for (const Op& op : e.graph.ops) written += written_buffers(e.graph, op).size();
  (void)written;
})
