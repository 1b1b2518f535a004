#include "blu/models/gpt2/hf.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "blu/core/grad_mode.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/view.h"

namespace blu::models {
namespace {

// The four projections HF stores as Conv1D ([in, out]).
bool is_conv1d_weight(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.ends_with(s)) return true;
  return false;
}

bool is_ignored_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
}

Tensor read_entry(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());  // may be misaligned in the map
  return t;
}

}  // namespace

void import_hf_gpt2(const std::string& path, GPT& model) {
  const GPTConfig& cfg = model.gpt_config();
  BLU_CHECK(cfg.bias, "import_hf_gpt2: HF GPT-2 has biases; the model was built with bias = false");
  SafeTensorsFile f = SafeTensorsFile::open(path);
  const std::string prefix = f.find("transformer.wte.weight") ? "transformer." : "";

  NoGradGuard no_grad;
  nn::NamedTensors state;
  std::set<std::string> used;
  for (auto& [name, param] : model.state_dict()) {
    const std::string hf = prefix + name;
    const TensorEntry* e = f.find(hf);
    BLU_CHECK(e, "import_hf_gpt2: ", path, " has no tensor '", hf, "'");
    used.insert(hf);
    const Shape& want = param.shape();
    Shape expect = want;  // in the file's layout
    if (is_conv1d_weight(name)) expect = {want[1], want[0]};
    const bool wte = name == "wte.weight";
    if (wte) expect = {cfg.vocab_size, want[1]};
    const bool padded_wte = wte && e->shape == want;  // a file that keeps the padding is fine too
    BLU_CHECK(e->shape == expect || padded_wte, "import_hf_gpt2: '", hf, "' has shape ", e->shape,
              ", expected ", expect, " (config: ", cfg.to_json().dump(), ")");
    BLU_CHECK(is_floating(e->dtype), "import_hf_gpt2: '", hf, "' has dtype ", e->dtype, ", expected a float");
    Tensor t = read_entry(f, *e);
    if (is_conv1d_weight(name)) t = transpose(t, 0, 1);
    if (wte && !padded_wte && cfg.padded_vocab_size > cfg.vocab_size) {
      t = cat({t, zeros({cfg.padded_vocab_size - cfg.vocab_size, want[1]}, t.dtype())}, 0);
    }
    state.emplace_back(name, t);
  }
  for (const TensorEntry& e : f.entries()) {
    if (used.count(e.name)) continue;
    const std::string name = e.name.starts_with(prefix) ? e.name.substr(prefix.size()) : e.name;
    if (is_ignored_buffer(name)) continue;
    if (name == "lm_head.weight" || e.name == "lm_head.weight") {
      // Tied: must equal wte (HF writes it in some exports).
      const TensorEntry& w = f.at(prefix + "wte.weight");
      BLU_CHECK(e.shape == w.shape && e.dtype == w.dtype &&
                    std::memcmp(f.bytes(e).data(), f.bytes(w).data(), e.nbytes()) == 0,
                "import_hf_gpt2: '", e.name, "' differs from '", w.name,
                "' (BluTrain's GPT ties the output projection to wte)");
      continue;
    }
    BLU_CHECK(false, "import_hf_gpt2: unexpected tensor '", e.name, "' in ", path, " (shape ", e.shape,
              "; config: ", cfg.to_json().dump(), ")");
  }
  model.load_state_dict(state);
}

void export_hf_gpt2(const GPT& model, const std::string& path) {
  const GPTConfig& cfg = model.gpt_config();
  std::vector<std::pair<std::string, Tensor>> out;  // kept alive until write() returns
  for (auto& [name, p] : model.state_dict()) {
    BLU_CHECK(p.device().is_cpu(), "export_hf_gpt2: '", name, "' is on ", p.device(), ", expected cpu");
    Tensor t = p.detach();
    if (is_conv1d_weight(name)) t = transpose(t, 0, 1);
    if (name == "wte.weight") t = narrow(t, 0, 0, cfg.vocab_size);
    out.emplace_back(name, contiguous(t));
  }
  SafeTensorsWriter w;
  for (auto& [name, t] : out)
    w.add(name, t.dtype(), t.shape(), {static_cast<const std::byte*>(t.raw_data()), t.nbytes()});
  w.set_metadata("format", "pt");
  w.write(path);
}

namespace {

// Keys of a Hugging Face GPT-2 config.json that carry nothing BluTrain's GPT needs to know (or are
// checked below); anything else is refused.
const std::set<std::string> kIgnoredHfKeys = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "initializer_range", "summary_type", "summary_use_proj",
    "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "task_specific_params",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "n_ctx",
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "activation_function", "layer_norm_epsilon", "n_inner",
    "n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "tie_word_embeddings"};

}  // namespace

nlohmann::json gpt2_config_from_hf(const nlohmann::json& hf, const std::string& file) {
  BLU_CHECK(hf.is_object(), file, ": expected a JSON object, got ", hf.type_name());
  for (auto& [k, _] : hf.items())
    BLU_CHECK(kIgnoredHfKeys.count(k), file, ": unknown key '", k, "' for a GPT-2 config");
  auto get = [&](const char* key) -> int64_t {
    BLU_CHECK(hf.contains(key) && hf[key].is_number_integer(), file, ": ", key, ": expected an integer, got ",
              hf.contains(key) ? hf[key].dump() : std::string("nothing"));
    return hf[key].get<int64_t>();
  };
  // Each value's type checked before it is read: a get<> of the wrong type throws nlohmann's error,
  // which names neither the file nor the key.
  if (hf.contains("activation_function")) {
    const nlohmann::json& act = hf["activation_function"];
    BLU_CHECK(act.is_string() && (act == "gelu_new" || act == "gelu_pytorch_tanh"), file,
              ": activation_function: expected \"gelu_new\" (tanh GELU), got ", act.dump());
  }
  if (hf.contains("layer_norm_epsilon")) {
    const nlohmann::json& eps = hf["layer_norm_epsilon"];
    BLU_CHECK(eps.is_number() && eps.get<double>() == 1e-5, file, ": layer_norm_epsilon: expected 1e-05, got ",
              eps.dump());
  }
  if (hf.contains("tie_word_embeddings"))
    BLU_CHECK(hf["tie_word_embeddings"] == true, file, ": tie_word_embeddings: expected true (GPT-2 ties them), got ",
              hf["tie_word_embeddings"].dump());
  GPTConfig c;
  c.n_embd = get("n_embd");
  c.n_head = get("n_head");
  c.n_layer = get("n_layer");
  c.block_size = get("n_positions");
  c.vocab_size = get("vocab_size");
  c.padded_vocab_size = (c.vocab_size + 63) / 64 * 64;
  if (hf.contains("n_inner") && !hf["n_inner"].is_null())
    BLU_CHECK(hf["n_inner"] == 4 * c.n_embd, file, ": n_inner: expected null or ", 4 * c.n_embd, " (4 x n_embd), got ",
              hf["n_inner"].dump());
  c.dropout = 0.0;
  try {
    c.validate();
  } catch (const Error& e) {
    BLU_CHECK(false, file, ": ", e.what());
  }
  return c.to_json();
}

std::string hf_weights_file(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return path;
  const fs::path f = fs::path(path) / "model.safetensors";
  BLU_CHECK(fs::is_regular_file(f), path, ": expected model.safetensors in the folder, found none");
  return f.string();
}

void export_hf_gpt2_folder(const GPT& model, const std::string& dir) {
  namespace fs = std::filesystem;
  const GPTConfig& c = model.gpt_config();
  fs::create_directories(dir);
  export_hf_gpt2(model, (fs::path(dir) / "model.safetensors").string());
  const nlohmann::json hf = {{"architectures", {"GPT2LMHeadModel"}},
                             {"model_type", "gpt2"},
                             {"activation_function", "gelu_new"},
                             {"layer_norm_epsilon", 1e-5},
                             {"n_embd", c.n_embd},
                             {"n_head", c.n_head},
                             {"n_layer", c.n_layer},
                             {"n_positions", c.block_size},
                             {"n_ctx", c.block_size},
                             {"vocab_size", c.vocab_size},
                             {"tie_word_embeddings", true}};
  io::write_json_file(fs::path(dir) / "config.json", hf);
}

}  // namespace blu::models
