// models/causal_lm: what everything above nn/ — the trainer, eval, sample, bench, checkpoints,
// dist/ and the compiler — needs from a causal (decoder-only) language model, and nothing
// architecture-specific. GPT-2 (models/gpt2) and Llama (models/llama) implement it; the registry
// (models/registry.h) builds one from a name or a configuration.
//   forward: token ids [B, T] → logits [B, T, V'] over the padded vocabulary (V' ≥ vocab_size();
//     the columns from vocab_size() on never win and take no part in the loss) and, with targets,
//     the mean cross-entropy over the first vocab_size() columns (target -1 is ignored).
//   forward_cached: the same for positions placed after a key/value cache, extending it.
//   embed / block / head: the forward in three parts, where pipeline stages cut and where ZeRO-3
//     gathers a block's parameters (block hooks); forward and forward_cached are exactly
//     embed → block 0 … block n-1 → head, so a model implements the parts, not the whole.
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
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "blu/core/rng.h"
#include "blu/models/activations.h"
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
  Tensor logits;  // [B, T, V']; undefined when the loss came in row pieces (set_loss_chunks)
  Tensor loss;    // 0-d f32 (f64 for f64 models), defined when targets were given
};

// The model-level steps a tensor-parallel rewrite (dist/tensor_parallel.h) changes, those that no
// submodule owns. Every function empty (the default): the single-device model, unchanged.
struct ShardedSteps {
  // The embedding's output [B, T, C] → the blocks' input (sequence parallelism: this rank's
  // sequence shard [B, T/tp, C]).
  std::function<Tensor(const Tensor&)> enter_blocks;
  // The final norm's output → the LM head's input (Megatron's f, or the sequence all-gather).
  std::function<Tensor(const Tensor&)> enter_head;
  // The mean cross-entropy of this rank's logits [N, V'/tp] (its vocabulary shard) against targets
  // [N] over the first `vocab` columns of the full vocabulary, target -1 ignored.
  std::function<Tensor(const Tensor& logits, const Tensor& targets, int64_t vocab)> loss;
  // This rank's logits [..., V'/tp] → the full [..., V'] (generation's forward_cached).
  std::function<Tensor(const Tensor&)> gather_logits;
  // How many ranks the blocks' sequence is split over (sequence parallelism; else 1): a block's
  // positions are x.size(1) · sequence_shards.
  int64_t sequence_shards = 1;
  bool active() const { return bool(enter_head); }
};

// Tensor parallelism's split of a model, as the model declares it (CausalLM::tensor_parallel_plan)
// and dist/tensor_parallel.h applies it: each entry a submodule by dotted name and its role.
//   column          an nn::Linear whose output features are split (its input all-reduced in
//                   backward, or all-gathered along the sequence under sequence parallelism)
//   row             an nn::Linear whose input features are split (its output all-reduced, or
//                   reduce-scattered along the sequence); its bias is replicated
//   vocab_embedding an nn::Embedding whose rows (the vocabulary) are split; when the model ties
//                   its head to it, the head uses the same shard
//   vocab_head      an untied LM head (nn::Linear) split by vocabulary rows as the embedding is
//   sequence_norm   a norm between the parallel regions: replicated; under sequence parallelism
//                   it runs on this rank's sequence shard
// `parts`: the output dim holds that many equal segments split alike (GPT-2's fused q|k|v: 3);
// `units`: the indivisible count behind the split dim (heads, MLP width, vocabulary rows), which
// the tensor-parallel size must divide — `units_name` names it in the error.
enum class ShardRole { column, row, vocab_embedding, vocab_head, sequence_norm };
struct ShardSpec {
  std::string module;
  ShardRole role;
  int64_t parts = 1;
  int64_t units = 0;
  std::string units_name;
  // An uneven split (dist::TPOptions::widths) apportions the units in groups of this many, so
  // that query heads follow their key-value heads (grouped-query attention).
  int64_t group = 1;
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
  LMOutput forward(const Tensor& idx, const Tensor& targets = Tensor());
  // Logits [B, T, V'] for idx [B, T] placed after the cache's positions, extending the cache.
  // T must be 1 unless the cache is empty; cache.length() + T ≤ max_seq_len().
  Tensor forward_cached(const Tensor& idx, KVCache& cache);

  // The residual stream entering block 0, [B, T, C] in the compute dtype, for idx [B, T] at
  // positions pos0 … pos0+T-1 (checks idx's rank, dtype and that the positions fit).
  virtual Tensor embed(const Tensor& idx, int64_t pos0 = 0) = 0;
  // Block i on the residual stream x [B, T, C] at positions pos0 …; with a cache, block i's keys
  // and values are read and extended. Runs the block hooks around the block.
  Tensor block(size_t i, const Tensor& x, int64_t pos0 = 0, KVCache* cache = nullptr);
  // The final norm and the LM head on the last block's output: logits [B, T, V'] and, with
  // targets [B, T], the loss (as forward; the logits left undefined under set_loss_chunks).
  virtual LMOutput head(const Tensor& x, const Tensor& targets = Tensor()) = 0;
  virtual std::vector<BlockRef> blocks() const = 0;
  virtual size_t num_blocks() const { return blocks().size(); }

  // Block hooks: `before(i, x)` sees (and may replace) block i's input, `after(i, y)` its output,
  // on every call of block() — the training forward, the cached one, and a pipeline stage's. A
  // hook that returns its argument changes nothing; one that returns an autograd-recorded identity
  // of it gets a node in the backward right after (before) the block's own backward — where
  // ZeRO-3 frees (gathers) the block's parameters. Hooks run in the order they were added.
  // Returns a handle for remove_block_hooks.
  using BlockHook = std::function<Tensor(size_t block, const Tensor& x)>;
  int add_block_hooks(BlockHook before, BlockHook after);
  void remove_block_hooks(int handle);
  virtual nn::Embedding& token_embedding() const = 0;
  virtual Tensor output_weight() const = 0;  // [V', C]; token_embedding().weight when tied
  // Training FLOPs per token at sequence length T (forward and backward, matmuls only, as the MFU
  // of the PaLM paper counts them): 6 per weight that a token multiplies through, plus the
  // attention scores' 12·layers·width·T.
  virtual double flops_per_token(int64_t T) const = 0;
  // How tensor parallelism splits this model (see ShardSpec); empty: not supported.
  virtual std::vector<ShardSpec> tensor_parallel_plan() const { return {}; }
  // Set by the tensor-parallel rewrite; then forward's logits are this rank's vocabulary shard
  // [B, T, V'/tp] and its loss the vocabulary-parallel cross-entropy (the same value on every rank).
  ShardedSteps sharded;
  bool tied_embeddings() const { return output_weight().is_same(token_embedding().weight); }
  // Mixed precision: activations and matmuls in `dtype` (f32, bf16, f16) over parameters kept in
  // their own dtype (master weights), read through their compute copies (Module::cast_param).
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const;  // until set, the parameters' dtype

  // The head's loss in `chunks` row pieces (Note [Chunked loss], ops/fused.h): forward and head
  // with targets then return the loss of linear_cross_entropy and no logits, and the step never
  // holds the [B·T, V'] logits whole. 0 or 1: the logits made whole (the default). Not under
  // tensor parallelism, whose vocabulary-parallel loss keeps its own shard of the logits (a
  // BLU_CHECK error names the combination).
  void set_loss_chunks(int64_t chunks);
  int64_t loss_chunks() const { return loss_chunks_; }
  // What the blocks do with the activations they save (models/activations.h); applied by block()
  // when grad mode is on and no cache is given. Default: none (every block keeps them).
  void set_activation_policy(const ActivationPolicy& policy);
  const ActivationPolicy& activation_policy() const { return activation_policy_; }
  // The generators the model's forward draws from besides the default one (GPT-2's dropout):
  // recompute restores them so a rebuilt block draws what its first run drew.
  virtual std::vector<Generator*> generators() { return {}; }
  // The activation offloader when the policy offloads (null otherwise).
  const ActivationOffloader* activation_offloader() const { return offloader_.get(); }

  // Samples `max_new_tokens` after `prompt` with temperature and top-k (0 = all; temperature ≤ 0
  // or top_k == 1 is greedy), one position per token through the key/value cache; once the sequence
  // outgrows max_seq_len() the cache is rebuilt from the last max_seq_len() tokens. Without
  // autograd, in eval mode (the training flag is restored).
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens, double temperature,
                                int64_t top_k, Generator& gen);

 protected:
  // Block i (of num_blocks()) on x at positions pos0 …; cache_k/cache_v: the block's key/value
  // cache, or null without one.
  virtual Tensor run_block(size_t i, const Tensor& x, int64_t pos0, Tensor* cache_k, Tensor* cache_v) = 0;

 private:
  // Block i on x under the activation policy (the hooks already applied to x).
  Tensor run_block_with_policy(size_t i, const Tensor& x, int64_t pos0);
  std::optional<DType> compute_dtype_;
  int64_t loss_chunks_ = 0;
  ActivationPolicy activation_policy_;
  std::shared_ptr<ActivationOffloader> offloader_;
  struct Hooks {
    int handle;
    BlockHook before, after;
  };
  std::vector<Hooks> hooks_;
  int next_hook_ = 0;
};

// RAII: while `on`, the model runs under its policy's warm-up form (ActivationPolicy::warmup,
// Note [The warm-up step recomputes every block]); the model's own policy is put back after.
class WarmupPolicy {
 public:
  WarmupPolicy(CausalLM& model, bool on) : model_(on ? &model : nullptr) {
    if (!model_) return;
    own_ = model.activation_policy();
    model.set_activation_policy(own_.warmup());
  }
  ~WarmupPolicy() {
    if (model_) model_->set_activation_policy(own_);
  }
  WarmupPolicy(const WarmupPolicy&) = delete;
  WarmupPolicy& operator=(const WarmupPolicy&) = delete;

 private:
  CausalLM* model_;
  ActivationPolicy own_;
};

}  // namespace blu::models
