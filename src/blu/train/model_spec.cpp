#include "blu/train/model_spec.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "blu/core/error.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/io/checkpoint.h"
#include "blu/io/safetensors.h"
#include "blu/models/registry.h"

namespace blu::train {

namespace {

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

nlohmann::json apply_overrides(nlohmann::json cfg, const ModelOverrides& o) {
  const std::string fam = models::family_of(cfg);
  // GPT-2's key, or Hugging Face's name of the same thing (Llama's config uses those).
  auto set = [&](const char* key, const char* hf_key, const char* flag, int64_t v) {
    if (v <= 0) return;
    const char* k = cfg.contains(key) ? key : hf_key;
    BLU_CHECK(cfg.contains(k), flag, ": the ", fam, " config has neither '", key, "' nor '", hf_key, "' to override");
    cfg[k] = v;
  };
  set("n_layer", "num_hidden_layers", "--n-layer", o.n_layer);
  set("n_head", "num_attention_heads", "--n-head", o.n_head);
  set("n_embd", "hidden_size", "--n-embd", o.n_embd);
  set("block_size", "max_position_embeddings", "--block-size", o.block_size);
  models::build_model(cfg, 0).reset();  // the family validates the result (e.g. heads divide the width)
  return cfg;
}

nlohmann::json checkpoint_model_config(const std::string& checkpoint_path) {
  namespace fs = std::filesystem;
  BLU_CHECK(fs::is_regular_file(checkpoint_path), "checkpoint file not found: ", checkpoint_path);
  {
    const SafeTensorsFile file = SafeTensorsFile::open(checkpoint_path);
    for (const auto& [key, value] : file.metadata()) {
      const auto j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;
      if (key == "model_config" && j.is_object()) return j;
      if (const auto* mc = find_model_config(j)) return *mc;
    }
  }
  const fs::path run_json = fs::path(checkpoint_path).parent_path() / "run.json";
  if (fs::is_regular_file(run_json)) {
    std::ifstream in(run_json);
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (const auto* mc = j.is_discarded() ? nullptr : find_model_config(j)) return *mc;
  }
  BLU_CHECK(false, "no model configuration found for checkpoint ", checkpoint_path,
            ": expected a \"model_config\" in its metadata or in ", run_json.string());
  return {};
}

std::string checkpoint_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  const std::string ckpt = fs::is_directory(path) ? latest_checkpoint(path) : path;
  const auto tokenizer_of = [](const nlohmann::json& j) -> std::string {
    if (!j.is_object()) return "";
    const auto run = j.find("run");
    const nlohmann::json& opts = run != j.end() ? *run : (j.contains("options") ? j["options"] : j);
    return opts.is_object() && opts.contains("tokenizer") && opts["tokenizer"].is_string()
               ? opts["tokenizer"].get<std::string>()
               : "";
  };
  if (!ckpt.empty() && fs::is_regular_file(ckpt)) {
    const SafeTensorsFile file = SafeTensorsFile::open(ckpt);
    for (const auto& [key, value] : file.metadata()) {
      const auto j = nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) continue;
      if (const std::string t = tokenizer_of(j); !t.empty()) return t;
    }
  }
  const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  if (fs::is_regular_file(dir / "run.json")) {
    std::ifstream in(dir / "run.json");
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) return tokenizer_of(j);
  }
  return "";
}

namespace {

bool is_hf_folder(const std::string& path) {
  namespace fs = std::filesystem;
  return fs::is_directory(path) && fs::is_regular_file(fs::path(path) / "config.json");
}

// A checkpoint file, or a run directory's newest checkpoint that verifies.
std::string init_checkpoint(const std::string& source) {
  namespace fs = std::filesystem;
  BLU_CHECK(fs::exists(source), "--init-from: expected a Hugging Face folder, a checkpoint or a run directory, got '",
            source, "' (not found)");
  if (!fs::is_directory(source)) return source;
  std::string reasons;
  const std::string ckpt = latest_valid_checkpoint(source, [&](const std::string& w) { reasons += "\n  " + w; });
  BLU_CHECK(!ckpt.empty(), "--init-from ", source, ": expected a config.json (a Hugging Face folder) or a single-file ",
            "checkpoint (ckpt_*.safetensors) in the folder, ",
            reasons.empty() ? std::string("found neither") : "and no checkpoint verifies:" + reasons);
  return ckpt;
}

}  // namespace

nlohmann::json init_source_config(const std::string& source) {
  if (is_hf_folder(source)) return models::resolve_model_config(source);
  return checkpoint_model_config(init_checkpoint(source));
}

void init_weights(models::CausalLM& model, const std::string& source, const nlohmann::json& config) {
  if (is_hf_folder(source)) {
    const auto& fam = models::family(models::family_of(config));
    BLU_CHECK(fam.import_hf, "--init-from ", source, ": the ", fam.name, " family has no Hugging Face weight import");
    fam.import_hf(model, source);
    return;
  }
  load_checkpoint(init_checkpoint(source), model, nullptr, config);
}

std::unique_ptr<models::CausalLM> load_model(const std::string& path, Device device) {
  namespace fs = std::filesystem;
  std::unique_ptr<models::CausalLM> model;
  if (fs::is_directory(path) && fs::is_regular_file(fs::path(path) / "config.json")) {
    const nlohmann::json cfg = models::resolve_model_config(path);
    model = models::build_model(cfg);
    const auto& fam = models::family(models::family_of(cfg));
    BLU_CHECK(fam.import_hf, path, ": the ", fam.name, " family has no Hugging Face weight import");
    fam.import_hf(*model, path);
  } else {
    std::string ckpt = path;
    if (fs::is_directory(path) && !dist::is_layout_checkpoint(path)) {
      ckpt = dist::latest_any_checkpoint(path);
      BLU_CHECK(!ckpt.empty(), "expected checkpoints (ckpt_*.safetensors, or a layout's ckpt_* folders) or a config.json in ",
                path, ", found neither");
    }
    if (dist::is_layout_checkpoint(ckpt)) {
      // A parallel layout's pieces, put together by their global names on this one process: every
      // parameter held whole, no optimizer state read.
      const dist::LayoutCheckpoint ck(ckpt);
      model = models::build_model(ck.train_state().model_config);
      std::vector<dist::HeldParameter> held;
      for (const auto& [name, p] : model->named_parameters()) held.push_back({name, p, p.shape(), -1, {}, true});
      ck.load_held(held, nullptr);
    } else {
      BLU_CHECK(fs::is_regular_file(ckpt), "checkpoint not found: expected a file or a run directory, got '", ckpt, "'");
      const nlohmann::json cfg = checkpoint_model_config(ckpt);
      model = models::build_model(cfg);
      load_checkpoint(ckpt, *model, nullptr, cfg);
    }
  }
  if (device != kCPU) model->to(device);
  model->eval();
  return model;
}

}  // namespace blu::train
