// compiler/mlir/plugin: the entry points of libblutrain_fusion.so, the fusion pass as a plugin
// (compiler/fusion_plugin.h states the interface). It reads the host's portable graph text, runs
// mlir_api::fuse on the graph read back and answers with the plan text; no exception leaves it.
// Depends on compiler/mlir/mlir_api.h, compiler/{fusion_plugin,portable_graph}.h. Keep: the only
// symbols the plugin exports are these three (fusion_plugin.map); everything else it holds is its own.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>

#include "blu/compiler/fusion_plugin.h"
#include "blu/compiler/mlir/mlir_api.h"
#include "blu/compiler/portable_graph.h"

namespace {

char* copy_out(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p) std::memcpy(p, s.c_str(), s.size() + 1);
  return p;
}

}  // namespace

extern "C" const char* blu_fusion_plugin_abi(void) { return kBluFusionPluginAbi; }

extern "C" int blu_fusion_plugin_fuse(const char* graph_text, const char* no_fuse, char** plan, char** error) {
  *plan = nullptr;
  *error = nullptr;
  try {
    using namespace blu::compiler;
    const Graph g = parse_portable_graph_text(graph_text, "the graph sent to the fusion plugin");
    mlir_api::FusionOptions o;
    std::istringstream names(no_fuse ? no_fuse : "");
    for (std::string name; std::getline(names, name);)
      if (!name.empty()) o.no_fuse.push_back(name);
    *plan = copy_out(fusion_plan_text(g, mlir_api::fuse(g, o)));
    return *plan ? 0 : 1;
  } catch (const std::exception& e) {
    *error = copy_out(e.what());
  } catch (...) {
    *error = copy_out("unknown exception in the fusion pass");
  }
  return 1;
}

extern "C" void blu_fusion_plugin_free(char* s) { std::free(s); }
