// io/gpt2_weights: GPT-2 weights to and from Hugging Face's safetensors layout, so a model moves
// between BluTrain and the Python ecosystem (transformers' GPT2LMHeadModel/GPT2Model, nanoGPT).
// HF names are ours ("wte.weight", "h.{i}.attn.c_attn.weight", …, "ln_f.bias"); HF stores the
// four Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) as [in, out], the
// transpose of our Linear [out, in]; HF's wte has vocab_size rows, ours padded_vocab_size (the
// padding is zero-filled on import and dropped on export).
// Depends on nn/gpt, io/safetensors, ops/. Keep: import is strict — a missing tensor, an
// unexpected one, or a wrong shape is a BLU_CHECK naming the tensor with expected vs got, and the
// model is unchanged when the import fails. Tolerated on import: a "transformer." prefix, the
// attention-mask buffers (attn.bias, attn.masked_bias) and an lm_head.weight equal to wte.
#pragma once
#include <string>

#include "blu/nn/gpt.h"

namespace blu::io {

// Loads an HF GPT-2 safetensors file into `model` (whose config must match the file's shapes).
// F32, F16, BF16 and F64 tensors are accepted and cast to the parameters' dtypes.
void import_hf_gpt2(const std::string& safetensors_path, nn::GPT& model);
// Writes the model's parameters (in their dtype) under HF names and layouts, with
// __metadata__ {"format": "pt"}. Atomic (see SafeTensorsWriter::write).
void export_hf_gpt2(const nn::GPT& model, const std::string& path);

}  // namespace blu::io
