#include "blu/models/gpt2/gpt2.h"

#include <algorithm>
#include <cmath>

#include "blu/core/grad_mode.h"
#include "blu/models/activations.h"
#include "blu/models/gpt2/hf.h"
#include "blu/models/registry.h"
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
    c.n_layer = 2, c.n_head = 2, c.n_embd = 64, c.block_size = 64;
  } else if (name == "demo") {
    c.n_layer = 4, c.n_head = 4, c.n_embd = 128, c.block_size = 128;
  } else if (name == "demo-byte" || name == "demo-byte-gpu") {
    // Byte-level (data/byte_tokenizer.h: 256 bytes + <|endoftext|>, rows padded to 320) for the
    // README's first run on Debian's fortunes (scripts/demo.sh): demo-byte is sized for about three
    // minutes on a 2-core CPU, demo-byte-gpu for a few minutes on one GPU.
    c.vocab_size = 257, c.padded_vocab_size = 320;
    if (name == "demo-byte")
      c.n_layer = 4, c.n_head = 4, c.n_embd = 128, c.block_size = 128;
    else
      c.n_layer = 6, c.n_head = 6, c.n_embd = 384, c.block_size = 256, c.dropout = 0.1;
  } else {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    BLU_CHECK(false, "unknown GPT-2 preset '", name, "': expected one of ", known);
  }
  return c;
}

std::vector<std::string> GPTConfig::preset_names() {
  return {"tiny", "demo", "demo-byte", "demo-byte-gpu", "d12", "d24", "d36", "d48"};
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
  return {{"family", "gpt2"},
          {"block_size", block_size}, {"vocab_size", vocab_size}, {"padded_vocab_size", padded_vocab_size},
          {"n_layer", n_layer},       {"n_head", n_head},         {"n_embd", n_embd},
          {"dropout", dropout},       {"bias", bias}};
}

GPTConfig GPTConfig::from_json(const nlohmann::json& j) {
  BLU_CHECK(j.is_object(), "GPTConfig::from_json: expected an object, got ", j.dump());
  const GPTConfig defaults;
  const nlohmann::json keys = defaults.to_json();
  for (auto& [k, _] : j.items()) BLU_CHECK(keys.contains(k), "GPTConfig::from_json: unknown key '", k, "'");
  for (auto& [k, _] : keys.items())
    BLU_CHECK(k == "family" || j.contains(k), "GPTConfig::from_json: missing key '", k, "'");
  if (j.contains("family"))
    BLU_CHECK(j["family"] == "gpt2", "GPTConfig::from_json: expected family \"gpt2\", got ", j["family"].dump());
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
  // [B, T, 3W] → three [B, T, W] views → [B, H, T, D] each. W = n_embd, or under tensor
  // parallelism this rank's n_head heads' width (c_attn's shard); T is the projection's, which
  // sequence parallelism gathers from x's sequence shard.
  const Tensor proj = c_attn->forward(x);
  const int64_t B = proj.size(0), T = proj.size(1), D = n_embd / n_head, W = c_attn->out_features / 3, H = W / D;
  auto heads = [=](const Tensor& t) { return transpose(view(t, {B, T, H, D}), 1, 2); };
  Tensor y;
  if (!cache_k) {
    // The attention core, a selective-recompute region (models/activations.h): under a selective
    // policy only proj is kept, and the attention output and its merged heads are rebuilt in backward.
    y = selective_region(
        "attention core",
        [=](const std::vector<Tensor>& in) {
          std::vector<Tensor> qkv = split(in[0], W, -1);
          const Tensor o = scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), true);
          return reshape(transpose(o, 1, 2), {B, T, W});  // [B, H, T, D] → [B, T, W]
        },
        {proj});
  } else {
    BLU_ASSERT(cache_v, "a key cache without a value cache");
    std::vector<Tensor> qkv = split(proj, W, -1);
    Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    bool causal = true;
    if (cache_k->defined()) {
      BLU_CHECK(T == 1, "CausalSelfAttention: with a non-empty cache the input must be one position, got ", T);
      k = cat({*cache_k, k}, 2);
      v = cat({*cache_v, v}, 2);
      causal = false;  // one query at the end sees every cached key
    }
    *cache_k = k;
    *cache_v = v;
    y = reshape(transpose(scaled_dot_product_attention(q, k, v, causal), 1, 2), {B, T, W});
  }
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
  // c_proj(gelu_tanh(c_fc(x))) with the GELU output recomputed in backward (ops/fused.h); under an
  // mlp policy c_fc's output too, from x (models/activations.h).
  const Tensor u = mlp_region([this](const std::vector<Tensor>& in) { return c_fc->forward(in[0]); }, {x});
  if (!c_proj->fusable()) {  // a sharded c_proj (tensor parallelism) reduces its GEMM's output itself
    const Tensor h = gelu(u, /*approximate=*/true);
    if (!residual.defined()) return dropout->forward(c_proj->forward(h));
    if (dropout->active()) return residual + dropout->forward(c_proj->forward(h));
    return c_proj->forward(h, residual);
  }
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
  wte->set_row_sparse_grad(true);  // tied to the LM head: its rows may be exchanged apart
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
    nn::init_normal_(p, residual_proj ? proj_std : 0.02, gen);
  }
  if (cfg_.padded_vocab_size > cfg_.vocab_size) {
    NoGradGuard no_grad;
    fill_(narrow(wte->weight, 0, cfg_.vocab_size, cfg_.padded_vocab_size - cfg_.vocab_size), 0.0);
  }
}

Tensor GPT::embed(const Tensor& idx, int64_t pos0) {
  BLU_CHECK(idx.dim() == 2, "GPT: expected idx [B, T], got ", idx.shape());
  BLU_CHECK(idx.dtype() == DType::i32 || idx.dtype() == DType::i64, "GPT: idx must be i32 or i64, got ",
            idx.dtype());
  const int64_t T = idx.size(1);
  BLU_CHECK(T > 0 && pos0 >= 0 && pos0 + T <= cfg_.block_size, "GPT: positions ", pos0, "..", pos0 + T - 1,
            " do not fit block_size ", cfg_.block_size);
  Tensor pos = arange(double(pos0), double(pos0 + T), 1, DType::i64, idx.device());
  // The residual stream runs in the compute dtype (bf16/f16 for mixed precision).
  Tensor x = to_dtype(wte->forward(idx) + wpe->forward(pos), compute_dtype());  // [B, T, C]
  if (sharded.enter_blocks) x = sharded.enter_blocks(x);
  return drop->forward(x);
}

Tensor GPT::run_block(size_t i, const Tensor& x, int64_t /*pos0*/, Tensor* cache_k, Tensor* cache_v) {
  return (*h)[int64_t(i)].forward(x, cache_k, cache_v);
}

std::vector<BlockRef> GPT::blocks() const {
  std::vector<BlockRef> out;
  for (int64_t i = 0; i < h->size(); ++i) out.push_back({"h." + std::to_string(i), &(*h)[i]});
  return out;
}

double GPT::flops_per_token(int64_t T) const {
  // Every parameter but the position table multiplies each token once (wte as the LM head).
  const double n = double(num_parameters()) - double(cfg_.block_size * cfg_.n_embd);
  return 6.0 * n + 12.0 * double(cfg_.n_layer * cfg_.n_embd * T);
}

std::vector<ShardSpec> GPT::tensor_parallel_plan() const {
  std::vector<ShardSpec> plan{{"wte", ShardRole::vocab_embedding, 1, cfg_.padded_vocab_size, "padded_vocab_size"}};
  for (const BlockRef& b : blocks()) {
    const std::string p = b.name + ".";
    plan.push_back({p + "ln_1", ShardRole::sequence_norm, 1, 0, ""});
    plan.push_back({p + "attn.c_attn", ShardRole::column, 3, cfg_.n_head, "n_head"});
    plan.push_back({p + "attn.c_proj", ShardRole::row, 1, cfg_.n_head, "n_head"});
    plan.push_back({p + "ln_2", ShardRole::sequence_norm, 1, 0, ""});
    plan.push_back({p + "mlp.c_fc", ShardRole::column, 1, 4 * cfg_.n_embd, "4·n_embd"});
    plan.push_back({p + "mlp.c_proj", ShardRole::row, 1, 4 * cfg_.n_embd, "4·n_embd"});
  }
  plan.push_back({"ln_f", ShardRole::sequence_norm, 1, 0, ""});
  return plan;  // the tied head is wte's shard
}

LMOutput GPT::head(const Tensor& x, const Tensor& targets) {
  LMOutput out;
  Tensor y = ln_f->forward(x);
  if (sharded.enter_head) y = sharded.enter_head(y);  // tensor parallelism: f, or the sequence gather
  const Tensor w = wte->cast_param(wte->weight, y.dtype());  // tied: the head is y · wteᵀ
  if (targets.defined()) {
    BLU_CHECK(targets.dim() == 2 && targets.size(0) == y.size(0) && targets.size(1) == y.size(1), "GPT: targets ",
              targets.shape(), " must be [B, T] of the input's ", y.shape());
    const int64_t B = y.size(0), T = y.size(1), V = cfg_.vocab_size;
    if (loss_chunks() > 1 && !sharded.loss) {  // Note [Chunked loss]: no logits
      out.loss = linear_cross_entropy(reshape(y, {B * T, y.size(2)}), w, reshape(targets, {B * T}),
                                      /*ignore_index=*/-1, V, loss_chunks());
      return out;
    }
  }
  out.logits = linear(y, w);  // [B, T, padded_vocab]
  if (targets.defined()) {
    const int64_t B = y.size(0), T = y.size(1), V = cfg_.vocab_size;
    // Only the real vocabulary takes part in the loss: the first V of the padded_vocab columns are
    // the classes (num_classes), so the logits go in as a view [B·T, Vp] with no copy (narrowing to
    // V columns first could not merge B and T without cloning the logits).
    Tensor flat = reshape(out.logits, {B * T, out.logits.size(-1)});
    if (sharded.loss) {
      out.loss = sharded.loss(flat, reshape(targets, {B * T}), V);
      return out;
    }
    out.loss = cross_entropy(flat, reshape(targets, {B * T}), /*ignore_index=*/-1, Reduction::mean, V);
  }
  return out;
}

namespace {

ModelFamily gpt2_family() {
  ModelFamily f;
  f.name = "gpt2";
  f.build = [](const nlohmann::json& config, uint64_t seed) -> std::unique_ptr<CausalLM> {
    return std::make_unique<GPT>(GPTConfig::from_json(config), seed);
  };
  f.presets = GPTConfig::preset_names();
  f.preset = [](const std::string& name) { return GPTConfig::preset(name).to_json(); };
  f.hf_architectures = {"GPT2LMHeadModel", "GPT2Model"};
  f.from_hf_config = gpt2_config_from_hf;
  f.import_hf = [](CausalLM& model, const std::string& path) {
    auto* gpt = dynamic_cast<GPT*>(&model);
    BLU_CHECK(gpt, "import_hf_gpt2: expected a gpt2 model, got ", model.family());
    import_hf_gpt2(hf_weights_file(path), *gpt);
  };
  f.export_hf = [](const CausalLM& model, const std::string& dir) {
    auto* gpt = dynamic_cast<const GPT*>(&model);
    BLU_CHECK(gpt, "export_hf_gpt2: expected a gpt2 model, got ", model.family());
    export_hf_gpt2_folder(*gpt, dir);
  };
  return f;
}

}  // namespace

BLU_REGISTER_MODEL_FAMILY(gpt2_family);

}  // namespace blu::models
