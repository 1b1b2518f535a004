// models/gpt2: GPT-2 as a models::CausalLM — Linear, LayerNorm, CausalSelfAttention, MLP, Block, GPT — with
// GPT-2's configurations, tied token embedding / output projection, vocabulary padding
// (50257 → 50304) and GPT-2's initialisation, plus generation with a key/value cache.
// Parameter names follow Hugging Face's GPT-2 ("wte.weight", "h.0.attn.c_attn.weight", …) but
// Linear weights are stored [out, in] (the HF Conv1D layout is transposed at import/export).
// Init (GPT-2's): Linear/Embedding weights normal(0, 0.02), each residual projection (c_proj)
// normal(0, 0.02/sqrt(2·n_layer)), biases 0, LayerNorm weight 1 / bias 0, all drawn from a
// Generator seeded by the constructor's seed, in registration order. The padded rows of wte
// (vocab_size..padded_vocab_size) start at zero: no token selects them and, because loss and
// sampling slice the logits to vocab_size, they never get a gradient, so they stay zero (also
// under weight decay) and export/import round trips are exact. (llm.c leaves them random.)
// Dropout applies to the embedding sum, the attention output projection and the MLP output;
// there is no dropout on the attention probabilities (ops/attention has no dropout_p).
// Registered as the model family "gpt2" (presets tiny, demo, d12, d24, d36, d48; Hugging Face
// GPT2LMHeadModel interop in models/gpt2/hf.h).
// Depends on models/causal_lm, nn/module, nn/layers, ops/. Keep: forward(idx, targets) gives logits
// over the padded vocabulary whose padded columns never win (loss and sampling use only the first
// vocab_size).
#pragma once
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blu/core/rng.h"
#include "blu/models/causal_lm.h"
#include "blu/nn/layers.h"
#include "blu/nn/module.h"

namespace blu::models {

using nn::Dropout;
using nn::Embedding;
using nn::LayerNorm;
using nn::Linear;
using nn::Module;
using nn::ModuleList;

struct GPTConfig {
  int64_t block_size = 1024;     // max sequence length
  int64_t vocab_size = 50257;    // real tokens
  int64_t padded_vocab_size = 50304;  // rows of wte (multiple of 64/128 for fast matmuls)
  int64_t n_layer = 12, n_head = 12, n_embd = 768;
  double dropout = 0.0;
  bool bias = true;
  // GPT-2's "d12" (124M), "d24" (350M), "d36" (774M), "d48" (1558M), and two small shapes with
  // GPT-2's vocabulary: "tiny" (2 layers, 2 heads, 64 wide, block 64: seconds per step on a
  // laptop) and "demo" (4 layers, 4 heads, 128 wide, block 128: the README's fortunes run).
  // BLU_CHECK on unknown names, listing the known ones.
  static GPTConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // {"family": "gpt2", block_size, vocab_size, …}. from_json takes it with or without "family"
  // (checkpoints written before other families existed have none); missing/unknown keys are errors.
  nlohmann::json to_json() const;
  static GPTConfig from_json(const nlohmann::json& j);
  void validate() const;  // BLU_CHECK: positive sizes, n_embd % n_head == 0, padded >= vocab, ...
  bool operator==(const GPTConfig&) const = default;
};

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const GPTConfig& cfg, Generator* dropout_gen);
  // x [B, T, C] → [B, T, C]. With a cache: appends this call's keys/values to (k, v) and attends
  // over all of them; T must be 1 unless the cache is empty (the causal mask of a longer query
  // block would have to be offset by the cached length). With `residual` ([B, T, C]): residual +
  // the attention output, added by the output projection's GEMM when dropout is off.
  Tensor forward(const Tensor& x, Tensor* cache_k = nullptr, Tensor* cache_v = nullptr,
                 const Tensor& residual = Tensor()) const;
  // The model's heads and width; under tensor parallelism forward computes the heads of c_attn's
  // shard, c_attn->out_features / 3 / head_dim of them.
  int64_t n_head, n_embd;
  std::shared_ptr<Linear> c_attn, c_proj;  // [3C, C], [C, C]
  std::shared_ptr<Dropout> resid_dropout;
};

class MLP : public Module {
 public:
  MLP(const GPTConfig& cfg, Generator* dropout_gen);
  // c_proj(gelu_tanh(c_fc(x))) (+ residual, added by c_proj's GEMM when dropout is off).
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor()) const;
  std::shared_ptr<Linear> c_fc, c_proj;    // [4C, C], [C, 4C]
  std::shared_ptr<Dropout> dropout;
};

// Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
class Block : public Module {
 public:
  Block(const GPTConfig& cfg, Generator* dropout_gen);
  Tensor forward(const Tensor& x, Tensor* cache_k = nullptr, Tensor* cache_v = nullptr) const;
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<MLP> mlp;
};

class GPT : public CausalLM {
 public:
  explicit GPT(const GPTConfig& cfg, uint64_t seed = 1337);
  std::string family() const override { return "gpt2"; }
  nlohmann::json config() const override { return cfg_.to_json(); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_seq_len() const override { return cfg_.block_size; }
  // idx [B, T] int (i32/i64); targets [B, T] or undefined; ignore_index -1 in targets.
  Tensor embed(const Tensor& idx, int64_t pos0 = 0) override;  // wte + wpe, dropout
  LMOutput head(const Tensor& x, const Tensor& targets = Tensor()) override;  // ln_f, tied head, loss
  std::vector<BlockRef> blocks() const override;
  size_t num_blocks() const override { return size_t(h->size()); }
  Embedding& token_embedding() const override { return *wte; }
  Tensor output_weight() const override { return wte->weight; }  // tied
  double flops_per_token(int64_t T) const override;
  std::vector<ShardSpec> tensor_parallel_plan() const override;
  const GPTConfig& gpt_config() const { return cfg_; }
  std::vector<Generator*> generators() override { return {&dropout_gen_}; }  // dropout's

  std::shared_ptr<Embedding> wte, wpe;  // wte [padded_vocab, C] is also the output projection
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<Block>> h;
  std::shared_ptr<LayerNorm> ln_f;

 protected:
  Tensor run_block(size_t i, const Tensor& x, int64_t pos0, Tensor* cache_k, Tensor* cache_v) override;

 private:
  GPTConfig cfg_;
  Generator dropout_gen_;
};

}  // namespace blu::models
