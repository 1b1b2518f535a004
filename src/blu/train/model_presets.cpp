#include "blu/train/model_presets.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "blu/core/error.h"
#include "blu/io/safetensors.h"

namespace blu::train {

namespace {

nn::GPTConfig small_gpt2_vocab(int64_t n_layer, int64_t n_head, int64_t n_embd, int64_t block_size) {
  nn::GPTConfig c;  // GPT-2 vocabulary and padding, no dropout, biases
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = n_embd;
  c.block_size = block_size;
  return c;
}

// A "model_config" object inside a JSON value, at the top or one level down.
const nlohmann::json* find_model_config(const nlohmann::json& j) {
  if (!j.is_object()) return nullptr;
  if (auto it = j.find("model_config"); it != j.end() && it->is_object()) return &*it;
  for (const auto& [key, value] : j.items())
    if (value.is_object())
      if (auto it = value.find("model_config"); it != value.end() && it->is_object()) return &*it;
  return nullptr;
}

}  // namespace

std::vector<std::string> model_preset_names() { return {"tiny", "demo", "d12", "d24", "d36", "d48"}; }

nn::GPTConfig model_preset(const std::string& name) {
  if (name == "tiny") return small_gpt2_vocab(2, 2, 64, 64);
  if (name == "demo") return small_gpt2_vocab(4, 4, 128, 128);
  if (name == "d12" || name == "d24" || name == "d36" || name == "d48") return nn::GPTConfig::preset(name);
  std::string known;
  for (const auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  BLU_CHECK(false, "unknown model preset '", name, "': expected one of ", known);
  return {};
}

nn::GPTConfig apply_overrides(nn::GPTConfig cfg, const ModelOverrides& o) {
  if (o.n_layer > 0) cfg.n_layer = o.n_layer;
  if (o.n_head > 0) cfg.n_head = o.n_head;
  if (o.n_embd > 0) cfg.n_embd = o.n_embd;
  if (o.block_size > 0) cfg.block_size = o.block_size;
  BLU_CHECK(cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head: got n_embd ", cfg.n_embd,
            ", n_head ", cfg.n_head);
  return cfg;
}

nn::GPTConfig checkpoint_model_config(const std::string& checkpoint_path) {
  namespace fs = std::filesystem;
  BLU_CHECK(fs::is_regular_file(checkpoint_path), "checkpoint file not found: ", checkpoint_path);
  {
    const SafeTensorsFile file = SafeTensorsFile::open(checkpoint_path);
    for (const auto& [key, value] : file.metadata()) {
      const auto j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;
      if (key == "model_config" && j.is_object()) return nn::GPTConfig::from_json(j);
      if (const auto* mc = find_model_config(j)) return nn::GPTConfig::from_json(*mc);
    }
  }
  const fs::path run_json = fs::path(checkpoint_path).parent_path() / "run.json";
  if (fs::is_regular_file(run_json)) {
    std::ifstream in(run_json);
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (const auto* mc = j.is_discarded() ? nullptr : find_model_config(j)) return nn::GPTConfig::from_json(*mc);
  }
  BLU_CHECK(false, "no model configuration found for checkpoint ", checkpoint_path,
            ": expected a \"model_config\" in its metadata or in ", run_json.string());
  return {};
}

}  // namespace blu::train
