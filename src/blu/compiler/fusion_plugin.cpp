// compiler/fusion_plugin: see fusion_plugin.h.
#include "blu/compiler/fusion_plugin.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "blu/compiler/exclude.h"
#include "blu/compiler/portable_graph.h"
#include "blu/core/error.h"

namespace blu::compiler {
namespace {

struct Plugin {
  const char* (*abi)() = nullptr;
  int (*fuse)(const char*, const char*, char**, char**) = nullptr;
  void (*release)(char*) = nullptr;
};

std::mutex& plugins_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, Plugin>& plugins() {
  static std::map<std::string, Plugin> loaded;  // never closed: MLIR's statics live until exit
  return loaded;
}

template <class Fn>
Fn entry(void* handle, const char* name, const std::string& path) {
  void* sym = ::dlsym(handle, name);
  BLU_CHECK(sym, "fusion plugin ", path, ": no entry point ", name, " (not a BluTrain fusion plugin?)");
  return reinterpret_cast<Fn>(sym);
}

const Plugin& load(const std::string& path) {
  std::lock_guard<std::mutex> lock(plugins_mutex());
  auto it = plugins().find(path);
  if (it != plugins().end()) return it->second;
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = ::dlerror();
    BLU_CHECK(false, "fusion plugin ", path, " does not load: ", why ? why : "unknown reason",
              " (BLU_FUSION_PLUGIN=none runs without it: cached plans only)");
  }
  Plugin p;
  p.abi = entry<const char* (*)()>(handle, "blu_fusion_plugin_abi", path);
  p.fuse = entry<int (*)(const char*, const char*, char**, char**)>(handle, "blu_fusion_plugin_fuse", path);
  p.release = entry<void (*)(char*)>(handle, "blu_fusion_plugin_free", path);
  const std::string abi = p.abi();
  if (abi != kBluFusionPluginAbi) {
    ::dlclose(handle);
    BLU_CHECK(false, "fusion plugin ", path, ": interface '", abi, "', expected '", kBluFusionPluginAbi,
              "' (a plugin from another BluTrain build)");
  }
  return plugins().emplace(path, p).first->second;
}

}  // namespace

std::string fusion_plugin_path() {
  if (const char* env = std::getenv("BLU_FUSION_PLUGIN"); env && *env) {
    const std::string path = env;
    return path == "none" ? std::string() : path;
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const std::filesystem::path beside = exe.parent_path() / kFusionPluginFile;
  return std::filesystem::exists(beside, ec) ? beside.string() : std::string();
}

FusionFn plugin_fusion_pass(const std::string& path) {
  return [path](const Graph& g) {
    const Plugin& p = load(path);
    std::string no_fuse;
    for (const std::string& name : excluded_ops()) no_fuse += name + "\n";
    char* plan = nullptr;
    char* error = nullptr;
    const int rc = p.fuse(portable_graph_text(g).c_str(), no_fuse.c_str(), &plan, &error);
    const std::string text = plan ? plan : "";
    const std::string why = error ? error : "no message";
    p.release(plan);
    p.release(error);
    BLU_CHECK(rc == 0, "fusion plugin ", path, ": ", why);
    return parse_fusion_plan(g, text);
  };
}

bool fusion_plugin_loaded(const std::string& path) {
  std::lock_guard<std::mutex> lock(plugins_mutex());
  return plugins().count(path) > 0;
}

}  // namespace blu::compiler
