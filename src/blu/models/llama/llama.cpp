#include "blu/models/llama/llama.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "blu/core/grad_mode.h"
#include "blu/ops/attention.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/fused.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu::models {

// --- config ---

std::vector<std::string> LlamaConfig::preset_names() { return {"tiny", "smollm-135m", "llama-250m", "llama3.2-1b"}; }

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig c;
  auto shape = [&c](int64_t C, int64_t L, int64_t H, int64_t KV, int64_t I, int64_t V, bool tied) {
    c.hidden_size = C, c.num_hidden_layers = L, c.num_attention_heads = H, c.num_key_value_heads = KV;
    c.intermediate_size = I, c.vocab_size = V, c.tie_word_embeddings = tied;
  };
  if (name == "smollm-135m") {
    shape(576, 30, 9, 3, 1536, 49152, true);
    c.max_position_embeddings = 2048;
  } else if (name == "llama-250m") {
    shape(1024, 16, 16, 4, 2816, 32000, false);
    c.max_position_embeddings = 2048;
  } else if (name == "llama3.2-1b") {
    shape(2048, 16, 32, 8, 8192, 128256, true);
    c.max_position_embeddings = 131072;
    c.rope_theta = 500000.0;
    c.rope_scaling = LlamaRopeScaling{.factor = 32.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                      .original_max_position_embeddings = 8192};
  } else if (name == "tiny") {
    shape(48, 2, 6, 2, 80, 101, false);
    c.max_position_embeddings = 64;
  } else {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    BLU_CHECK(false, "LlamaConfig::preset: unknown preset '", name, "' (expected one of ", known, ")");
  }
  c.validate();
  return c;
}

void LlamaConfig::validate() const {
  BLU_CHECK(hidden_size > 0 && num_hidden_layers > 0 && num_attention_heads > 0 && num_key_value_heads > 0 &&
                intermediate_size > 0 && vocab_size > 0 && max_position_embeddings > 0,
            "LlamaConfig: sizes must be positive, got hidden_size ", hidden_size, ", num_hidden_layers ",
            num_hidden_layers, ", num_attention_heads ", num_attention_heads, ", num_key_value_heads ",
            num_key_value_heads, ", intermediate_size ", intermediate_size, ", vocab_size ", vocab_size,
            ", max_position_embeddings ", max_position_embeddings);
  BLU_CHECK(hidden_size % num_attention_heads == 0, "LlamaConfig: hidden_size ", hidden_size,
            " is not a multiple of num_attention_heads ", num_attention_heads);
  BLU_CHECK(num_attention_heads % num_key_value_heads == 0, "LlamaConfig: num_attention_heads ",
            num_attention_heads, " is not a multiple of num_key_value_heads ", num_key_value_heads);
  BLU_CHECK(head_dim() % 2 == 0, "LlamaConfig: the head dim (hidden_size / num_attention_heads = ", hidden_size,
            " / ", num_attention_heads, ") must be even for RoPE, got ", head_dim());
  BLU_CHECK(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "LlamaConfig: rms_norm_eps must be > 0, got ",
            rms_norm_eps);
  BLU_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "LlamaConfig: rope_theta must be > 0, got ", rope_theta);
  if (rope_scaling) {
    const LlamaRopeScaling& s = *rope_scaling;
    BLU_CHECK(s.factor >= 1.0, "LlamaConfig: rope_scaling.factor must be >= 1, got ", s.factor);
    BLU_CHECK(s.original_max_position_embeddings > 0,
              "LlamaConfig: rope_scaling.original_max_position_embeddings must be positive, got ",
              s.original_max_position_embeddings);
    BLU_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
              "LlamaConfig: rope_scaling needs 0 < low_freq_factor < high_freq_factor, got low_freq_factor ",
              s.low_freq_factor, ", high_freq_factor ", s.high_freq_factor);
  }
}

nlohmann::json LlamaConfig::to_json() const {
  nlohmann::json scaling = nullptr;
  if (rope_scaling) {
    scaling = {{"factor", rope_scaling->factor},
               {"low_freq_factor", rope_scaling->low_freq_factor},
               {"high_freq_factor", rope_scaling->high_freq_factor},
               {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  }
  return {{"family", "llama"},
          {"hidden_size", hidden_size},
          {"num_hidden_layers", num_hidden_layers},
          {"num_attention_heads", num_attention_heads},
          {"num_key_value_heads", num_key_value_heads},
          {"intermediate_size", intermediate_size},
          {"vocab_size", vocab_size},
          {"max_position_embeddings", max_position_embeddings},
          {"rms_norm_eps", rms_norm_eps},
          {"rope_theta", rope_theta},
          {"rope_scaling", scaling},
          {"tie_word_embeddings", tie_word_embeddings}};
}

namespace {

// Every key of `want` in `j` and nothing else ("family" aside when allowed).
void check_keys(const nlohmann::json& j, const nlohmann::json& want, const std::string& what, bool family_ok) {
  BLU_CHECK(j.is_object(), what, ": expected an object, got ", j.dump());
  for (auto& [k, _] : j.items()) {
    if (family_ok && k == "family") continue;
    BLU_CHECK(want.contains(k), what, ": unknown key '", k, "'");
  }
  for (auto& [k, _] : want.items()) {
    if (k == "family") continue;
    BLU_CHECK(j.contains(k), what, ": missing key '", k, "'");
  }
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const nlohmann::json& j) {
  const LlamaConfig defaults;
  check_keys(j, defaults.to_json(), "LlamaConfig::from_json", true);
  if (j.contains("family"))
    BLU_CHECK(j["family"] == "llama", "LlamaConfig::from_json: family: expected \"llama\", got ", j["family"].dump());
  LlamaConfig c;
  try {
    c.hidden_size = j.at("hidden_size").get<int64_t>();
    c.num_hidden_layers = j.at("num_hidden_layers").get<int64_t>();
    c.num_attention_heads = j.at("num_attention_heads").get<int64_t>();
    c.num_key_value_heads = j.at("num_key_value_heads").get<int64_t>();
    c.intermediate_size = j.at("intermediate_size").get<int64_t>();
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.max_position_embeddings = j.at("max_position_embeddings").get<int64_t>();
    c.rms_norm_eps = j.at("rms_norm_eps").get<double>();
    c.rope_theta = j.at("rope_theta").get<double>();
    c.tie_word_embeddings = j.at("tie_word_embeddings").get<bool>();
    const nlohmann::json& s = j.at("rope_scaling");
    if (!s.is_null()) {
      const LlamaRopeScaling d;
      check_keys(s,
                 {{"factor", d.factor},
                  {"low_freq_factor", d.low_freq_factor},
                  {"high_freq_factor", d.high_freq_factor},
                  {"original_max_position_embeddings", d.original_max_position_embeddings}},
                 "LlamaConfig::from_json: rope_scaling", false);
      c.rope_scaling = LlamaRopeScaling{
          .factor = s.at("factor").get<double>(),
          .low_freq_factor = s.at("low_freq_factor").get<double>(),
          .high_freq_factor = s.at("high_freq_factor").get<double>(),
          .original_max_position_embeddings = s.at("original_max_position_embeddings").get<int64_t>()};
    }
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, "LlamaConfig::from_json: ", e.what());
  }
  c.validate();
  return c;
}

// --- RoPE ---

std::vector<double> llama_rope_inv_freq(const LlamaConfig& cfg) {
  const int64_t D = cfg.head_dim();
  std::vector<double> inv(size_t(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) inv[size_t(i)] = 1.0 / std::pow(cfg.rope_theta, double(2 * i) / double(D));
  if (!cfg.rope_scaling) return inv;
  const LlamaRopeScaling& s = *cfg.rope_scaling;
  const double old_len = double(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / s.low_freq_factor, high_freq_wavelen = old_len / s.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen < high_freq_wavelen) continue;  // high frequencies: kept
    if (wavelen > low_freq_wavelen) {           // low frequencies: stretched
      f /= s.factor;
      continue;
    }
    const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1.0 - smooth) * f / s.factor + smooth * f;  // the band between: interpolated
  }
  return inv;
}

std::pair<Tensor, Tensor> llama_rope_tables(const LlamaConfig& cfg, int64_t positions, DType dtype, Device device) {
  BLU_CHECK(positions > 0, "llama_rope_tables: expected a positive number of positions, got ", positions);
  const std::vector<double> inv = llama_rope_inv_freq(cfg);
  const int64_t D = cfg.head_dim(), half = D / 2;
  std::vector<double> c(size_t(positions * D)), s(size_t(positions * D));
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(p) * inv[size_t(i)];
      const size_t at = size_t(p * D + i);
      c[at] = c[at + size_t(half)] = std::cos(angle);
      s[at] = s[at + size_t(half)] = std::sin(angle);
    }
  }
  Tensor cos = from_vector(c, {positions, D}, dtype), sin = from_vector(s, {positions, D}, dtype);
  if (device != kCPU) cos = to_device(cos, device), sin = to_device(sin, device);
  return {cos, sin};
}

// --- modules ---

namespace {
// Causal attention over q [B, T, H, D] and k, v [B, T, Hkv, D] (grouped-query when Hkv < H), its
// heads merged back: [B, T, H·D]. The body of both training paths' attention-core region.
Tensor attend_and_merge(const Tensor& q, const Tensor& k, const Tensor& v) {
  const Tensor o = scaled_dot_product_attention(transpose(q, 1, 2), transpose(k, 1, 2), transpose(v, 1, 2), true);
  return reshape(transpose(o, 1, 2), {q.size(0), q.size(1), q.size(2) * q.size(3)});
}
}  // namespace

LlamaAttention::LlamaAttention(const LlamaConfig& cfg)
    : num_heads(cfg.num_attention_heads), num_kv_heads(cfg.num_key_value_heads), head_dim(cfg.head_dim()) {
  const int64_t C = cfg.hidden_size;
  q_proj = std::make_shared<nn::Linear>(C, num_heads * head_dim, false);
  k_proj = std::make_shared<nn::Linear>(C, num_kv_heads * head_dim, false);
  v_proj = std::make_shared<nn::Linear>(C, num_kv_heads * head_dim, false);
  o_proj = std::make_shared<nn::Linear>(num_heads * head_dim, C, false);
  register_module("q_proj", q_proj);
  register_module("k_proj", k_proj);
  register_module("v_proj", v_proj);
  register_module("o_proj", o_proj);
}

Tensor LlamaAttention::forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor* cache_k,
                               Tensor* cache_v, const Tensor& residual) const {
  BLU_CHECK(x.dim() == 3 && x.size(2) == q_proj->in_features, "LlamaAttention: expected x [B, T, ",
            q_proj->in_features, "], got ", x.shape());
  // RoPE on [B, T, heads, D], then [B, heads, T, D] for attention. T is the projections' (sequence
  // parallelism gathers them from x's sequence shard).
  const int64_t D = head_dim, H = q_proj->out_features / D, Hkv = k_proj->out_features / D;
  if (!cache_k) {
    // One GEMM for the three projections where they are plain linears (Note [Sibling linears]),
    // its output read as [B, T, H + 2·Hkv, D] heads: rotary_attention rotates q and k, copies v
    // beside them and attends over the three head ranges of that one buffer; its backward writes
    // the projection's gradient side by side, q's and k's rotated back (no join of the three
    // gradients, no pass of RoPE's backward over them on the GPU). Separate projections (tensor
    // parallelism's) rotate q and k apart and pass v as it is.
    // The attention core is a selective-recompute region (models/activations.h): under a selective
    // policy only the projections are kept; RoPE's outputs, the attention output and the merged
    // heads are rebuilt in backward.
    const Tensor qkv = nn::sibling_linears_joined(x, {q_proj.get(), k_proj.get(), v_proj.get()});
    Tensor y;
    if (qkv.defined()) {
      const int64_t B = qkv.size(0), T = qkv.size(1);
      y = selective_region(
          "attention core",
          [=](const std::vector<Tensor>& in) {
            const Tensor o = rotary_attention(view(in[0], {B, T, H + 2 * Hkv, D}), in[1], in[2], H, Hkv);
            return reshape(transpose(o, 1, 2), {B, T, H * D});
          },
          {qkv, cos, sin});
    } else {
      const Tensor qp = q_proj->forward(x), kp = k_proj->forward(x), vp = v_proj->forward(x);
      const int64_t B = qp.size(0), T = qp.size(1);
      y = selective_region(
          "attention core",
          [=](const std::vector<Tensor>& in) {
            const Tensor q = rotary_embedding(view(in[0], {B, T, H, D}), in[3], in[4]);  // q's, then k's
            const Tensor k = rotary_embedding(view(in[1], {B, T, Hkv, D}), in[3], in[4]);
            return attend_and_merge(q, k, view(in[2], {B, T, Hkv, D}));
          },
          {qp, kp, vp, cos, sin});
    }
    return residual.defined() ? o_proj->forward(y, residual) : o_proj->forward(y);
  }
  // Decoding with a key/value cache: the cache keeps k and v, so v gets a buffer of its own (a
  // column range of the one projection's output would keep all of it alive).
  BLU_ASSERT(cache_v, "a key cache without a value cache");
  const std::vector<Tensor> proj = nn::sibling_linears(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  const Tensor &qp = proj[0], &kp = proj[1], &vp = proj[2];
  const int64_t B = qp.size(0), T = qp.size(1);
  Tensor q = transpose(rotary_embedding(view(qp, {B, T, H, D}), cos, sin), 1, 2);
  Tensor k = transpose(rotary_embedding(view(kp, {B, T, Hkv, D}), cos, sin), 1, 2);
  Tensor v = transpose(view(vp.is_contiguous() ? vp : clone(vp), {B, T, Hkv, D}), 1, 2);
  bool causal = true;
  if (cache_k->defined()) {
    BLU_CHECK(T == 1, "LlamaAttention: with a non-empty cache the input must be one position, got ", T);
    k = cat({*cache_k, k}, 2);
    v = cat({*cache_v, v}, 2);
    causal = false;  // one query at the end sees every cached key
  }
  *cache_k = k;
  *cache_v = v;
  Tensor y = scaled_dot_product_attention(q, k, v, causal);  // [B, H, T, D], grouped-query when Hkv < H
  y = reshape(transpose(y, 1, 2), {B, T, H * D});
  return residual.defined() ? o_proj->forward(y, residual) : o_proj->forward(y);
}

LlamaMLP::LlamaMLP(const LlamaConfig& cfg) {
  gate_proj = std::make_shared<nn::Linear>(cfg.hidden_size, cfg.intermediate_size, false);
  up_proj = std::make_shared<nn::Linear>(cfg.hidden_size, cfg.intermediate_size, false);
  down_proj = std::make_shared<nn::Linear>(cfg.intermediate_size, cfg.hidden_size, false);
  register_module("gate_proj", gate_proj);
  register_module("up_proj", up_proj);
  register_module("down_proj", down_proj);
}

Tensor LlamaMLP::forward(const Tensor& x, const Tensor& residual) const {
  // SwiGLU, a selective-recompute region: its output (down_proj's input) is rebuilt in backward.
  // gate and up by one GEMM (Note [Sibling linears]): swiglu reads its two halves in place. Under
  // an mlp policy the projection is rebuilt too, from x (models/activations.h).
  const Tensor h = mlp_region(
      [this](const std::vector<Tensor>& in) {
        return selective_region(
            "swiglu", [](const std::vector<Tensor>& gu) { return swiglu(gu[0], gu[1]); },
            nn::sibling_linears(in[0], {gate_proj.get(), up_proj.get()}));
      },
      {x});
  return residual.defined() ? down_proj->forward(h, residual) : down_proj->forward(h);
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& cfg) {
  self_attn = std::make_shared<LlamaAttention>(cfg);
  mlp = std::make_shared<LlamaMLP>(cfg);
  input_layernorm = std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps);
  post_attention_layernorm = std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps);
  register_module("self_attn", self_attn);
  register_module("mlp", mlp);
  register_module("input_layernorm", input_layernorm);
  register_module("post_attention_layernorm", post_attention_layernorm);
}

Tensor LlamaDecoderLayer::forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor* cache_k,
                                  Tensor* cache_v) const {
  // The skip connections are added by the projections' GEMMs (linear's residual).
  const Tensor y = self_attn->forward(input_layernorm->forward(x), cos, sin, cache_k, cache_v, x);
  return mlp->forward(post_attention_layernorm->forward(y), y);
}

LlamaModel::LlamaModel(const LlamaConfig& cfg) {
  embed_tokens = std::make_shared<nn::Embedding>(cfg.vocab_size, cfg.hidden_size);
  layers = std::make_shared<nn::ModuleList<LlamaDecoderLayer>>();
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) layers->push_back(std::make_shared<LlamaDecoderLayer>(cfg));
  norm = std::make_shared<nn::RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps);
  register_module("embed_tokens", embed_tokens);
  register_module("layers", layers);
  register_module("norm", norm);
}

// --- Llama ---

Llama::Llama(const LlamaConfig& cfg, uint64_t seed) : cfg_(cfg) {
  cfg_.validate();
  model = std::make_shared<LlamaModel>(cfg_);
  register_module("model", model);
  if (!cfg_.tie_word_embeddings) {
    lm_head = std::make_shared<nn::Linear>(cfg_.hidden_size, cfg_.vocab_size, false);
    register_module("lm_head", lm_head);
  } else {
    model->embed_tokens->set_row_sparse_grad(true);  // tied to the LM head: its rows may be exchanged apart
  }
  // normal(0, 0.02) for every matrix, in registration order; the norms keep their ones.
  Generator gen(seed);
  for (auto& [name, p] : named_parameters())
    if (p.dim() >= 2) nn::init_normal_(p, 0.02, gen);
}

std::vector<BlockRef> Llama::blocks() const {
  std::vector<BlockRef> out;
  for (int64_t l = 0; l < model->layers->size(); ++l)
    out.push_back({"model.layers." + std::to_string(l), &(*model->layers)[l]});
  return out;
}

std::vector<ShardSpec> Llama::tensor_parallel_plan() const {
  const int64_t H = cfg_.num_attention_heads, KV = cfg_.num_key_value_heads, I = cfg_.intermediate_size;
  std::vector<ShardSpec> plan{{"model.embed_tokens", ShardRole::vocab_embedding, 1, cfg_.vocab_size, "vocab_size"}};
  for (const BlockRef& b : blocks()) {
    const std::string p = b.name + ".";
    plan.push_back({p + "input_layernorm", ShardRole::sequence_norm, 1, 0, ""});
    plan.push_back({p + "self_attn.q_proj", ShardRole::column, 1, H, "num_attention_heads", H / KV});
    plan.push_back({p + "self_attn.k_proj", ShardRole::column, 1, KV, "num_key_value_heads"});
    plan.push_back({p + "self_attn.v_proj", ShardRole::column, 1, KV, "num_key_value_heads"});
    plan.push_back({p + "self_attn.o_proj", ShardRole::row, 1, H, "num_attention_heads", H / KV});
    plan.push_back({p + "post_attention_layernorm", ShardRole::sequence_norm, 1, 0, ""});
    plan.push_back({p + "mlp.gate_proj", ShardRole::column, 1, I, "intermediate_size"});
    plan.push_back({p + "mlp.up_proj", ShardRole::column, 1, I, "intermediate_size"});
    plan.push_back({p + "mlp.down_proj", ShardRole::row, 1, I, "intermediate_size"});
  }
  plan.push_back({"model.norm", ShardRole::sequence_norm, 1, 0, ""});
  if (lm_head) plan.push_back({"lm_head", ShardRole::vocab_head, 1, cfg_.vocab_size, "vocab_size"});
  return plan;  // a tied head is the embedding's shard
}

double Llama::flops_per_token(int64_t T) const {
  const double table = lm_head ? double(cfg_.vocab_size * cfg_.hidden_size) : 0.0;
  return 6.0 * (double(num_parameters()) - table) +
         12.0 * double(cfg_.num_hidden_layers * cfg_.num_attention_heads * cfg_.head_dim() * T);
}

std::pair<Tensor, Tensor> Llama::rope(int64_t pos0, int64_t T, DType dtype, Device device) {
  // f32 tables for every compute dtype but f64 (rotary_embedding reads f32 cos/sin under 16-bit x).
  const DType table_dtype = dtype == DType::f64 ? DType::f64 : DType::f32;
  const int64_t need = pos0 + T;
  auto it = std::find_if(rope_.begin(), rope_.end(),
                         [&](const RopeTables& r) { return r.device == device && r.dtype == table_dtype; });
  if (it == rope_.end() || it->cos.size(0) < need) {
    // Grown to a power of two (at least 256 rows, at most max_position_embeddings) so a run whose
    // sequences lengthen rebuilds its tables a few times at most; each row is computed on its own,
    // so a grown table holds the same values in its first rows.
    int64_t n = 256;
    while (n < need) n *= 2;
    n = std::min(n, cfg_.max_position_embeddings);
    NoGradGuard no_grad;
    auto [c, s] = llama_rope_tables(cfg_, n, table_dtype, device);
    if (it == rope_.end()) it = rope_.insert(rope_.end(), RopeTables{device, table_dtype, c, s});
    else it->cos = c, it->sin = s;
  }
  return {narrow(it->cos, 0, pos0, T), narrow(it->sin, 0, pos0, T)};
}

Tensor Llama::embed(const Tensor& idx, int64_t pos0) {
  BLU_CHECK(idx.dim() == 2, "Llama: expected idx [B, T], got ", idx.shape());
  BLU_CHECK(idx.dtype() == DType::i32 || idx.dtype() == DType::i64, "Llama: idx must be i32 or i64, got ",
            idx.dtype());
  const int64_t T = idx.size(1);
  BLU_CHECK(T > 0 && pos0 >= 0 && pos0 + T <= cfg_.max_position_embeddings, "Llama: positions ", pos0, "..",
            pos0 + T - 1, " do not fit max_position_embeddings ", cfg_.max_position_embeddings);
  // The residual stream runs in the compute dtype (bf16/f16 for mixed precision).
  Tensor x = to_dtype(model->embed_tokens->forward(idx), compute_dtype());  // [B, T, C]
  return sharded.enter_blocks ? sharded.enter_blocks(x) : x;
}

Tensor Llama::run_block(size_t i, const Tensor& x, int64_t pos0, Tensor* cache_k, Tensor* cache_v) {
  // The rope rows of the whole sequence: under sequence parallelism x is this rank's shard, and
  // attention runs on the gathered positions.
  auto [cos, sin] = rope(pos0, x.size(1) * sharded.sequence_shards, x.dtype(), x.device());
  return (*model->layers)[int64_t(i)].forward(x, cos, sin, cache_k, cache_v);
}

LMOutput Llama::head(const Tensor& x, const Tensor& targets) {
  LMOutput out;
  Tensor y = model->norm->forward(x);
  if (sharded.enter_head) y = sharded.enter_head(y);  // tensor parallelism: f, or the sequence gather
  if (targets.defined() && loss_chunks() > 1 && !sharded.loss && (!lm_head || (lm_head->fusable() && !lm_head->bias.defined()))) {
    BLU_CHECK(targets.dim() == 2 && targets.size(0) == y.size(0) && targets.size(1) == y.size(1),
              "Llama: targets ", targets.shape(), " must be [B, T] of the input's ", y.shape());
    const int64_t N = y.size(0) * y.size(1);
    const nn::Embedding& e = *model->embed_tokens;
    const Tensor w = lm_head ? lm_head->cast_param(lm_head->weight, y.dtype()) : e.cast_param(e.weight, y.dtype());
    out.loss = linear_cross_entropy(reshape(y, {N, y.size(2)}), w, reshape(targets, {N}), /*ignore_index=*/-1,
                                    cfg_.vocab_size, loss_chunks());  // Note [Chunked loss]: no logits
    return out;
  }
  if (lm_head) {
    out.logits = lm_head->forward(y);
  } else {
    const nn::Embedding& e = *model->embed_tokens;
    out.logits = linear(y, e.cast_param(e.weight, y.dtype()));  // tied: y · embed_tokensᵀ
  }
  if (targets.defined()) {
    BLU_CHECK(targets.dim() == 2 && targets.size(0) == y.size(0) && targets.size(1) == y.size(1),
              "Llama: targets ", targets.shape(), " must be [B, T] of the input's ", y.shape());
    const int64_t N = y.size(0) * y.size(1);
    if (sharded.loss) {
      out.loss = sharded.loss(reshape(out.logits, {N, out.logits.size(-1)}), reshape(targets, {N}), cfg_.vocab_size);
      return out;
    }
    out.loss = cross_entropy(reshape(out.logits, {N, cfg_.vocab_size}), reshape(targets, {N}), /*ignore_index=*/-1,
                             Reduction::mean);
  }
  return out;
}

}  // namespace blu::models
