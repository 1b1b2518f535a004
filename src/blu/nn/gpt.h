// nn/gpt: GPT-2 as modules — Linear, LayerNorm, CausalSelfAttention, MLP, Block, GPT — with
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
// Depends on nn/module, nn/layers, ops/. Keep: forward(idx, targets) gives logits over the padded
// vocabulary whose padded columns never win (loss and sampling use only the first vocab_size).
#pragma once
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blu/core/rng.h"
#include "blu/nn/layers.h"
#include "blu/nn/module.h"

namespace blu::nn {

struct GPTConfig {
  int64_t block_size = 1024;     // max sequence length
  int64_t vocab_size = 50257;    // real tokens
  int64_t padded_vocab_size = 50304;  // rows of wte (multiple of 64/128 for fast matmuls)
  int64_t n_layer = 12, n_head = 12, n_embd = 768;
  double dropout = 0.0;
  bool bias = true;
  // "d12" (124M), "d24" (350M), "d36" (774M), "d48" (1558M), and "tiny" for tests (2 layers,
  // 3 heads, 48 channels, block 16, vocab 101 padded to 128); BLU_CHECK on unknown names.
  static GPTConfig preset(const std::string& name);
  nlohmann::json to_json() const;
  static GPTConfig from_json(const nlohmann::json& j);  // missing/unknown keys are errors
  void validate() const;  // BLU_CHECK: positive sizes, n_embd % n_head == 0, padded >= vocab, ...
  bool operator==(const GPTConfig&) const = default;
};

// Keys and values of every layer for the positions seen so far: k[l], v[l] are [B, H, T, D].
struct KVCache {
  std::vector<Tensor> k, v;
  int64_t length() const { return k.empty() || !k[0].defined() ? 0 : k[0].size(2); }
  void clear() { k.clear(), v.clear(); }
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

// A training loop that reads only the loss should drop the logits before backward
// (`out.logits = Tensor()`, or keep just `.loss`): cross-entropy's backward then writes their
// gradient over them, one [B·T, padded_vocab] buffer fewer at the step's peak (Note [Donated
// buffers], ops/dispatch.h). Logits still held are left as they are.
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
  // temperature <= 0 means greedy (argmax), as does top_k == 1. Runs without autograd and in
  // eval mode (the training flag is restored afterwards). Once the sequence outgrows block_size
  // the cache is rebuilt from the last block_size tokens (positions are absolute).
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens, double temperature,
                                int64_t top_k, Generator& gen);
  // Logits [B, T, padded_vocab] for idx [B, T] placed after the cache's positions, extending the
  // cache. T must be 1 unless the cache is empty; cache.length() + T <= block_size.
  Tensor forward_cached(const Tensor& idx, KVCache& cache);
  const GPTConfig& config() const { return cfg_; }
  // Mixed precision: activations (and matmuls) in `dtype` (f32, bf16 or f16) while parameters
  // keep their own dtype as master weights; gradients arrive in the parameters' dtype. The
  // forward reads each weight through its compute copy (Module::cast_param, Note [Compute
  // copies]); hand them to AdamW (attach_compute_copies) so its step writes them.
  void set_compute_dtype(DType dtype);
  // Until set, the parameters' own dtype.
  DType compute_dtype() const { return compute_dtype_.value_or(wte->weight.dtype()); }

  std::shared_ptr<Embedding> wte, wpe;  // wte [padded_vocab, C] is also the output projection
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<ModuleList<Block>> h;
  std::shared_ptr<LayerNorm> ln_f;

 private:
  // Final hidden states [B, T, C] for positions pos0..pos0+T-1.
  Tensor hidden(const Tensor& idx, int64_t pos0, KVCache* cache);
  GPTConfig cfg_;
  Generator dropout_gen_;
  std::optional<DType> compute_dtype_;
};

}  // namespace blu::nn
