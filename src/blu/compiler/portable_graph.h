// compiler/portable_graph: a captured step as text that holds no pointers, device indices or
// per-step scalars, that text read back as a graph, and a fusion plan of such a graph as text. The
// graph's text is what a fusion plan's cache key hashes (compiler/fusion_plan.h), what travels from
// a machine that captures a step without a fusion pass (the GPU machine, no MLIR) to one that fuses
// it (`blutrain compile --from-graph`), and what the fusion plugin reads (compiler/fusion_plugin.h).
//   b <bytes> <cpu|cuda> <BufferKind>                               one line per buffer
//   v <buffer> [shape] [strides] <offset> <dtype> <cpu|cuda> <producer op>   per value
//   o <OpKind> <name> ( <inputs> ) ( <outputs> ) views <out:in>... writes <input positions>... <attrs>
//   inputs <ids>  /  outputs <ids>
// An attribute is name#<variant index>[=value]: ints (but step, seed, offset), shapes, dtypes and
// bools carry their value; floats do not (kernel arguments, not structure).
// Depends on compiler/graph, compiler/codegen/region. Keep: portable_graph_text(parse_portable_graph_text(t))
// == t for any t this file wrote; a text that is not is refused with its line, the field and what
// was there — as is one that does not hold together (an id or position out of range, a value
// reaching outside its buffer, an op reading what no earlier op made), so a pass reading the graph
// never indexes outside it. fuzz/exported_graph.cpp and fuzz/fusion_plan.cpp fuzz both readers.
#pragma once
#include <string>
#include <vector>

#include "blu/compiler/codegen/region.h"
#include "blu/compiler/graph.h"

namespace blu::compiler {

// The graph as text without device indices or per-step scalars (see the header comment).
std::string portable_graph_text(const Graph& g);
// The portable text back as a graph: how a step captured where there is no fusion pass (the GPU
// machine) is fused where MLIR is installed. portable_graph_text of the result is `text`. What the
// text leaves out is what neither the key nor the pass reads: float attributes and the per-step
// ints (step, seed, offset) come back as 0, device indices as 0, buffer names empty, no OpDef, no
// collective call; an op with seed and offset attributes is an rng op. `where` names the text in
// errors, which give the line, the field and what was expected.
Graph parse_portable_graph_text(const std::string& text, const std::string& where);

// An exported graph: "blu-fusion-graph 1", "target <target>" (the plan's target, with the excluded
// op names as " -name"), then the portable text. compiler/fusion_plan.h writes it on a cache miss
// (export_graph); `blutrain compile --from-graph` fuses it and stores the plan under the same key.
struct ExportedGraph {
  std::string target;
  Graph graph;
};
std::string exported_graph_text(const Graph& g, const std::string& target);
ExportedGraph parse_exported_graph(const std::string& text, const std::string& where);

// A fusion plan as text: "blu-fusion-plan 1", "structure <hex>", then one line per region
// "region <pointwise|rows> <bytes_saved> <op> <op> ...". The kernel cache stores it
// (compiler/fusion_plan.h) and the fusion plugin answers with it (compiler/fusion_plugin.h).
std::string fusion_plan_text(const Graph& g, const std::vector<FusedRegion>& regions);
// The regions of a plan text for g, inputs and outputs recomputed from the ops (codegen/region.h).
// BLU_CHECK: the text parses and every op index names a fusible op of g.
std::vector<FusedRegion> parse_fusion_plan(const Graph& g, const std::string& text);

}  // namespace blu::compiler
