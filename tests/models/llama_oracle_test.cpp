// Llama against PyTorch, in the manner of llm.c's test_gpt2: tests/models/torch_llama_ref.py (HF's
// LlamaForCausalLM in plain PyTorch) writes a Hugging Face model folder — config.json and
// safetensors under HF's names — with random weights; BluTrain reads the config through the
// registry (from_hf_config), builds the model and imports the weights, runs the same batch and
// compares logits, loss and every parameter gradient at fp32 tolerance (atol 1e-5, rtol 1e-4),
// then ten AdamW steps (weight decay 0.1 on matrices, none on norms; lr 1e-3, betas 0.9/0.95): the
// loss before each step within 1e-5 relative of PyTorch's and the parameters after the last at
// the same fp32 tolerance.
// The model is odd on purpose: grouped-query attention with 3 query heads per key/value head (6
// heads, 2 kv heads), head dim 8, MLP 80, vocabulary 101 (no multiple of 64), T = 13, an untied
// head, rope_theta 500 and Llama 3 RoPE scaling whose bands put one frequency in each of the
// kept, interpolated and stretched ranges. Variants: a tied head (with lm_head.weight in the file,
// equal to the embedding), bf16 weights in shards, and the reverse direction — a BluTrain export
// that PyTorch loads strictly and must reproduce.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "blu/blu.h"
#include "blu/models/llama/hf.h"
#include "blu/models/llama/llama.h"
#include "blu/models/registry.h"
#include "blu/optim/optimizer.h"
#include "common/checks.h"
#include "common/opinfo.h"
#include "common/torch_oracle.h"

namespace blu::test {
namespace {

constexpr double kAtol = 1e-5, kRtol = 1e-4;
constexpr int64_t kB = 2, kT = 13, kVocab = 101;

nlohmann::json odd_hf_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_act", "silu"},
          {"hidden_size", 48},
          {"intermediate_size", 80},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 6},
          {"num_key_value_heads", 2},
          {"vocab_size", kVocab},
          {"max_position_embeddings", 32},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500.0},
          // inverse frequencies 1, 0.21, 0.045, 0.0095 → wavelengths 6.3 (< 32/4: kept), 30 (between:
          // interpolated), 140 and 660 (> 32/1: divided by 4).
          {"rope_scaling",
           {{"rope_type", "llama3"},
            {"factor", 4.0},
            {"low_freq_factor", 1.0},
            {"high_freq_factor", 4.0},
            {"original_max_position_embeddings", 32}}},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"tie_word_embeddings", false},
          {"torch_dtype", "float32"},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

struct Batch {
  Tensor idx, targets;
  Batch() {
    Generator g(77);
    idx = randint(0, kVocab, {kB, kT}, DType::i64, kCPU, &g);
    targets = randint(0, kVocab, {kB, kT}, DType::i64, kCPU, &g);
    NoGradGuard ng;
    fill_(narrow(narrow(targets, 0, 1, 1), 1, kT - 3, 3), -1.0);  // ignored positions
  }
};

// The model a folder describes, as a user gets it: config.json through the registry, then the weights.
std::unique_ptr<models::CausalLM> load_hf(const std::string& dir, uint64_t seed = 5) {
  const std::string file = dir + "/config.json";
  std::ifstream in(file);
  const nlohmann::json hf = nlohmann::json::parse(in);
  const models::ModelFamily& fam = models::family("llama");
  auto model = models::build_model(fam.from_hf_config(hf, file), seed);
  fam.import_hf(*model, dir);
  return model;
}

TorchResults run_writer(TorchOracle& oracle, const Batch& batch, nlohmann::json write, nlohmann::json extra = {}) {
  oracle.put("idx", batch.idx);
  oracle.put("targets", batch.targets);
  nlohmann::json manifest = {{"model_dir", oracle.dir() + "/hf"}, {"write", std::move(write)}};
  for (auto& [k, v] : extra.items()) manifest[k] = v;
  return oracle.run("models/torch_llama_ref.py", manifest);
}

void expect_matches(models::CausalLM& model, const Batch& batch, const TorchResults& want) {
  auto out = model.forward(batch.idx, batch.targets);
  out.loss.backward();
  ASSERT_EQ(out.logits.shape(), Shape({kB, kT, kVocab}));
  EXPECT_EQ(compare(out.logits.detach(), want.get("logits"), kAtol, kRtol), "") << "logits";
  EXPECT_EQ(compare(out.loss.detach(), want.get("loss"), kAtol, kRtol), "") << "loss";
  int64_t n = 0;
  for (auto& [name, p] : model.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << "no gradient for " << name;
    EXPECT_EQ(compare(p.grad(), want.get("grad." + name), kAtol, kRtol), "") << "gradient of " << name;
    ++n;
  }
  EXPECT_EQ(n, 2 + 9 * 2 + (model.tied_embeddings() ? 0 : 1)) << "parameters compared";
}

TEST(LlamaOracle, GqaLlama3UntiedLogitsLossAndGradientsMatchPyTorch) {
  Batch batch;
  TorchOracle oracle;
  auto want = run_writer(oracle, batch, {{"hf_config", odd_hf_config()}, {"seed", 3}, {"std", 0.2}});
  auto model = load_hf(oracle.dir() + "/hf");
  EXPECT_EQ(model->family(), "llama");
  EXPECT_FALSE(model->tied_embeddings());
  for (auto& [name, p] : model->named_parameters())
    EXPECT_TRUE(bitwise_equal(p, want.get("init." + name))) << "imported " << name;
  expect_matches(*model, batch, want);
}

TEST(LlamaOracle, TiedHeadWithLmHeadInTheFileMatchesPyTorch) {
  nlohmann::json hf = odd_hf_config();
  hf["tie_word_embeddings"] = true;
  hf["rope_scaling"] = nullptr;
  hf["rope_theta"] = 10000.0;
  Batch batch;
  TorchOracle oracle;
  auto want = run_writer(oracle, batch, {{"hf_config", hf}, {"seed", 4}, {"std", 0.2}, {"lm_head_when_tied", true}});
  auto model = load_hf(oracle.dir() + "/hf");
  EXPECT_TRUE(model->tied_embeddings());
  EXPECT_TRUE(model->find_module("lm_head") == nullptr);
  expect_matches(*model, batch, want);
}

TEST(LlamaOracle, ShardedBf16ImportMatchesPyTorch) {
  Batch batch;
  TorchOracle oracle;
  // Shards of at most 12 KB: each layer's tensors spread over several files.
  auto want = run_writer(oracle, batch,
                         {{"hf_config", odd_hf_config()}, {"seed", 6}, {"std", 0.2}, {"dtype", "bfloat16"},
                          {"shard_bytes", 12000}});
  const std::string dir = oracle.dir() + "/hf";
  ASSERT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  ASSERT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
  auto model = load_hf(dir);
  for (auto& [name, p] : model->named_parameters())
    EXPECT_TRUE(bitwise_equal(p, want.get("init." + name))) << "bf16 " << name << " cast to f32";
  expect_matches(*model, batch, want);
}

TEST(LlamaOracle, ExportLoadsInPyTorch) {
  for (int64_t shard : {int64_t(0), int64_t(20000)}) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE("shard bytes " + std::to_string(shard) + (tied ? ", tied" : ", untied"));
      models::LlamaConfig cfg = models::LlamaConfig::preset("tiny");
      cfg.tie_word_embeddings = tied;
      cfg.rope_scaling = models::LlamaRopeScaling{.factor = 4.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                                  .original_max_position_embeddings = 32};
      cfg.rope_theta = 500.0;
      models::Llama model(cfg, 11);
      {
        NoGradGuard ng;  // wider weights and norms away from one, as the writer's
        Generator g(12);
        for (auto& [name, p] : model.named_parameters())
          copy_(p, p.dim() >= 2 ? mul(randn(p.shape(), DType::f32, kCPU, &g), 0.2)
                                : add(mul(randn(p.shape(), DType::f32, kCPU, &g), 0.2), 1.0));
      }
      Batch batch;
      TorchOracle oracle;
      models::export_hf_llama(model, oracle.dir() + "/hf", {.max_shard_bytes = shard});
      oracle.put("idx", batch.idx);
      oracle.put("targets", batch.targets);
      auto want = oracle.run("models/torch_llama_ref.py", {{"model_dir", oracle.dir() + "/hf"}});
      expect_matches(model, batch, want);
    }
  }
}

TEST(LlamaOracle, TenAdamWStepsMatchPyTorch) {
  constexpr int kSteps = 10;
  constexpr double kLr = 1e-3, kWd = 0.1, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8;
  Batch batch;
  TorchOracle oracle;
  auto want = run_writer(oracle, batch, {{"hf_config", odd_hf_config()}, {"seed", 8}, {"std", 0.2}},
                         {{"adamw",
                           {{"steps", kSteps},
                            {"lr", kLr},
                            {"weight_decay", kWd},
                            {"betas", {kBeta1, kBeta2}},
                            {"eps", kEps}}}});
  auto model = load_hf(oracle.dir() + "/hf");
  auto opt = optim::make_adamw(optim::decay_groups(model->named_parameters(), kWd),
                               optim::AdamWOptions{.lr = kLr, .beta1 = kBeta1, .beta2 = kBeta2, .eps = kEps});
  const std::vector<double> torch_losses = to_vector(want.get("losses"));
  ASSERT_EQ(torch_losses.size(), size_t(kSteps));
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    Tensor loss = model->forward(batch.idx, batch.targets).loss;
    loss.backward();
    EXPECT_NEAR(loss.item(), torch_losses[size_t(step)], 1e-5 * std::abs(torch_losses[size_t(step)]))
        << "loss before step " << step;
    opt->step();
  }
  EXPECT_LT(torch_losses.back(), torch_losses.front() - 0.1) << "the run should learn the batch";
  for (auto& [name, p] : model->named_parameters())
    EXPECT_EQ(compare(p.detach(), want.get("param." + name), kAtol, kRtol), "")
        << "parameter " << name << " after " << kSteps << " steps";
}

}  // namespace
}  // namespace blu::test
