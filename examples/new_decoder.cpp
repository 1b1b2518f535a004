// examples/new_decoder: a new decoder model in one file, trained by the unchanged trainer.
//   1. A model class implementing models::CausalLM: a pre-norm decoder with parallel attention and
//      MLP branches (GPT-J, PaLM: x + attn(norm(x)) + mlp(norm(x))), RMSNorm, learned positions,
//      an exact-GELU MLP and an untied LM head.
//   2. Its family registered as "example" with the preset "tiny", so models::resolve_model_config,
//      models::build_model, the trainer and train::load_model all reach it by name.
//   3. main(): writes token shards, trains "example:tiny" with train::Trainer, reloads the final
//      checkpoint with train::load_model and samples from it. Exits non-zero when the loss did not
//      fall, the reloaded model differs from the trained one, its greedy sample does not continue the
//      count the data holds, or forward_cached disagrees with forward.
// Usage: new_decoder [WORK_DIR] (default: a folder under the system's temporary directory).
// The family lives in this binary only: `blutrain train --model example:tiny` does not know it.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <vector>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/data/shard.h"
#include "blu/models/registry.h"
#include "blu/nn/norms.h"
#include "blu/ops/attention.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/nn.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"

namespace example {
using namespace blu;

// --- 1. The configuration: what config() writes into checkpoints and the registry rebuilds from.
struct ExampleConfig {
  int64_t vocab_size = 64, block_size = 32, n_layer = 2, n_head = 4, n_embd = 32;
  double eps = 1e-5;
  nlohmann::json to_json() const {  // "family" is how build_model finds this family again
    return {{"family", "example"}, {"vocab_size", vocab_size}, {"block_size", block_size},
            {"n_layer", n_layer},  {"n_head", n_head},         {"n_embd", n_embd}, {"eps", eps}};
  }
  static ExampleConfig from_json(const nlohmann::json& j) {
    BLU_CHECK(j.value("family", "example") == "example", "ExampleConfig: family: expected \"example\", got ",
              j["family"].dump());
    ExampleConfig c;
    for (auto [key, field] : {std::pair{"vocab_size", &c.vocab_size}, {"block_size", &c.block_size},
                              {"n_layer", &c.n_layer}, {"n_head", &c.n_head}, {"n_embd", &c.n_embd}}) {
      BLU_CHECK(j.contains(key) && j[key].is_number_integer(), "ExampleConfig: ", key, ": expected an integer, got ",
                j.contains(key) ? j[key].dump() : "nothing");
      *field = j[key].get<int64_t>();
    }
    c.eps = j.value("eps", c.eps);
    BLU_CHECK(c.vocab_size > 0 && c.block_size > 0 && c.n_layer > 0 && c.n_head > 0 && c.n_embd % c.n_head == 0,
              "ExampleConfig: expected positive sizes and n_embd % n_head == 0, got ", j.dump());
    return c;
  }
};

// --- 2. The repeated block. Names matter: they are the state-dict keys ("h.0.qkv.weight").
class ParallelBlock : public nn::Module {
 public:
  explicit ParallelBlock(const ExampleConfig& c) : n_head(c.n_head) {
    norm = std::make_shared<nn::RMSNorm>(c.n_embd, c.eps);
    qkv = std::make_shared<nn::Linear>(c.n_embd, 3 * c.n_embd, false);
    attn_out = std::make_shared<nn::Linear>(c.n_embd, c.n_embd, false);
    fc = std::make_shared<nn::Linear>(c.n_embd, 4 * c.n_embd, false);
    mlp_out = std::make_shared<nn::Linear>(4 * c.n_embd, c.n_embd, false);
    register_module("norm", norm);
    register_module("qkv", qkv);
    register_module("attn_out", attn_out);
    register_module("fc", fc);
    register_module("mlp_out", mlp_out);
  }
  // x [B, T, C] → x + attn(norm(x)) + mlp(norm(x)). With a cache (cache_k, cache_v [B, H, T', D]):
  // this call's keys and values are appended and attended over; T is then 1 unless it is empty.
  Tensor forward(const Tensor& x, Tensor* cache_k = nullptr, Tensor* cache_v = nullptr) const {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), D = C / n_head;
    const Tensor h = norm->forward(x);  // one norm feeds both branches
    std::vector<Tensor> parts = split(qkv->forward(h), C, -1);
    auto heads = [&](const Tensor& t) { return transpose(view(t, {B, T, n_head, D}), 1, 2); };
    Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    bool causal = true;
    if (cache_k && cache_k->defined()) {  // decoding: one new position sees every cached key
      BLU_CHECK(T == 1, "ParallelBlock: with a non-empty cache the input must be one position, got ", T);
      k = cat({*cache_k, k}, 2), v = cat({*cache_v, v}, 2), causal = false;
    }
    if (cache_k) *cache_k = k, *cache_v = v;
    const Tensor y = reshape(transpose(scaled_dot_product_attention(q, k, v, causal), 1, 2), {B, T, C});
    // Both skip connections ride on the output projections' GEMMs (Linear::forward's residual).
    return mlp_out->forward(gelu(fc->forward(h)), attn_out->forward(y, x));
  }
  int64_t n_head;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::Linear> qkv, attn_out, fc, mlp_out;
};

// --- 3. The model: everything above nn/ sees it only through models::CausalLM.
class ParallelDecoder : public models::CausalLM {
 public:
  ParallelDecoder(const ExampleConfig& c, uint64_t seed) : cfg_(c) {
    wte = std::make_shared<nn::Embedding>(c.vocab_size, c.n_embd);
    wpe = std::make_shared<nn::Embedding>(c.block_size, c.n_embd);  // learned positions
    h = std::make_shared<nn::ModuleList<ParallelBlock>>();
    for (int64_t l = 0; l < c.n_layer; ++l) h->push_back(std::make_shared<ParallelBlock>(c));
    ln_f = std::make_shared<nn::RMSNorm>(c.n_embd, c.eps);
    lm_head = std::make_shared<nn::Linear>(c.n_embd, c.vocab_size, false);  // untied
    register_module("wte", wte);
    register_module("wpe", wpe);
    register_module("h", h);
    register_module("ln_f", ln_f);
    register_module("lm_head", lm_head);
    // Deterministic init from the seed (the registry's contract): matrices normal(0, 0.02).
    Generator gen(seed);
    for (auto& [name, p] : named_parameters())
      if (p.dim() >= 2) nn::init_normal_(p, 0.02, gen);
  }
  std::string family() const override { return "example"; }
  nlohmann::json config() const override { return cfg_.to_json(); }
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  int64_t max_seq_len() const override { return cfg_.block_size; }
  // The forward in three parts; CausalLM composes them into forward() and forward_cached().
  Tensor embed(const Tensor& idx, int64_t pos0) override {  // → the residual stream, in the compute dtype
    const int64_t T = idx.size(1);
    BLU_CHECK(idx.dim() == 2 && pos0 + T <= cfg_.block_size, "ParallelDecoder: expected idx [B, T] with positions ",
              "below block_size ", cfg_.block_size, ", got ", idx.shape(), " at position ", pos0);
    const Tensor pos = arange(double(pos0), double(pos0 + T), 1, DType::i64, idx.device());
    return to_dtype(wte->forward(idx) + wpe->forward(pos), compute_dtype());  // so --precision bf16 works
  }
  models::LMOutput head(const Tensor& x, const Tensor& targets) override {
    models::LMOutput out;
    out.logits = lm_head->forward(ln_f->forward(x));  // [B, T, V]
    if (targets.defined()) {  // targets are given already shifted; -1 marks positions to ignore
      const int64_t N = x.size(0) * x.size(1);
      out.loss = cross_entropy(reshape(out.logits, {N, cfg_.vocab_size}), reshape(targets, {N}),
                               /*ignore_index=*/-1);
    }
    return out;
  }
  std::vector<models::BlockRef> blocks() const override {  // where pipeline stages and recompute cut
    std::vector<models::BlockRef> out;
    for (int64_t l = 0; l < h->size(); ++l) out.push_back({"h." + std::to_string(l), &(*h)[l]});
    return out;
  }
  nn::Embedding& token_embedding() const override { return *wte; }
  Tensor output_weight() const override { return lm_head->weight; }
  double flops_per_token(int64_t T) const override {  // both embedding tables are lookups, not matmuls
    const double lookups = double((cfg_.vocab_size + cfg_.block_size) * cfg_.n_embd);
    return 6.0 * (double(num_parameters()) - lookups) + 12.0 * double(cfg_.n_layer * cfg_.n_embd * T);
  }

  std::shared_ptr<nn::Embedding> wte, wpe;
  std::shared_ptr<nn::ModuleList<ParallelBlock>> h;
  std::shared_ptr<nn::RMSNorm> ln_f;
  std::shared_ptr<nn::Linear> lm_head;

 protected:
  Tensor run_block(size_t i, const Tensor& x, int64_t /*pos0*/, Tensor* cache_k, Tensor* cache_v) override {
    return (*h)[int64_t(i)].forward(x, cache_k, cache_v);
  }

 private:
  ExampleConfig cfg_;
};

// --- 4. The family: a builder from config JSON and the presets `FAMILY:PRESET` names.
models::ModelFamily example_family() {
  models::ModelFamily f;
  f.name = "example";
  f.build = [](const nlohmann::json& config, uint64_t seed) -> std::unique_ptr<models::CausalLM> {
    return std::make_unique<ParallelDecoder>(ExampleConfig::from_json(config), seed);
  };
  f.presets = {"tiny"};
  f.preset = [](const std::string& name) {
    BLU_CHECK(name == "tiny", "example: unknown preset '", name, "' (expected tiny)");
    return ExampleConfig().to_json();
  };
  return f;  // no Hugging Face interop: hf_architectures, from_hf_config, import_hf, export_hf stay empty
}
BLU_REGISTER_MODEL_FAMILY(example_family);

}  // namespace example

int main(int argc, char** argv) try {
  using namespace blu;
  namespace fs = std::filesystem;
  const fs::path work = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "blu_new_decoder";
  fs::create_directories(work / "data");

  // Token shards (llm.c's layout): runs that count up modulo 64 from a random token, each 8 to 39
  // tokens long, so predicting the next token takes the context (not the position).
  auto tokens = [](size_t n, uint32_t seed) {
    std::vector<uint16_t> t(n);
    uint32_t next = 0, left = 0;
    for (size_t i = 0; i < n; ++i, --left) {
      seed = seed * 1664525u + 1013904223u;
      if (left == 0) next = (seed >> 8) % 64, left = 8 + (seed >> 20) % 32;
      t[i] = uint16_t(next++ % 64);
    }
    return t;
  };
  write_shard(work / "data/example_train_000000.bin", tokens(20000, 1), /*overwrite=*/true);
  write_shard(work / "data/example_val_000000.bin", tokens(4000, 2), /*overwrite=*/true);

  // Train with the stock trainer: the model is named by its registry spec, nothing else changes.
  train::TrainOptions o;
  o.model = models::resolve_model_config("example:tiny");
  o.train_pattern = (work / "data/example_train_*.bin").string();
  o.val_pattern = (work / "data/example_val_*.bin").string();
  o.out = (work / "run").string();
  o.overwrite = true;  // replaces only the trainer's own files from an earlier run of this example
  o.batch_size = 8, o.steps = 40, o.warmup = 4, o.lr = 1e-2, o.min_lr = 1e-3, o.log_every = 10;
  std::vector<double> losses;
  train::TrainCallbacks cb;
  cb.log = &std::cout;
  cb.on_step = [&](const train::StepStats& s) { losses.push_back(s.loss); };
  train::Trainer trainer(o, cb);
  const train::TrainSummary summary = trainer.run();
  std::printf("loss: first step %.4f, last step %.4f, validation %.4f\n", losses.front(), losses.back(),
              summary.final_val_loss);
  bool ok = true;
  auto check = [&ok](bool cond, const char* what) {
    if (!cond) std::printf("FAILED: %s\n", what), ok = false;
  };
  check(losses.back() < 0.5 * losses.front(), "the training loss did not halve");

  // Reload the final checkpoint: its stored config names the family, the registry rebuilds it.
  std::unique_ptr<models::CausalLM> loaded = train::load_model(summary.checkpoint, kCPU);
  NoGradGuard no_grad;
  trainer.model().eval();
  const Tensor probe = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {1, 8}, DType::i32);
  const double diff = max(abs(loaded->forward(probe).logits - trainer.model().forward(probe).logits)).item();
  std::printf("reloaded %s model from %s: max |logit difference| %g\n", loaded->family().c_str(),
              summary.checkpoint.c_str(), diff);
  check(loaded->family() == "example" && diff == 0.0, "the reloaded model is not the trained one");

  // Sample greedily (generate runs forward_cached: the prompt at once, then one position per token).
  Generator gen(7);
  const std::vector<int32_t> prompt = {10, 11, 12};
  const std::vector<int32_t> sample = loaded->generate(prompt, 12, /*temperature=*/0.0, /*top_k=*/0, gen);
  std::printf("greedy sample after 10 11 12:");
  bool counts = true;
  for (size_t i = 0; i < sample.size(); ++i) std::printf(" %d", sample[i]), counts = counts && sample[i] == 13 + int(i);
  std::printf("\n");
  check(counts, "the sample does not continue the count 13, 14, ...");

  // The cache: feeding the sequence one position at a time gives the uncached forward's logits.
  std::vector<double> seq(prompt.begin(), prompt.end());
  seq.insert(seq.end(), sample.begin(), sample.end());
  const Tensor all = from_vector(seq, {1, int64_t(seq.size())}, DType::i32);
  const Tensor full = loaded->forward(all).logits;  // [1, n, V]
  models::KVCache cache;
  double cache_diff = 0.0;
  for (int64_t i = 0; i < all.size(1); ++i) {
    const Tensor one = loaded->forward_cached(narrow(all, 1, i, 1), cache);  // [1, 1, V]
    cache_diff = std::max(cache_diff, max(abs(one - narrow(full, 1, i, 1))).item());
  }
  std::printf("cached vs uncached logits: max |difference| %g\n", cache_diff);
  check(cache_diff < 1e-4, "forward_cached differs from forward");
  if (ok) std::printf("OK\n");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "new_decoder: %s\n", e.what());
  return 1;
}
