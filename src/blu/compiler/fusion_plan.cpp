// compiler/fusion_plan: see fusion_plan.h.
#include "blu/compiler/fusion_plan.h"

#include <filesystem>

#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/cuda_module.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plugin.h"
#include "blu/core/error.h"
#include "blu/io/json_file.h"

namespace blu::compiler {

namespace {

// The plan format's version: part of the key, so a format change misses instead of misreading.
constexpr const char* kPlanToolchain = "fusion-plan-1";

}  // namespace

FusionFn fusion_pass() {
  const std::string path = fusion_plugin_path();
  return path.empty() ? FusionFn{} : plugin_fusion_pass(path);
}
bool have_fusion_pass() { return !fusion_plugin_path().empty(); }

std::string fusion_target(const Graph& g) {
  for (const Value& v : g.values)
    if (v.device.is_cuda()) return cuda_target(cuda_device_arch(v.device.index));
  return kCpuTarget;
}

std::string fusion_plan_key(const Graph& g, const std::string& target) {
  return kernel_cache_key(portable_graph_text(g), target, kPlanToolchain);
}

std::string export_graph(const Graph& g, const std::string& target, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = std::filesystem::path(dir) / (fusion_plan_key(g, target) + ".graph");
  io::write_file_atomic(path, exported_graph_text(g, target));
  return path.string();
}

void store_fusion_plan(const Graph& g, const std::string& target, const std::vector<FusedRegion>& regions) {
  kernel_cache_store(fusion_plan_key(g, target), "plan", fusion_plan_text(g, regions), portable_graph_text(g));
}

std::optional<std::vector<FusedRegion>> find_fusion_plan(const Graph& g, const std::string& target) {
  const std::optional<CacheEntry> hit = kernel_cache_find(fusion_plan_key(g, target), "plan", portable_graph_text(g));
  if (!hit) return std::nullopt;
  return parse_fusion_plan(g, hit->bytes);
}

FusionFn cached_fusion(FusionFn pass, std::function<void(const std::string&)> log, std::string target,
                       std::string export_dir) {
  return [pass = std::move(pass), log = std::move(log), target = std::move(target),
          export_dir = std::move(export_dir)](const Graph& g) {
    // The per-op opt-out (compiler/exclude.h) changes the regions: part of the plan's target.
    std::string t = target.empty() ? fusion_target(g) : target;
    for (const std::string& name : excluded_ops()) t += " -" + name;
    const std::string key = fusion_plan_key(g, t);
    auto say = [&](const std::string& s) {
      if (log) log("fusion plan: " + s + " (target " + t + ", key " + key + ")");
    };
    if (auto regions = find_fusion_plan(g, t)) {
      say("from the cache, " + std::to_string(regions->size()) + " regions");
      return *regions;
    }
    if (!export_dir.empty())
      say("not in the cache; the graph is exported to " + export_graph(g, t, export_dir) +
          " (`blutrain compile --from-graph` where MLIR is installed makes its plan)");
    if (!pass) {
      say("none in the cache and no fusion pass (no fusion plugin: a build without MLIR, or BLU_FUSION_PLUGIN=none): "
          "every op runs its eager kernel; `blutrain compile` where MLIR is installed fills the cache");
      return std::vector<FusedRegion>{};
    }
    std::vector<FusedRegion> regions = pass(g);
    store_fusion_plan(g, t, regions);
    say("made by the fusion pass, " + std::to_string(regions.size()) + " regions, stored");
    return regions;
  };
}

FusionFn fusion_for(const std::string& mode, std::function<void(const std::string&)> log, const std::string& export_dir) {
  BLU_CHECK(mode == "on" || mode == "off", "--compile-fuse: expected on or off, got '", mode, "'");
  BLU_CHECK(mode == "on" || export_dir.empty(), "--compile-export ", export_dir,
            " needs --compile-fuse on: with fusion off no plan is looked up, so there is nothing to export");
  if (mode == "off") return {};
  return cached_fusion(fusion_pass(), std::move(log), "", export_dir);
}

}  // namespace blu::compiler
