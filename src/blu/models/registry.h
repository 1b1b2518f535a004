// models/registry: model families by name, and how a user names a model.
//   A family registers a builder (config JSON → model), its presets and, optionally, a reader of
//   Hugging Face `config.json` and weight import/export (models/hf.h).
//   A model spec, as `--model` takes it: "FAMILY:PRESET" ("gpt2:d12", "llama:smollm-135m"), a
//   bare GPT-2 preset ("d12", "tiny": the names the CLI has always taken), a Hugging Face model
//   folder (config.json, *.safetensors, tokenizer.json) or a config.json path.
// Depends on models/causal_lm, nlohmann-json. Keep: resolve_model_config(spec) always gives the same
// config for the same spec; build_model(config, seed) is deterministic; every error names the
// spec, the file or the field with expected vs got.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "blu/models/causal_lm.h"

namespace blu::models {

struct ModelFamily {
  std::string name;  // "gpt2"
  // Builds a model from its config (with or without the "family" key); BLU_CHECK on bad configs.
  std::function<std::unique_ptr<CausalLM>(const nlohmann::json& config, uint64_t seed)> build;
  // Preset names in the order `blutrain info` lists them, and each one's config.
  std::vector<std::string> presets;
  std::function<nlohmann::json(const std::string& preset)> preset;
  // Hugging Face: the config of a config.json object (file names the file in errors); null if the
  // family has no Hugging Face interop. `architectures` values this family claims.
  std::vector<std::string> hf_architectures;
  std::function<nlohmann::json(const nlohmann::json& hf_config, const std::string& file)> from_hf_config;
  // Loads Hugging Face safetensors (a file, or a folder with model.safetensors or a sharded index)
  // into a model of this family; writes them (model.safetensors + config.json) into a folder.
  std::function<void(CausalLM& model, const std::string& path)> import_hf;
  std::function<void(const CausalLM& model, const std::string& dir)> export_hf;
};

// Adds a family (at static init: BLU_REGISTER_MODEL_FAMILY). A second family of one name is an error.
void register_family(ModelFamily family);
const ModelFamily& family(const std::string& name);  // BLU_CHECK listing the known families
std::vector<std::string> family_names();

// The family a config names ("family" key; a config without one is GPT-2's, as checkpoints
// written before other families existed).
std::string family_of(const nlohmann::json& config);
std::unique_ptr<CausalLM> build_model(const nlohmann::json& config, uint64_t seed = 1337);

// The config a model spec names (see the header comment).
nlohmann::json resolve_model_config(const std::string& spec);
// Whether spec names a Hugging Face folder or config.json (its weights can then be imported).
bool is_hf_spec(const std::string& spec);
// The folder of an HF spec (the spec itself, or the config.json's folder).
std::string hf_folder(const std::string& spec);

}  // namespace blu::models

#define BLU_REGISTER_MODEL_FAMILY(make_family)                                            \
  static const bool BLU_CONCAT(blu_model_family_, __COUNTER__) = [] {                     \
    ::blu::models::register_family(make_family());                                       \
    return true;                                                                          \
  }()
