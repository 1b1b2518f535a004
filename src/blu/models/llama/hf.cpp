#include "blu/models/llama/hf.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "blu/core/grad_mode.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::models {

namespace fs = std::filesystem;

// --- config.json ---

namespace {

// Keys of HF's LlamaConfig that describe nothing BluTrain's Llama computes with.
const std::set<std::string> kIgnoredHfKeys = {"_name_or_path", "transformers_version", "torch_dtype", "dtype",
                                              "use_cache",     "bos_token_id",         "eos_token_id", "pad_token_id",
                                              "initializer_range", "pretraining_tp"};
// Keys taken or checked (see llama_config_from_hf).
const std::set<std::string> kUsedHfKeys = {
    "hidden_size",       "intermediate_size",  "num_hidden_layers",       "num_attention_heads",
    "vocab_size",        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    "rope_theta",        "rope_scaling",       "tie_word_embeddings",     "hidden_act",
    "attention_bias",    "mlp_bias",           "attention_dropout",       "head_dim",
    "model_type",        "architectures"};

std::string got_of(const nlohmann::json& hf, const std::string& key) {
  return hf.contains(key) ? hf[key].dump() : std::string("nothing");
}

}  // namespace

nlohmann::json llama_config_from_hf(const nlohmann::json& hf, const std::string& file) {
  BLU_CHECK(hf.is_object(), file, ": expected a JSON object, got ", hf.type_name());
  for (auto& [k, _] : hf.items())
    BLU_CHECK(kUsedHfKeys.count(k) || kIgnoredHfKeys.count(k), file, ": unknown key '", k,
              "' for a Llama config (models/llama/hf.h lists the keys it takes)");
  auto integer = [&](const std::string& key, std::optional<int64_t> fallback = std::nullopt) -> int64_t {
    if (!hf.contains(key) && fallback) return *fallback;
    BLU_CHECK(hf.contains(key) && hf[key].is_number_integer(), file, ": ", key, ": expected an integer, got ",
              got_of(hf, key));
    return hf[key].get<int64_t>();
  };
  auto number = [&](const nlohmann::json& j, const std::string& key, const std::string& field,
                    std::optional<double> fallback = std::nullopt) -> double {
    if (!j.contains(key) && fallback) return *fallback;
    BLU_CHECK(j.contains(key) && j[key].is_number(), file, ": ", field, ": expected a number, got ", got_of(j, key));
    return j[key].get<double>();
  };
  auto expect_value = [&](const std::string& key, const nlohmann::json& want, const std::string& what) {
    if (!hf.contains(key)) return;
    BLU_CHECK(hf[key] == want, file, ": ", key, ": expected ", want.dump(), " (", what, "), got ", hf[key].dump());
  };
  expect_value("model_type", "llama", "a Llama config");
  expect_value("architectures", nlohmann::json::array({"LlamaForCausalLM"}), "the model BluTrain's Llama is");
  expect_value("hidden_act", "silu", "Llama's SwiGLU MLP");
  expect_value("attention_bias", false, "BluTrain's Llama has no biases");
  expect_value("mlp_bias", false, "BluTrain's Llama has no biases");
  if (hf.contains("attention_dropout"))
    BLU_CHECK(number(hf, "attention_dropout", "attention_dropout") == 0.0, file,
              ": attention_dropout: expected 0 (no dropout on attention probabilities), got ",
              hf["attention_dropout"].dump());

  LlamaConfig c;
  c.hidden_size = integer("hidden_size");
  c.intermediate_size = integer("intermediate_size");
  c.num_hidden_layers = integer("num_hidden_layers");
  c.num_attention_heads = integer("num_attention_heads");
  c.vocab_size = integer("vocab_size");
  c.num_key_value_heads = integer("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = integer("max_position_embeddings", 2048);
  c.rms_norm_eps = number(hf, "rms_norm_eps", "rms_norm_eps", 1e-6);
  c.rope_theta = number(hf, "rope_theta", "rope_theta", 10000.0);
  if (hf.contains("tie_word_embeddings")) {
    BLU_CHECK(hf["tie_word_embeddings"].is_boolean(), file, ": tie_word_embeddings: expected true or false, got ",
              hf["tie_word_embeddings"].dump());
    c.tie_word_embeddings = hf["tie_word_embeddings"].get<bool>();
  } else {
    c.tie_word_embeddings = false;
  }
  BLU_CHECK(c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0, file,
            ": num_attention_heads: expected a positive divisor of hidden_size (", c.hidden_size, "), got ",
            c.num_attention_heads);
  BLU_CHECK(c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0, file,
            ": num_key_value_heads: expected a positive divisor of num_attention_heads (", c.num_attention_heads,
            "), got ", c.num_key_value_heads);
  if (hf.contains("head_dim") && !hf["head_dim"].is_null()) {
    BLU_CHECK(hf["head_dim"] == c.hidden_size / c.num_attention_heads, file, ": head_dim: expected ",
              c.hidden_size / c.num_attention_heads, " (hidden_size / num_attention_heads = ", c.hidden_size, " / ",
              c.num_attention_heads, "), got ", hf["head_dim"].dump());
  }
  if (hf.contains("rope_scaling") && !hf["rope_scaling"].is_null()) {
    const nlohmann::json& s = hf["rope_scaling"];
    BLU_CHECK(s.is_object(), file, ": rope_scaling: expected null or an object, got ", s.dump());
    const std::set<std::string> keys = {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings"};
    for (auto& [k, _] : s.items())
      BLU_CHECK(keys.count(k), file, ": rope_scaling: unknown key '", k, "' for llama3 scaling");
    const std::string type_key = s.contains("rope_type") ? "rope_type" : "type";
    BLU_CHECK(s.contains(type_key) && s[type_key] == "llama3", file, ": rope_scaling.", type_key,
              ": expected \"llama3\" (or rope_scaling null), got ", got_of(s, type_key));
    LlamaRopeScaling r;
    r.factor = number(s, "factor", "rope_scaling.factor");
    r.low_freq_factor = number(s, "low_freq_factor", "rope_scaling.low_freq_factor");
    r.high_freq_factor = number(s, "high_freq_factor", "rope_scaling.high_freq_factor");
    BLU_CHECK(s.contains("original_max_position_embeddings") && s["original_max_position_embeddings"].is_number_integer(),
              file, ": rope_scaling.original_max_position_embeddings: expected an integer, got ",
              got_of(s, "original_max_position_embeddings"));
    r.original_max_position_embeddings = s["original_max_position_embeddings"].get<int64_t>();
    c.rope_scaling = r;
  }
  try {
    c.validate();
  } catch (const Error& e) {
    BLU_CHECK(false, file, ": ", e.what());
  }
  return c.to_json();
}

nlohmann::json llama_config_to_hf(const LlamaConfig& c, const std::string& torch_dtype) {
  nlohmann::json scaling = nullptr;
  if (c.rope_scaling) {
    scaling = {{"rope_type", "llama3"},
               {"factor", c.rope_scaling->factor},
               {"low_freq_factor", c.rope_scaling->low_freq_factor},
               {"high_freq_factor", c.rope_scaling->high_freq_factor},
               {"original_max_position_embeddings", c.rope_scaling->original_max_position_embeddings}};
  }
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_act", "silu"},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim()},
          {"vocab_size", c.vocab_size},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", scaling},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"mlp_bias", false},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"initializer_range", 0.02},
          {"torch_dtype", torch_dtype}};
}

// --- import ---

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// The tensors of one checkpoint, each found in exactly one file.
struct Checkpoint {
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::map<std::string, std::pair<const SafeTensorsFile*, const TensorEntry*>> tensors;
  std::string where;  // the file or index, for errors
};

Checkpoint open_single(const std::string& path) {
  Checkpoint c;
  c.where = path;
  c.files.push_back(std::make_unique<SafeTensorsFile>(SafeTensorsFile::open(path)));
  for (const TensorEntry& e : c.files[0]->entries()) c.tensors[e.name] = {c.files[0].get(), &e};
  return c;
}

Checkpoint open_sharded(const fs::path& index_path) {
  Checkpoint c;
  c.where = index_path.string();
  const nlohmann::json index = io::read_json_file(index_path);
  BLU_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), c.where,
            ": weight_map: expected an object of tensor name → file, got ",
            index.is_object() && index.contains("weight_map") ? index["weight_map"].dump() : std::string("nothing"));
  const nlohmann::json& map = index["weight_map"];
  BLU_CHECK(!map.empty(), c.where, ": weight_map is empty");
  std::map<std::string, std::string> file_of;  // tensor → shard file name
  std::map<std::string, const SafeTensorsFile*> shards;
  for (auto& [name, f] : map.items()) {
    BLU_CHECK(f.is_string(), c.where, ": weight_map['", name, "']: expected a file name, got ", f.dump());
    const std::string file = f.get<std::string>();
    BLU_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", c.where,
              ": weight_map['", name, "']: expected a file name in the index's folder, got \"", file, "\"");
    file_of[name] = file;
    if (!shards.count(file)) {
      c.files.push_back(std::make_unique<SafeTensorsFile>(
          SafeTensorsFile::open((index_path.parent_path() / file).string())));
      shards[file] = c.files.back().get();
    }
  }
  // Every shard's tensors are listed, and listed for that shard: so each tensor is in one file.
  for (auto& [file, shard] : shards) {
    for (const TensorEntry& e : shard->entries()) {
      auto it = file_of.find(e.name);
      BLU_CHECK(it != file_of.end(), shard->source(), ": tensor '", e.name, "' is not in the weight_map of ",
                c.where);
      BLU_CHECK(it->second == file, shard->source(), ": tensor '", e.name, "' is also here, but ", c.where,
                " maps it to ", it->second, " (every tensor must be in exactly one file)");
      c.tensors[e.name] = {shard, &e};
    }
  }
  for (auto& [name, file] : file_of)
    BLU_CHECK(c.tensors.count(name), c.where, ": weight_map puts '", name, "' in ", file,
              ", which has no such tensor");
  return c;
}

Checkpoint open_checkpoint(const std::string& path) {
  if (!fs::is_directory(path)) {
    BLU_CHECK(fs::is_regular_file(path), path, ": no such file or folder (expected a .safetensors file or a folder "
              "with ", kSingleFile, " or ", kIndexFile, ")");
    return open_single(path);
  }
  const fs::path dir(path);
  if (fs::is_regular_file(dir / kSingleFile)) return open_single((dir / kSingleFile).string());
  BLU_CHECK(fs::is_regular_file(dir / kIndexFile), path, ": expected ", kSingleFile, " or ", kIndexFile,
            " in the folder, found neither");
  return open_sharded(dir / kIndexFile);
}

Tensor read_tensor(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());  // may be misaligned in the map
  return t;
}

std::string shapes_of(const LlamaConfig& c) {
  return "hidden_size " + std::to_string(c.hidden_size) + ", num_attention_heads " +
         std::to_string(c.num_attention_heads) + ", num_key_value_heads " + std::to_string(c.num_key_value_heads) +
         ", intermediate_size " + std::to_string(c.intermediate_size) + ", vocab_size " +
         std::to_string(c.vocab_size);
}

}  // namespace

void import_hf_llama(Llama& model, const std::string& path) {
  const LlamaConfig& cfg = model.llama_config();
  const Checkpoint ck = open_checkpoint(path);
  // Check everything before writing anything.
  const nn::NamedTensors params = model.state_dict();
  std::set<std::string> wanted;
  for (auto& [name, p] : params) {
    wanted.insert(name);
    auto it = ck.tensors.find(name);
    BLU_CHECK(it != ck.tensors.end(), ck.where, ": no tensor '", name, "' (expected shape ", p.shape(), " for ",
              shapes_of(cfg), ")");
    const auto& [file, e] = it->second;
    BLU_CHECK(Shape(e->shape) == p.shape(), file->source(), ": tensor '", name, "' has shape ", Shape(e->shape),
              ", expected ", p.shape(), " (config: ", shapes_of(cfg), ")");
    BLU_CHECK(e->dtype == DType::f32 || e->dtype == DType::bf16 || e->dtype == DType::f16, file->source(),
              ": tensor '", name, "' has dtype ", safetensors_dtype_name(e->dtype), ", expected F32, BF16 or F16");
  }
  for (auto& [name, loc] : ck.tensors) {
    if (wanted.count(name) || name.ends_with(".rotary_emb.inv_freq")) continue;
    const auto& [file, e] = loc;
    if (name == "lm_head.weight" && cfg.tie_word_embeddings) {
      // A tied checkpoint may carry the head; it must be the embedding.
      const auto& [efile, emb] = ck.tensors.at("model.embed_tokens.weight");
      bool same = Shape(e->shape) == Shape(emb->shape);
      if (same) {
        const Tensor a = to_dtype(read_tensor(*file, *e), DType::f32);
        const Tensor b = to_dtype(read_tensor(*efile, *emb), DType::f32);
        same = std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
      }
      BLU_CHECK(same, file->source(), ": tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' in ",
                efile->source(), ", expected equal (the config ties the head to the embedding)");
      continue;
    }
    BLU_CHECK(false, file->source(), ": unexpected tensor '", name, "' (shape ", Shape(e->shape), "; config: ",
              shapes_of(cfg), cfg.tie_word_embeddings ? ", tied head" : ", untied head", ")");
  }
  NoGradGuard no_grad;
  for (auto& [name, p] : params) {
    const auto& [file, e] = ck.tensors.at(name);
    copy_(p, to_device(read_tensor(*file, *e), p.device()));  // cast to the parameter's dtype
  }
}

// --- export ---

namespace {

bool is_model_file(const std::string& name) {
  if (name == kSingleFile || name == kIndexFile) return true;
  return name.starts_with("model-") && name.ends_with(".safetensors") && name.find("-of-") != std::string::npos;
}

std::string torch_dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    default: break;
  }
  BLU_CHECK(false, "export_hf_llama: parameters of dtype ", d, " (expected f32, bf16 or f16)");
  return {};
}

}  // namespace

void export_hf_llama(const Llama& model, const std::string& dir, const LlamaExportOptions& options) {
  BLU_CHECK(options.max_shard_bytes >= 0, "export_hf_llama: max_shard_bytes must be >= 0, got ",
            options.max_shard_bytes);
  const fs::path root(dir);
  if (fs::exists(root)) {
    BLU_CHECK(fs::is_directory(root), "export_hf_llama: ", dir, " exists and is not a folder");
    BLU_CHECK(options.overwrite || fs::is_empty(root), "export_hf_llama: ", dir,
              " is not empty (expected a new or empty folder; pass overwrite to replace its model files)");
  }
  fs::create_directories(root);

  // Host copies, kept alive until the writers are done.
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& [name, p] : model.state_dict()) tensors.emplace_back(name, contiguous(to_device(p.detach(), kCPU)));
  const DType dtype = tensors.front().second.dtype();
  for (auto& [name, t] : tensors)
    BLU_CHECK(t.dtype() == dtype, "export_hf_llama: '", name, "' has dtype ", t.dtype(), ", the others ", dtype,
              " (expected one dtype)");
  const std::string torch_dtype = torch_dtype_name(dtype);
  auto add = [](SafeTensorsWriter& w, const std::string& name, const Tensor& t) {
    w.add(name, t.dtype(), t.shape(), {static_cast<const std::byte*>(t.raw_data()), t.nbytes()});
  };

  std::set<std::string> written;
  if (options.max_shard_bytes == 0) {
    SafeTensorsWriter w;
    for (auto& [name, t] : tensors) add(w, name, t);
    w.set_metadata("format", "pt");
    w.write((root / kSingleFile).string());
    written.insert(kSingleFile);
  } else {
    // Greedy in state-dict order (layer by layer): a shard closes when the next tensor would
    // overflow it.
    std::vector<std::vector<size_t>> shards(1);
    int64_t bytes = 0, total = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int64_t n = int64_t(tensors[i].second.nbytes());
      if (!shards.back().empty() && bytes + n > options.max_shard_bytes) shards.emplace_back(), bytes = 0;
      shards.back().push_back(i);
      bytes += n, total += n;
    }
    nlohmann::json weight_map = nlohmann::json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      char file[64];
      std::snprintf(file, sizeof file, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      SafeTensorsWriter w;
      for (size_t i : shards[s]) {
        add(w, tensors[i].first, tensors[i].second);
        weight_map[tensors[i].first] = file;
      }
      w.set_metadata("format", "pt");
      w.write((root / file).string());
      written.insert(file);
    }
    const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    io::write_file_atomic(root / kIndexFile, index.dump(2) + "\n");
    written.insert(kIndexFile);
  }
  // Model files of an earlier export that this one did not write would contradict it.
  if (options.overwrite) {
    for (const auto& entry : fs::directory_iterator(root)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && is_model_file(name) && !written.count(name)) fs::remove(entry.path());
    }
  }
  io::write_file_atomic(root / "config.json", llama_config_to_hf(model.llama_config(), torch_dtype).dump(2) + "\n");
}

}  // namespace blu::models
