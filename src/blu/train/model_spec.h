// train/model_spec: how the trainer and the CLI arrive at a model — a spec (models/registry.h:
// "gpt2:d12", "llama:smollm-135m", a bare GPT-2 preset, a Hugging Face folder) with explicit
// overrides, the configuration a checkpoint was trained with, and a model loaded for eval/sample
// from a checkpoint or a Hugging Face folder.
// Depends on models/registry, io/checkpoint, io/safetensors, nlohmann::json.
// Keep: a spec always maps to the same config (checkpoints record the config, not the spec).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "blu/core/device.h"
#include "blu/models/causal_lm.h"

namespace blu::train {

// Explicit overrides of a config's shape; a value <= 0 keeps the config's. Each sets GPT-2's key
// (n_layer, n_head, n_embd, block_size) or Hugging Face's name for it (num_hidden_layers,
// num_attention_heads, hidden_size, max_position_embeddings: Llama's); a config with neither is an
// error naming the flag. The family then validates the result.
struct ModelOverrides {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0;
};
nlohmann::json apply_overrides(nlohmann::json config, const ModelOverrides& o);

// The model configuration stored with a checkpoint: looked for in the file's safetensors metadata
// (a "model_config" entry, directly or inside a JSON-valued entry), then in run.json beside it.
// BLU_CHECK when neither holds one.
nlohmann::json checkpoint_model_config(const std::string& checkpoint_path);

// The tokenizer a checkpoint's run was trained with (the "tokenizer" of the run options in its
// metadata, else of run.json beside it; data/text_tokenizer.h's specs); "" when neither records one
// (checkpoints of runs that did not know their tokenizer: GPT-2's).
std::string checkpoint_tokenizer(const std::string& checkpoint_file_or_run_dir);

// A model for eval/sample on `device`, in eval mode: from a Hugging Face folder (its config.json and
// weights), else from a checkpoint file or the latest checkpoint of a run directory — a parallel
// layout's (dist/layout_checkpoint.h: its pieces put together by global name) included.
std::unique_ptr<models::CausalLM> load_model(const std::string& checkpoint_or_hf_folder, Device device);

// --init-from: starting weights for a new run (fine-tuning) from a Hugging Face folder
// (config.json + safetensors), a checkpoint file, or a run directory (its newest checkpoint that
// verifies). Only the weights are taken: the optimizer starts fresh at step 0.
// The model config the source records (BLU_CHECK naming the path when it has none).
nlohmann::json init_source_config(const std::string& source);
// Loads the source's weights into model, whose config must equal the source's (else a BLU_CHECK
// naming the differing keys, before anything is modified).
void init_weights(models::CausalLM& model, const std::string& source, const nlohmann::json& config);

}  // namespace blu::train
