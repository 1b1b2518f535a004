// compiler/fusion_plan: where a compiled step's fused regions come from — the fusion pass
// (compiler/mlir/, a plugin loaded at first use: compiler/fusion_plugin.h, so nothing outside
// compiler/mlir/ includes an MLIR header), or a fusion plan read from the kernel cache
// (compiler/codegen/kernel_cache.h), which is how a build without MLIR fuses.
// A fusion plan is the regions of one captured step — each region's ops by op index — and the
// graph's structure hash, stored as one kernel-cache entry (extension "plan") keyed by the
// graph's portable text (compiler/portable_graph.h: everything Graph::structure_hash covers except the
// devices' indices, i.e. op names, kinds, wiring, effects, every value's shape/strides/offset/
// dtype, buffer sizes and kinds, the attributes compiled into kernels) and the target ("cpu-x86_64-
// abi2", "cuda-sm_90a"). The graph holds no pointers, so a plan made on one machine applies on
// another with the same model, shapes, precision and target; the region kernels it names are
// found in the cache by their region text as usual (fuse_step).
// Depends on compiler/{graph,fused_step,portable_graph,fusion_plugin},
// compiler/codegen/{region,kernel_cache,cpu_kernel,cuda_module}. Keep: a plan is applied only to a graph whose portable text equals the stored one
// (a key collision is a miss); a plan that does not fit the graph (an op index out of range, an
// op that is not fusible) is refused with the reason, never applied in part.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "blu/compiler/fused_step.h"
#include "blu/compiler/portable_graph.h"

namespace blu::compiler {

// The fusion pass: the MLIR plugin's (compiler/fusion_plugin.h) where fusion_plugin_path() finds
// one, loaded at the pass's first call; empty otherwise (a build without MLIR, BLU_FUSION_PLUGIN=none).
FusionFn fusion_pass();
bool have_fusion_pass();

// The kernel target of a graph's region kernels: kCpuTarget for a CPU graph, "cuda-<arch>" of the
// first CUDA value's device for a CUDA graph (needs a CUDA build).
std::string fusion_target(const Graph& g);

// The cache key of g's fusion plan for `target` (kernel_cache_key of the portable text).
std::string fusion_plan_key(const Graph& g, const std::string& target);

// Writes g's export file (exported_graph_text, compiler/portable_graph.h) into `dir` as
// <dir>/<plan key>.graph (made if missing; the file atomically) and returns its path.
std::string export_graph(const Graph& g, const std::string& target, const std::string& dir);

void store_fusion_plan(const Graph& g, const std::string& target, const std::vector<FusedRegion>& regions);
std::optional<std::vector<FusedRegion>> find_fusion_plan(const Graph& g, const std::string& target);

// A FusionFn for CompileOptions::fusion: the cached plan of the graph when there is one; else
// `pass` (when not empty) runs and its regions are stored as the graph's plan; else no regions.
// The target is extended by the excluded op names (compiler/exclude.h), which change the regions.
// `log` receives one line saying which happened ("fusion plan: from the cache (key …)", "…: none
// in the cache and no fusion pass in this build"). target "" = fusion_target(g). With an
// `export_dir`, a graph whose plan is not in the cache is also written there (export_graph).
FusionFn cached_fusion(FusionFn pass, std::function<void(const std::string&)> log = {}, std::string target = "",
                       std::string export_dir = "");

// The fusion of a `--compile-fuse` value: "off" → empty; "on" → cached_fusion(fusion_pass(), log)
// (a build without MLIR then applies cached plans only), exporting missed graphs to `export_dir`
// (`--compile-export`) when it is not empty. BLU_CHECK: on or off; an export directory with fusion
// off (nothing would be looked up).
FusionFn fusion_for(const std::string& mode, std::function<void(const std::string&)> log = {},
                    const std::string& export_dir = "");

}  // namespace blu::compiler
