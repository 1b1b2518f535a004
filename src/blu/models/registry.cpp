#include "blu/models/registry.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "blu/core/error.h"
#include "blu/io/json_file.h"

namespace blu::models {

namespace fs = std::filesystem;

namespace {

std::map<std::string, ModelFamily>& families() {
  static std::map<std::string, ModelFamily> f;
  return f;
}

std::string known_families() {
  std::string s;
  for (const auto& [name, _] : families()) s += (s.empty() ? "" : ", ") + name;
  return s;
}

// The family whose hf_architectures (or model_type) a Hugging Face config names.
const ModelFamily& hf_family(const nlohmann::json& hf, const std::string& file) {
  BLU_CHECK(hf.is_object(), file, ": expected a JSON object");
  std::vector<std::string> claimed;
  if (auto it = hf.find("architectures"); it != hf.end() && it->is_array())
    for (const auto& a : *it)
      if (a.is_string()) claimed.push_back(a.get<std::string>());
  // model_type is read only when it is a string (json::value would throw a bare type_error).
  const auto mt = hf.find("model_type");
  const std::string model_type = mt != hf.end() && mt->is_string() ? mt->get<std::string>() : "";
  for (const auto& [name, fam] : families()) {
    if (!fam.from_hf_config) continue;
    for (const auto& a : claimed)
      for (const auto& mine : fam.hf_architectures)
        if (a == mine) return fam;
    if (claimed.empty() && model_type == name) return fam;
  }
  std::string supported;
  for (const auto& [name, fam] : families())
    for (const auto& a : fam.hf_architectures) supported += (supported.empty() ? "" : ", ") + a;
  BLU_CHECK(false, file, ": architectures: expected one of ", supported, ", got ",
            hf.contains("architectures") ? hf["architectures"].dump() : std::string("none"));
  return families().begin()->second;
}

}  // namespace

void register_family(ModelFamily f) {
  BLU_ASSERT(!f.name.empty() && f.build, "a model family needs a name and a builder");
  const std::string name = f.name;
  BLU_ASSERT(families().emplace(name, std::move(f)).second, "model family '", name, "' registered twice");
}

const ModelFamily& family(const std::string& name) {
  auto it = families().find(name);
  BLU_CHECK(it != families().end(), "unknown model family '", name, "': expected one of ", known_families());
  return it->second;
}

std::vector<std::string> family_names() {
  std::vector<std::string> out;
  for (const auto& [name, _] : families()) out.push_back(name);
  return out;
}

std::string family_of(const nlohmann::json& config) {
  BLU_CHECK(config.is_object(), "model config: expected a JSON object, got ", config.dump());
  if (!config.contains("family")) return "gpt2";
  BLU_CHECK(config["family"].is_string(), "model config: family: expected a string, got ", config["family"].dump());
  return config["family"].get<std::string>();
}

std::unique_ptr<CausalLM> build_model(const nlohmann::json& config, uint64_t seed) {
  return family(family_of(config)).build(config, seed);
}

bool is_hf_spec(const std::string& spec) {
  return fs::is_directory(spec) || (spec.ends_with(".json") && fs::is_regular_file(spec));
}

std::string hf_folder(const std::string& spec) {
  return fs::is_directory(spec) ? spec : fs::path(spec).parent_path().string();
}

nlohmann::json resolve_model_config(const std::string& spec) {
  BLU_CHECK(!spec.empty(), "--model: expected FAMILY:PRESET (e.g. gpt2:d12, llama:smollm-135m), a GPT-2 preset, ",
            "or a Hugging Face model folder; got nothing");
  if (is_hf_spec(spec)) {
    const fs::path file = fs::is_directory(spec) ? fs::path(spec) / "config.json" : fs::path(spec);
    BLU_CHECK(fs::is_regular_file(file), spec, ": expected a config.json in the model folder, found none");
    const nlohmann::json hf = io::read_json_file(file);
    return hf_family(hf, file.string()).from_hf_config(hf, file.string());
  }
  const size_t colon = spec.find(':');
  if (colon == std::string::npos) {  // a bare preset: GPT-2's names
    const ModelFamily& gpt2 = family("gpt2");
    for (const auto& p : gpt2.presets)
      if (p == spec) return gpt2.preset(spec);
    std::string known;
    for (const auto& [name, fam] : families())
      for (const auto& p : fam.presets) known += (known.empty() ? "" : ", ") + name + ":" + p;
    BLU_CHECK(false, "--model '", spec, "': not a preset, a model folder or a config.json; expected one of ", known,
              " (bare names are GPT-2's), or a path");
  }
  const ModelFamily& fam = family(spec.substr(0, colon));
  const std::string preset = spec.substr(colon + 1);
  for (const auto& p : fam.presets)
    if (p == preset) return fam.preset(preset);
  std::string known;
  for (const auto& p : fam.presets) known += (known.empty() ? "" : ", ") + p;
  BLU_CHECK(false, "--model '", spec, "': unknown ", fam.name, " preset '", preset, "'; expected one of ", known);
  return {};
}

}  // namespace blu::models
