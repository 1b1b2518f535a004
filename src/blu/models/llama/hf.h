// models/llama/hf: Llama to and from Hugging Face — config.json ↔ LlamaConfig, and the weights as
// HF's LlamaForCausalLM stores them (the names are BluTrain's own, models/llama/llama.h, and so are
// the layouts: nn.Linear [out, in], no transposes), in one model.safetensors or in shards listed by
// model.safetensors.index.json.
// Depends on models/llama, io/safetensors, nlohmann-json, std::filesystem. Keep: import is strict
// and checks everything before it writes anything (every tensor present exactly once, shapes
// against the config, dtypes F32/BF16/F16; errors name the file and the tensor with expected vs
// got), so a failed import leaves the model unchanged; every file export writes goes to a
// temporary name and is renamed into place; export never writes into a non-empty folder unless
// asked; export then import is bit-exact.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "blu/models/llama/llama.h"

namespace blu::models {

// The Llama config (LlamaConfig::to_json) of a Hugging Face config.json object read from `file`.
// Taken: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size
// (required); num_key_value_heads (default: num_attention_heads), max_position_embeddings (2048),
// rms_norm_eps (1e-6), rope_theta (10000), rope_scaling (null, or {"rope_type"/"type": "llama3",
// factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}),
// tie_word_embeddings (false) — HF's LlamaConfig defaults. Checked: hidden_act "silu",
// attention_bias and mlp_bias false, attention_dropout 0, head_dim (if present and not null)
// hidden_size / num_attention_heads, model_type "llama", architectures ["LlamaForCausalLM"].
// Accepted and ignored: _name_or_path, transformers_version, torch_dtype, dtype, use_cache,
// bos_token_id, eos_token_id, pad_token_id, initializer_range, pretraining_tp. Any other key is an
// error naming the file and the key; a bad value names the file, the field, expected and got.
nlohmann::json llama_config_from_hf(const nlohmann::json& hf, const std::string& file);
// The HF config.json object of a config (architectures ["LlamaForCausalLM"], model_type "llama",
// …); `torch_dtype` names the weights' dtype ("float32", "bfloat16", "float16").
nlohmann::json llama_config_to_hf(const LlamaConfig& cfg, const std::string& torch_dtype = "float32");

// Loads HF weights into `model`: `path` is a .safetensors file, or a folder holding
// model.safetensors or (sharded) model.safetensors.index.json with its shards. The index's
// weight_map must name every tensor of every shard it lists, each in exactly one file. Tensors
// are F32, BF16 or F16 and are cast to the parameters' dtypes. A tied model takes a file with or
// without lm_head.weight (when present it must equal model.embed_tokens.weight); buffers HF
// checkpoints may carry (*.rotary_emb.inv_freq) are ignored; anything else unexpected is an error.
void import_hf_llama(Llama& model, const std::string& path);

struct LlamaExportOptions {
  // > 0: shards of at most this many bytes (a larger tensor gets a shard of its own), named
  // model-00001-of-0000N.safetensors, with model.safetensors.index.json; 0: one model.safetensors.
  int64_t max_shard_bytes = 0;
  // Write into a folder that already holds files (model*.safetensors and the index it had are
  // replaced; other files are left alone). Without it a non-empty folder is an error.
  bool overwrite = false;
};
// Writes config.json and the weights (in the parameters' dtype, copied to the host) into `dir`,
// creating it if needed.
void export_hf_llama(const Llama& model, const std::string& dir, const LlamaExportOptions& options = {});

}  // namespace blu::models
