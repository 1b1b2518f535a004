// models/causal_lm: what everything above nn/ — the trainer, eval, sample, bench, checkpoints,
// dist/ and the compiler — needs from a causal (decoder-only) language model, and nothing
// architecture-specific. GPT-2 (models/gpt2) and Llama (models/llama) implement it; the registry
// (models/registry.h) builds one from a name or a configuration.
//   forward: token ids [B, T] → logits [B, T, V'] over the padded vocabulary (V' ≥ vocab_size();
//     the columns from vocab_size() on never win and take no part in the loss) and, with targets,
//     the mean cross-entropy over the first vocab_size() columns (target -1 is ignored).
//   forward_cached: the same for positions placed after a key/value cache, extending it.
//   blocks(): the ordered repeated blocks, where pipeline stages and recompute cut; each is a
//     submodule reachable by its dotted name (Module::find_module / replace_module, which tensor
//     parallelism uses to rewrite the model).
//   token_embedding() / output_weight(): the input embedding and the LM head's weight (the same
//     tensor when tied, so a strategy can treat the embedding's row gradient apart).
//   config(): the model's configuration as JSON, with "family" naming the implementation; the
//     registry rebuilds the same model (same shapes, same initialisation for the same seed) from it.
// Depends on nn/module, nn/layers, core/. Keep: a model's config() round-trips through the
// registry; forward never reads a device value on the host; generation runs without autograd and
// restores the training flag.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "blu/core/rng.h"
#include "blu/nn/layers.h"
#include "blu/nn/module.h"

namespace blu::models {

// Keys and values of every layer for the positions seen so far (k[l], v[l]: [B, H_kv, T, D]).
struct KVCache {
  std::vector<Tensor> k, v;
  int64_t length() const { return k.empty() || !k[0].defined() ? 0 : k[0].size(2); }
  void clear() { k.clear(), v.clear(); }
};

// A training loop that reads only the loss should drop the logits before backward
// (`out.logits = Tensor()`, or keep just `.loss`): cross-entropy's backward then writes their
// gradient over them, one [B·T, V'] buffer fewer at the step's peak (Note [Donated buffers],
// ops/dispatch.h).
struct LMOutput {
  Tensor logits;  // [B, T, V']
  Tensor loss;    // 0-d f32 (f64 for f64 models), defined when targets were given
};

// One repeated block: its dotted name ("h.3", "model.layers.3") and the module.
struct BlockRef {
  std::string name;
  nn::Module* module;
};

class CausalLM : public nn::Module {
 public:
  // "gpt2", "llama": the registry's family name.
  virtual std::string family() const = 0;
  // The configuration, {"family": family(), …}; models::build_model(config(), seed) rebuilds it.
  virtual nlohmann::json config() const = 0;
  virtual int64_t vocab_size() const = 0;   // real tokens
  virtual int64_t max_seq_len() const = 0;  // the longest sequence forward takes
  // idx [B, T] i32/i64 with T ≤ max_seq_len(); targets [B, T] or undefined.
  virtual LMOutput forward(const Tensor& idx, const Tensor& targets = Tensor()) = 0;
  // Logits [B, T, V'] for idx [B, T] placed after the cache's positions, extending the cache.
  // T must be 1 unless the cache is empty; cache.length() + T ≤ max_seq_len().
  virtual Tensor forward_cached(const Tensor& idx, KVCache& cache) = 0;
  virtual std::vector<BlockRef> blocks() const = 0;
  virtual nn::Embedding& token_embedding() const = 0;
  virtual Tensor output_weight() const = 0;  // [V', C]; token_embedding().weight when tied
  // Training FLOPs per token at sequence length T (forward and backward, matmuls only, as the MFU
  // of the PaLM paper counts them): 6 per weight that a token multiplies through, plus the
  // attention scores' 12·layers·width·T.
  virtual double flops_per_token(int64_t T) const = 0;
  bool tied_embeddings() const { return output_weight().is_same(token_embedding().weight); }
  // Mixed precision: activations and matmuls in `dtype` (f32, bf16, f16) over parameters kept in
  // their own dtype (master weights), read through their compute copies (Module::cast_param).
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const;  // until set, the parameters' dtype

  // Samples `max_new_tokens` after `prompt` with temperature and top-k (0 = all; temperature ≤ 0
  // or top_k == 1 is greedy), one position per token through the key/value cache; once the sequence
  // outgrows max_seq_len() the cache is rebuilt from the last max_seq_len() tokens. Without
  // autograd, in eval mode (the training flag is restored).
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens, double temperature,
                                int64_t top_k, Generator& gen);

 private:
  std::optional<DType> compute_dtype_;
};

}  // namespace blu::models
