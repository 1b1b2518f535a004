// compiler/fusion_plugin: the MLIR fusion pass as a shared object loaded on first use. The pass
// (compiler/mlir/, MLIR and LLVM) is built as libblutrain_fusion.so beside the blutrain executable,
// not linked into it: loading libMLIR and libLLVM costs about 70 ms of CPU at every process start,
// which every CPU run, every rank and `blutrain --help` would pay. The plugin is opened the first
// time a step needs a plan that is not in the kernel cache.
// The two sides share only text: the host sends the graph's portable text (compiler/portable_graph.h)
// and the excluded op names, the plugin answers with a fusion plan ("blu-fusion-plan 1"), which the
// host checks against its own graph like a plan from the cache. The plugin carries its own copy of
// the few files that read and write those texts, so it needs nothing from the program that loads it
// (the Python module, a test binary or blutrain alike).
// Where it is looked for: BLU_FUSION_PLUGIN (a path; "none": no plugin), else
// libblutrain_fusion.so in the running executable's directory.
// Depends on compiler/{graph,fused_step}. Keep: the C entry points below are the whole interface;
// a plugin whose kBluFusionPluginAbi differs from the host's is refused with both strings.
#pragma once
#include <string>

#include "blu/compiler/fused_step.h"

extern "C" {
// What a plugin and its host must agree on: this interface and the two texts it carries.
inline constexpr const char* kBluFusionPluginAbi = "blu-fusion-plugin 1; portable graph 1; blu-fusion-plan 1";

// The plugin's kBluFusionPluginAbi.
const char* blu_fusion_plugin_abi(void);
// Fuses the graph of a portable text; `no_fuse` holds the op names kept out of every region, one
// per line. Returns 0 and sets *plan (a plan text), or nonzero and sets *error (the message); either
// string is the plugin's, released with blu_fusion_plugin_free.
int blu_fusion_plugin_fuse(const char* graph_text, const char* no_fuse, char** plan, char** error);
void blu_fusion_plugin_free(char* s);
}

namespace blu::compiler {

// The plugin's file name and the path it is loaded from: BLU_FUSION_PLUGIN when set (empty when it
// is "none"), else the file beside the running executable when it exists, else "".
inline constexpr const char* kFusionPluginFile = "libblutrain_fusion.so";
std::string fusion_plugin_path();

// The plugin's pass: loads the plugin at its first call (once per process) and fuses through it.
// BLU_CHECK, naming the path: the file loads, has the entry points and the host's ABI; the pass's
// own errors come back with the plugin's message.
FusionFn plugin_fusion_pass(const std::string& path);

// Whether the plugin at `path` is already loaded into this process.
bool fusion_plugin_loaded(const std::string& path);

}  // namespace blu::compiler
