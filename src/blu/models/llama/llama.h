// models/llama: the Llama family as a models::CausalLM — RMSNorm, rotary position embedding (Hugging
// Face's rotate-half layout, optionally with Llama 3's frequency scaling), grouped-query attention,
// the SwiGLU MLP, no biases — with its configurations (SmolLM-135M, a 250M Llama, Llama-3.2-1B
// shapes, and "tiny" for tests) and a tied or untied LM head over an unpadded vocabulary.
// Module and parameter names are Hugging Face's LlamaForCausalLM ("model.embed_tokens.weight",
// "model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.mlp.gate_proj.weight",
// "model.layers.{i}.input_layernorm.weight", "model.norm.weight", "lm_head.weight" — the last absent
// when the head is tied), so weights move to and from HF unchanged (models/llama/hf.h).
// Init: every 2-D weight normal(0, 0.02), norm weights one, drawn from a Generator seeded by the
// constructor's seed, in registration order.
// RoPE tables: cos/sin [positions, head_dim] computed in double and stored f32 (f64 for f64 models),
// one pair per device and dtype, made on first use and grown to the longest position asked for;
// they are not part of the state dict.
// Registered as the model family "llama" (models/llama/family.cpp).
// Depends on models/causal_lm, nn/layers, nn/norms, ops/ (rms_norm, rotary_embedding, swiglu,
// scaled_dot_product_attention with grouped-query attention). Keep: forward never reads a device
// value on the host; the logits have exactly vocab_size columns.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "blu/models/causal_lm.h"
#include "blu/nn/layers.h"
#include "blu/nn/norms.h"

namespace blu::models {

// Llama 3's RoPE frequency scaling (HF rope_scaling {"rope_type": "llama3", …}): wavelengths
// longer than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
// shorter than original_max_position_embeddings / high_freq_factor are kept, and the band between
// is interpolated.
struct LlamaRopeScaling {
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const LlamaRopeScaling&) const = default;
};

struct LlamaConfig {
  int64_t hidden_size = 576;
  int64_t num_hidden_layers = 30;
  int64_t num_attention_heads = 9;
  int64_t num_key_value_heads = 3;
  int64_t intermediate_size = 1536;
  int64_t vocab_size = 49152;  // any size: the vocabulary is not padded
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  std::optional<LlamaRopeScaling> rope_scaling;
  bool tie_word_embeddings = true;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // "smollm-135m" (576 wide, 30 layers, 9 heads / 3 kv, MLP 1536, vocab 49152, tied), "llama-250m"
  // (1024, 16, 16 / 4, 2816, 32000, untied), "llama3.2-1b" (2048, 16, 32 / 8, 8192, 128256, tied,
  // rope_theta 500000 with Llama 3 scaling), "tiny" (2 layers, 6 heads / 2 kv, 48 wide, MLP 80,
  // vocab 101, 64 positions, untied). BLU_CHECK on unknown names, listing the known ones.
  static LlamaConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
  // {"family": "llama", "hidden_size", …, "rope_scaling": null or {factor, low_freq_factor,
  // high_freq_factor, original_max_position_embeddings}}. from_json takes it with or without
  // "family"; a missing or unknown key is an error naming it.
  nlohmann::json to_json() const;
  static LlamaConfig from_json(const nlohmann::json& j);
  // BLU_CHECK: positive sizes, hidden_size % num_attention_heads == 0, num_attention_heads %
  // num_key_value_heads == 0, an even head_dim, eps and theta > 0, a usable rope_scaling.
  void validate() const;
  bool operator==(const LlamaConfig&) const = default;
};

// RoPE's inverse frequencies θ^(-2i/D), i < D/2, after Llama 3's scaling when the config has it
// (HF's _compute_llama3_parameters), in double.
std::vector<double> llama_rope_inv_freq(const LlamaConfig& cfg);
// cos and sin tables [positions, head_dim] in `dtype` on `device`: row p holds
// cos/sin(p · inv_freq) for both halves of the head (the rotate-half layout), computed in double.
std::pair<Tensor, Tensor> llama_rope_tables(const LlamaConfig& cfg, int64_t positions, DType dtype, Device device);

class LlamaAttention : public nn::Module {
 public:
  explicit LlamaAttention(const LlamaConfig& cfg);
  // x [B, T, C] at the positions whose cos/sin rows ([T, D]) are given → [B, T, C] (+ residual,
  // added by o_proj's GEMM). With a cache: appends this call's keys (after RoPE) and values to
  // (cache_k, cache_v) [B, Hkv, T', D] and attends over all of them; T must be 1 unless it is empty.
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor* cache_k = nullptr,
                 Tensor* cache_v = nullptr, const Tensor& residual = Tensor()) const;
  // The model's heads; under tensor parallelism forward computes those of the projections' shards
  // (q_proj->out_features / head_dim query heads, k_proj->out_features / head_dim kv heads).
  int64_t num_heads, num_kv_heads, head_dim;
  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;  // [H·D, C], [Hkv·D, C] ×2, [C, H·D]
};

class LlamaMLP : public nn::Module {
 public:
  explicit LlamaMLP(const LlamaConfig& cfg);
  // down_proj(silu(gate_proj(x)) · up_proj(x)) (+ residual, added by down_proj's GEMM).
  Tensor forward(const Tensor& x, const Tensor& residual = Tensor()) const;
  std::shared_ptr<nn::Linear> gate_proj, up_proj, down_proj;  // [I, C], [I, C], [C, I]
};

// Pre-norm block: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).
class LlamaDecoderLayer : public nn::Module {
 public:
  explicit LlamaDecoderLayer(const LlamaConfig& cfg);
  Tensor forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor* cache_k = nullptr,
                 Tensor* cache_v = nullptr) const;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  std::shared_ptr<nn::RMSNorm> input_layernorm, post_attention_layernorm;
};

// HF's LlamaModel: the embedding, the layers and the final norm (the "model." prefix of the names).
class LlamaModel : public nn::Module {
 public:
  explicit LlamaModel(const LlamaConfig& cfg);
  std::shared_ptr<nn::Embedding> embed_tokens;  // [V, C]
  std::shared_ptr<nn::ModuleList<LlamaDecoderLayer>> layers;
  std::shared_ptr<nn::RMSNorm> norm;
};

// HF's LlamaForCausalLM.
class Llama : public CausalLM {
 public:
  explicit Llama(const LlamaConfig& cfg, uint64_t seed = 1337);
  std::string family() const override { return "llama"; }
  nlohmann::json config() const override { return cfg_.to_json(); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_seq_len() const override { return cfg_.max_position_embeddings; }
  Tensor embed(const Tensor& idx, int64_t pos0 = 0) override;  // embed_tokens
  LMOutput head(const Tensor& x, const Tensor& targets = Tensor()) override;  // model.norm, lm_head, loss
  std::vector<BlockRef> blocks() const override;
  size_t num_blocks() const override { return size_t(cfg_.num_hidden_layers); }
  nn::Embedding& token_embedding() const override { return *model->embed_tokens; }
  Tensor output_weight() const override { return lm_head ? lm_head->weight : model->embed_tokens->weight; }
  // 6 per weight a token multiplies through (every parameter but an untied embedding table, which
  // is a lookup) plus the attention scores' 12·layers·(heads·head_dim)·T.
  double flops_per_token(int64_t T) const override;
  std::vector<ShardSpec> tensor_parallel_plan() const override;
  const LlamaConfig& llama_config() const { return cfg_; }

  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<nn::Linear> lm_head;  // [V, C]; null when tied (the embedding is the head)

 protected:
  Tensor run_block(size_t i, const Tensor& x, int64_t pos0, Tensor* cache_k, Tensor* cache_v) override;

 private:
  // Rows [pos0, pos0 + T) of the cos/sin tables for `dtype` on `device`.
  std::pair<Tensor, Tensor> rope(int64_t pos0, int64_t T, DType dtype, Device device);
  struct RopeTables {
    Device device;
    DType dtype;
    Tensor cos, sin;  // [n, D]
  };
  LlamaConfig cfg_;
  std::vector<RopeTables> rope_;
};

}  // namespace blu::models
