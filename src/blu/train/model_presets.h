// train/model_presets: the model shapes the trainer and the CLI know by name, and how to find the
// model configuration a checkpoint was trained with.
//   Names: GPT-2's "d12" / "d24" / "d36" / "d48" (nn::GPTConfig::preset) plus two small CPU shapes:
//   "tiny" (2 layers, 2 heads, 64 wide, block 64: seconds per step on a laptop, for smoke tests)
//   and "demo" (4 layers, 4 heads, 128 wide, block 128: the README's 3-minute fortunes run).
//   Both small presets keep GPT-2's vocabulary (50257, padded to 50304) so they read GPT-2 shards.
// Depends on nn/gpt, io/safetensors, nlohmann::json.
// Keep: a preset name always maps to the same config (checkpoints record the config, not the name).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "blu/nn/gpt.h"

namespace blu::train {

// A named shape; BLU_CHECK on unknown names, listing the known ones.
nn::GPTConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

// Explicit overrides on top of a preset; a value <= 0 keeps the preset's.
struct ModelOverrides {
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0;
};
nn::GPTConfig apply_overrides(nn::GPTConfig cfg, const ModelOverrides& o);

// The model configuration stored with a checkpoint: looked for in the file's safetensors metadata
// (a "model_config" entry, directly or inside a JSON-valued entry), then in run.json beside it.
// BLU_CHECK when neither holds one.
nn::GPTConfig checkpoint_model_config(const std::string& checkpoint_path);

}  // namespace blu::train
