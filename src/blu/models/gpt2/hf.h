// models/gpt2/hf: GPT-2 weights to and from Hugging Face's safetensors layout, so a model moves
// between BluTrain and the Python ecosystem (transformers' GPT2LMHeadModel/GPT2Model, nanoGPT).
// HF names are ours ("wte.weight", "h.{i}.attn.c_attn.weight", …, "ln_f.bias"); HF stores the
// four Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as [in, out], the
// transpose of our Linear [out, in]; HF's wte has vocab_size rows, ours padded_vocab_size (the
// padding is zero-filled on import and dropped on export).
// Depends on models/gpt2, io/safetensors, ops/. Keep: import is strict — a missing tensor, an
// unexpected one, or a wrong shape is a BLU_CHECK naming the tensor with expected vs got, and the
// model is unchanged when the import fails. Tolerated on import: a "transformer." prefix, the
// attention-mask buffers (attn.bias, attn.masked_bias) and an lm_head.weight equal to wte.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "blu/models/gpt2/gpt2.h"

namespace blu::models {

// Loads an HF GPT-2 safetensors file into `model` (whose config must match the file's shapes).
// F32, F16, BF16 and F64 tensors are accepted and cast to the parameters' dtypes.
void import_hf_gpt2(const std::string& safetensors_path, GPT& model);
// Writes the model's parameters (in their dtype) under HF names and layouts, with
// __metadata__ {"format": "pt"}. Atomic (see SafeTensorsWriter::write).
void export_hf_gpt2(const GPT& model, const std::string& path);
// A folder as Hugging Face writes one: config.json and model.safetensors.
void export_hf_gpt2_folder(const GPT& model, const std::string& dir);
// The GPT-2 config (GPTConfig::to_json) of a Hugging Face GPT-2 config.json object read from
// `file`: unknown keys and unsupported values (another activation, untied head, n_inner other than
// 4·n_embd) are errors naming the file and the key; the vocabulary is padded to a multiple of 64.
nlohmann::json gpt2_config_from_hf(const nlohmann::json& hf, const std::string& file);
// The weights file of a folder (its model.safetensors) or the path itself.
std::string hf_weights_file(const std::string& path);

}  // namespace blu::models
