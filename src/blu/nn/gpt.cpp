#include "blu/nn/gpt.h"

#include <algorithm>
#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/ops/attention.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/fused.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu::nn {

// --- config ---

GPTConfig GPTConfig::preset(const std::string& name) {
  GPTConfig c;
  if (name == "d12") {
    c.n_layer = 12, c.n_head = 12, c.n_embd = 768;
  } else if (name == "d24") {
    c.n_layer = 24, c.n_head = 16, c.n_embd = 1024;
  } else if (name == "d36") {
    c.n_layer = 36, c.n_head = 20, c.n_embd = 1280;
  } else if (name == "d48") {
    c.n_layer = 48, c.n_head = 25, c.n_embd = 1600;
  } else if (name == "tiny") {
    c.block_size = 16, c.vocab_size = 101, c.padded_vocab_size = 128;
    c.n_layer = 2, c.n_head = 3, c.n_embd = 48;
  } else {
    BLU_CHECK(false, "GPTConfig::preset: unknown preset '", name, "' (expected d12, d24, d36, d48 or tiny)");
  }
  return c;
}

void GPTConfig::validate() const {
  BLU_CHECK(block_size > 0 && vocab_size > 0 && n_layer > 0 && n_head > 0 && n_embd > 0,
            "GPTConfig: sizes must be positive, got block_size ", block_size, ", vocab_size ", vocab_size,
            ", n_layer ", n_layer, ", n_head ", n_head, ", n_embd ", n_embd);
  BLU_CHECK(padded_vocab_size >= vocab_size, "GPTConfig: padded_vocab_size ", padded_vocab_size,
            " is smaller than vocab_size ", vocab_size);
  BLU_CHECK(n_embd % n_head == 0, "GPTConfig: n_embd ", n_embd, " is not a multiple of n_head ", n_head);
  BLU_CHECK(dropout >= 0.0 && dropout < 1.0, "GPTConfig: dropout must be in [0, 1), got ", dropout);
}

nlohmann::json GPTConfig::to_json() const {
  return {{"block_size", block_size}, {"vocab_size", vocab_size}, {"padded_vocab_size", padded_vocab_size},
          {"n_layer", n_layer},       {"n_head", n_head},         {"n_embd", n_embd},
          {"dropout", dropout},       {"bias", bias}};
}

GPTConfig GPTConfig::from_json(const nlohmann::json& j) {
  BLU_CHECK(j.is_object(), "GPTConfig::from_json: expected an object, got ", j.dump());
  const GPTConfig defaults;
  const nlohmann::json keys = defaults.to_json();
  for (auto& [k, _] : j.items()) BLU_CHECK(keys.contains(k), "GPTConfig::from_json: unknown key '", k, "'");
  for (auto& [k, _] : keys.items()) BLU_CHECK(j.contains(k), "GPTConfig::from_json: missing key '", k, "'");
  GPTConfig c;
  try {
    c.block_size = j.at("block_size").get<int64_t>();
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.padded_vocab_size = j.at("padded_vocab_size").get<int64_t>();
    c.n_layer = j.at("n_layer").get<int64_t>();
    c.n_head = j.at("n_head").get<int64_t>();
    c.n_embd = j.at("n_embd").get<int64_t>();
    c.dropout = j.at("dropout").get<double>();
    c.bias = j.at("bias").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, "GPTConfig::from_json: ", e.what());
  }
  c.validate();
  return c;
}

// --- blocks ---

CausalSelfAttention::CausalSelfAttention(const GPTConfig& cfg, Generator* gen)
    : n_head(cfg.n_head), n_embd(cfg.n_embd) {
  c_attn = std::make_shared<Linear>(cfg.n_embd, 3 * cfg.n_embd, cfg.bias);
  c_proj = std::make_shared<Linear>(cfg.n_embd, cfg.n_embd, cfg.bias);
  resid_dropout = std::make_shared<Dropout>(cfg.dropout, gen);
  register_module("c_attn", c_attn);
  register_module("c_proj", c_proj);
  register_module("resid_dropout", resid_dropout);
}

Tensor CausalSelfAttention::forward(const Tensor& x, Tensor* cache_k, Tensor* cache_v, const Tensor& residual) const {
  BLU_CHECK(x.dim() == 3 && x.size(2) == n_embd, "CausalSelfAttention: expected x [B, T, ", n_embd, "], got ",
            x.shape());
  const int64_t B = x.size(0), T = x.size(1), D = n_embd / n_head;
  // [B, T, 3C] → three [B, T, C] views → [B, H, T, D] each.
  std::vector<Tensor> qkv = split(c_attn->forward(x), n_embd, -1);
  auto heads = [&](const Tensor& t) { return transpose(view(t, {B, T, n_head, D}), 1, 2); };
  Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  bool causal = true;
  if (cache_k) {
    BLU_ASSERT(cache_v, "a key cache without a value cache");
    if (cache_k->defined()) {
      BLU_CHECK(T == 1, "CausalSelfAttention: with a non-empty cache the input must be one position, got ", T);
      k = cat({*cache_k, k}, 2);
      v = cat({*cache_v, v}, 2);
      causal = false;  // one query at the end sees every cached key
    }
    *cache_k = k;
    *cache_v = v;
  }
  Tensor y = scaled_dot_product_attention(q, k, v, causal);  // [B, H, T, D]
  y = reshape(transpose(y, 1, 2), {B, T, n_embd});
  if (!residual.defined()) return resid_dropout->forward(c_proj->forward(y));
  if (resid_dropout->active()) return residual + resid_dropout->forward(c_proj->forward(y));
  return c_proj->forward(y, residual);
}

MLP::MLP(const GPTConfig& cfg, Generator* gen) {
  c_fc = std::make_shared<Linear>(cfg.n_embd, 4 * cfg.n_embd, cfg.bias);
  c_proj = std::make_shared<Linear>(4 * cfg.n_embd, cfg.n_embd, cfg.bias);
  dropout = std::make_shared<Dropout>(cfg.dropout, gen);
  register_module("c_fc", c_fc);
  register_module("c_proj", c_proj);
  register_module("dropout", dropout);
}

Tensor MLP::forward(const Tensor& x, const Tensor& residual) const {
  // c_proj(gelu_tanh(c_fc(x))) with the GELU output recomputed in backward (ops/fused.h).
  const Tensor u = c_fc->forward(x);
  const Tensor w = c_proj->cast_param(c_proj->weight, u.dtype()), b = c_proj->cast_param(c_proj->bias, u.dtype());
  if (!residual.defined()) return dropout->forward(gelu_linear(u, w, b));
  if (dropout->active()) return residual + dropout->forward(gelu_linear(u, w, b));
  return gelu_linear(u, w, b, residual);
}

Block::Block(const GPTConfig& cfg, Generator* gen) {
  ln_1 = std::make_shared<LayerNorm>(cfg.n_embd, cfg.bias);
  attn = std::make_shared<CausalSelfAttention>(cfg, gen);
  ln_2 = std::make_shared<LayerNorm>(cfg.n_embd, cfg.bias);
  mlp = std::make_shared<MLP>(cfg, gen);
  register_module("ln_1", ln_1);
  register_module("attn", attn);
  register_module("ln_2", ln_2);
  register_module("mlp", mlp);
}

Tensor Block::forward(const Tensor& x, Tensor* cache_k, Tensor* cache_v) const {
  // The skip connections are added by the projections' GEMMs (linear's residual).
  const Tensor y = attn->forward(ln_1->forward(x), cache_k, cache_v, x);
  return mlp->forward(ln_2->forward(y), y);
}

// --- GPT ---

GPT::GPT(const GPTConfig& cfg, uint64_t seed) : cfg_(cfg), dropout_gen_(seed ^ 0x64726f70u /* "drop" */) {
  cfg_.validate();
  wte = std::make_shared<Embedding>(cfg_.padded_vocab_size, cfg_.n_embd);
  wpe = std::make_shared<Embedding>(cfg_.block_size, cfg_.n_embd);
  drop = std::make_shared<Dropout>(cfg_.dropout, &dropout_gen_);
  h = std::make_shared<ModuleList<Block>>();
  for (int64_t i = 0; i < cfg_.n_layer; ++i) h->push_back(std::make_shared<Block>(cfg_, &dropout_gen_));
  ln_f = std::make_shared<LayerNorm>(cfg_.n_embd, cfg_.bias);
  register_module("wte", wte);
  register_module("wpe", wpe);
  register_module("drop", drop);
  register_module("h", h);
  register_module("ln_f", ln_f);

  // GPT-2 init, in registration order. Biases and LayerNorms keep their constructed values.
  Generator gen(seed);
  const double proj_std = 0.02 / std::sqrt(2.0 * double(cfg_.n_layer));
  for (auto& [name, p] : named_parameters()) {
    if (p.dim() < 2) continue;
    const bool residual_proj = name.ends_with(".c_proj.weight");
    init_normal_(p, residual_proj ? proj_std : 0.02, gen);
  }
  if (cfg_.padded_vocab_size > cfg_.vocab_size) {
    NoGradGuard no_grad;
    fill_(narrow(wte->weight, 0, cfg_.vocab_size, cfg_.padded_vocab_size - cfg_.vocab_size), 0.0);
  }
}

Tensor GPT::hidden(const Tensor& idx, int64_t pos0, KVCache* cache) {
  BLU_CHECK(idx.dim() == 2, "GPT: expected idx [B, T], got ", idx.shape());
  BLU_CHECK(idx.dtype() == DType::i32 || idx.dtype() == DType::i64, "GPT: idx must be i32 or i64, got ",
            idx.dtype());
  const int64_t T = idx.size(1);
  BLU_CHECK(T > 0 && pos0 + T <= cfg_.block_size, "GPT: positions ", pos0, "..", pos0 + T - 1,
            " do not fit block_size ", cfg_.block_size);
  Tensor pos = arange(double(pos0), double(pos0 + T), 1, DType::i64, idx.device());
  // The residual stream runs in the compute dtype (bf16/f16 for mixed precision).
  Tensor x = drop->forward(to_dtype(wte->forward(idx) + wpe->forward(pos), compute_dtype()));  // [B, T, C]
  if (cache && cache->k.empty()) {
    cache->k.resize(size_t(cfg_.n_layer));
    cache->v.resize(size_t(cfg_.n_layer));
  }
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    x = cache ? (*h)[l].forward(x, &cache->k[size_t(l)], &cache->v[size_t(l)]) : (*h)[l].forward(x);
  }
  return ln_f->forward(x);
}

void GPT::set_compute_dtype(DType dtype) {
  BLU_CHECK(is_floating(dtype), "GPT: compute dtype must be floating, got ", dtype);
  compute_dtype_ = dtype;
}

GPTOutput GPT::forward(const Tensor& idx, const Tensor& targets) {
  GPTOutput out;
  Tensor x = hidden(idx, 0, nullptr);
  out.logits = linear(x, wte->cast_param(wte->weight, x.dtype()));  // tied: x · wteᵀ → [B, T, padded_vocab]
  if (targets.defined()) {
    BLU_CHECK(targets.shape() == idx.shape(), "GPT: targets ", targets.shape(), " must have idx's shape ",
              idx.shape());
    const int64_t B = idx.size(0), T = idx.size(1), V = cfg_.vocab_size;
    // Only the real vocabulary takes part in the loss: the first V of the padded_vocab columns are
    // the classes (num_classes), so the logits go in as a view [B·T, Vp] with no copy (narrowing to
    // V columns first could not merge B and T without cloning the logits).
    Tensor flat = reshape(out.logits, {B * T, out.logits.size(-1)});
    out.loss = cross_entropy(flat, reshape(targets, {B * T}), /*ignore_index=*/-1, Reduction::mean, V);
  }
  return out;
}

Tensor GPT::forward_cached(const Tensor& idx, KVCache& cache) {
  Tensor x = hidden(idx, cache.length(), &cache);
  return linear(x, wte->cast_param(wte->weight, x.dtype()));
}

namespace {

// Picks a token id from logits (already restricted to the real vocabulary).
int32_t sample_token(std::vector<double> logits, double temperature, int64_t top_k, Generator& gen) {
  const int64_t V = int64_t(logits.size());
  if (temperature <= 0.0 || top_k == 1) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());  // first maximum
  }
  if (top_k > 0 && top_k < V) {
    std::vector<double> sorted = logits;
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
    const double kth = sorted[size_t(top_k - 1)];
    for (double& l : logits)
      if (l < kth) l = -INFINITY;
  }
  const double mx = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (double& l : logits) total += (l = std::exp((l - mx) / temperature));
  const double u = rand({1}, DType::f32, kCPU, &gen).item() * total;
  double acc = 0.0;
  int32_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (logits[size_t(i)] == 0.0) continue;
    acc += logits[size_t(i)];
    last = int32_t(i);
    if (u < acc) return last;
  }
  return last;  // rounding left u at the very top: the last token with non-zero probability
}

}  // namespace

std::vector<int32_t> GPT::generate(const std::vector<int32_t>& prompt, int64_t max_new_tokens, double temperature,
                                   int64_t top_k, Generator& gen) {
  BLU_CHECK(!prompt.empty(), "GPT::generate: the prompt is empty (start with a token, e.g. <|endoftext|>)");
  BLU_CHECK(max_new_tokens >= 0 && top_k >= 0, "GPT::generate: expected max_new_tokens >= 0 and top_k >= 0, got ",
            max_new_tokens, " and ", top_k);
  for (int32_t t : prompt)
    BLU_CHECK(t >= 0 && t < cfg_.vocab_size, "GPT::generate: prompt token ", t, " is outside [0, ",
              cfg_.vocab_size, ")");
  NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  struct Restore {
    GPT* m;
    bool on;
    ~Restore() { m->train(on); }
  } restore{this, was_training};

  std::vector<int32_t> tokens = prompt;
  KVCache cache;
  const Device device = wte->weight.device();
  auto ids = [&](const int32_t* p, int64_t n) {
    const Tensor host = from_vector(std::vector<double>(p, p + n), {1, n}, DType::i32);
    return device.is_cpu() ? host : to_device(host, device);  // the model's device (a GPU: one copy)
  };
  Tensor logits;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t n = int64_t(tokens.size());
    if (step == 0 || cache.length() + 1 > cfg_.block_size) {
      // (Re)fill the cache with the last block_size tokens in one causal pass.
      cache.clear();
      const int64_t m = std::min(n, cfg_.block_size);
      logits = forward_cached(ids(tokens.data() + (n - m), m), cache);
    } else {
      logits = forward_cached(ids(&tokens.back(), 1), cache);
    }
    Tensor last = narrow(select(select(logits, 0, 0), 0, logits.size(1) - 1), 0, 0, cfg_.vocab_size);
    tokens.push_back(sample_token(to_vector(last), temperature, top_k, gen));
  }
  return std::vector<int32_t>(tokens.begin() + int64_t(prompt.size()), tokens.end());
}

}  // namespace blu::nn
