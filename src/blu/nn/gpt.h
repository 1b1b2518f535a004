// nn/gpt: GPT-2 as modules — Linear, LayerNorm, CausalSelfAttention, MLP, Block, GPT — with
// GPT-2's configurations, tied token embedding / output projection, vocabulary padding
// (50257 → 50304) and GPT-2's initialisation, plus generation with a key/value cache.
// Parameter names follow Hugging Face's GPT-2 ("wte.weight", "h.0.attn.c_attn.weight", …) but
// Linear weights are stored [out, in] (the HF Conv1D layout is transposed at import/export).
// Depends on nn/module, ops/. Keep: forward(idx, targets) gives logits over the padded
// vocabulary whose padded columns never win (loss and sampling use only the first vocab_size).
#pragma once
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "blu/core/rng.h"
#include "blu/nn/module.h"

namespace blu::nn {

struct GPTConfig {
  int64_t block_size = 1024;     // max sequence length
  int64_t vocab_size = 50257;    // real tokens
  int64_t padded_vocab_size = 50304;  // rows of wte (multiple of 64/128 for fast matmuls)
  int64_t n_layer = 12, n_head = 12, n_embd = 768;
  double dropout = 0.0;
  bool bias = true;
  // "d12" (124M), "d24" (350M), "d36" (774M), "d48" (1558M); BLU_CHECK on unknown names.
  static GPTConfig preset(const std::string& name);
  nlohmann::json to_json() const;
  static GPTConfig from_json(const nlohmann::json& j);  // missing/unknown keys are errors
};

struct GPTOutput {
  Tensor logits;  // [B, T, padded_vocab] (or only the last position when asked)
  Tensor loss;    // 0-d, defined when targets were given
};

class GPT : public Module {
 public:
  explicit GPT(const GPTConfig& cfg, uint64_t seed = 1337);
  // idx [B, T] int (i32/i64); targets [B, T] or undefined; ignore_index -1 in targets.
  GPTOutput forward(const Tensor& idx, const Tensor& targets = Tensor());
  // Samples `max_new_tokens` after `prompt` with temperature and top-k (0 = all), using a
  // key/value cache so each new token costs one position, not the whole prefix.
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens, double temperature,
                                int64_t top_k, Generator& gen);
  const GPTConfig& config() const;
};

}  // namespace blu::nn
