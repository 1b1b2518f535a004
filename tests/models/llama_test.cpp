// Llama without PyTorch: the config (JSON round trip, presets, validation), the registry's view of
// the family, init, the key/value cache against the uncached forward, mixed precision, Hugging
// Face config.json parsing and its errors, and export → import (single file and shards, tied and
// untied, f32 and bf16) bit-exact, with the import's errors naming file, tensor, expected and got.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "blu/blu.h"
#include "blu/io/safetensors.h"
#include "blu/models/llama/hf.h"
#include "blu/models/llama/llama.h"
#include "blu/models/registry.h"
#include "common/checks.h"
#include "common/opinfo.h"

namespace blu::test {
namespace {

namespace fs = std::filesystem;
using models::Llama;
using models::LlamaConfig;

// A fresh temporary folder, removed with its contents at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/blu_llama_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}
void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2); }

// Wide random weights (logits far from uniform, so argmax is decisive) and norms away from one.
void randomize(Llama& m, uint64_t seed) {
  NoGradGuard ng;
  Generator g(seed);
  for (auto& [name, p] : m.named_parameters())
    copy_(p, p.dim() >= 2 ? mul(randn(p.shape(), DType::f32, kCPU, &g), 0.3)
                          : add(mul(randn(p.shape(), DType::f32, kCPU, &g), 0.2), 1.0));
}

bool same_state(const nn::Module& a, const nn::Module& b) {
  const auto sa = a.state_dict(), sb = b.state_dict();
  if (sa.size() != sb.size()) return false;
  for (size_t i = 0; i < sa.size(); ++i)
    if (sa[i].first != sb[i].first || !bitwise_equal(sa[i].second, sb[i].second)) return false;
  return true;
}

// --- config ---

TEST(LlamaConfig, PresetsHaveThePeerShapes) {
  struct Want {
    const char* name;
    int64_t C, L, H, KV, I, V;
    bool tied;
    int64_t params;
  };
  // Parameter counts of the public models (SmolLM-135M: 134,515,008; Llama-3.2-1B: 1,235,814,400).
  for (const Want& w : {Want{"smollm-135m", 576, 30, 9, 3, 1536, 49152, true, 134515008},
                        Want{"llama-250m", 1024, 16, 16, 4, 2816, 32000, false, 0},
                        Want{"llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, true, 1235814400}}) {
    const LlamaConfig c = LlamaConfig::preset(w.name);
    EXPECT_EQ(c.hidden_size, w.C) << w.name;
    EXPECT_EQ(c.num_hidden_layers, w.L) << w.name;
    EXPECT_EQ(c.num_attention_heads, w.H) << w.name;
    EXPECT_EQ(c.num_key_value_heads, w.KV) << w.name;
    EXPECT_EQ(c.intermediate_size, w.I) << w.name;
    EXPECT_EQ(c.vocab_size, w.V) << w.name;
    EXPECT_EQ(c.tie_word_embeddings, w.tied) << w.name;
    if (w.params) {  // counted from the shapes (building a 1B model here would take too long)
      const int64_t D = w.C / w.H;
      const int64_t layer = w.C * w.H * D + 2 * w.C * w.KV * D + w.H * D * w.C + 3 * w.C * w.I + 2 * w.C;
      EXPECT_EQ(w.V * w.C + w.L * layer + w.C + (w.tied ? 0 : w.V * w.C), w.params) << w.name;
    }
  }
  EXPECT_TRUE(LlamaConfig::preset("llama3.2-1b").rope_scaling.has_value());
  EXPECT_FALSE(LlamaConfig::preset("smollm-135m").rope_scaling.has_value());
  expect_error([] { LlamaConfig::preset("llama-7b"); }, {"llama-7b", "smollm-135m", "tiny"});
}

TEST(LlamaConfig, JsonRoundTripsAndRejectsUnknownOrMissingKeys) {
  for (const auto& name : LlamaConfig::preset_names()) {
    const LlamaConfig c = LlamaConfig::preset(name);
    const nlohmann::json j = c.to_json();
    EXPECT_EQ(j["family"], "llama");
    EXPECT_EQ(LlamaConfig::from_json(j), c) << name;
    nlohmann::json bare = j;
    bare.erase("family");
    EXPECT_EQ(LlamaConfig::from_json(bare), c) << name << " without \"family\"";
  }
  nlohmann::json j = LlamaConfig::preset("tiny").to_json();
  j["n_embd"] = 48;
  expect_error([&] { LlamaConfig::from_json(j); }, {"unknown key 'n_embd'"});
  j = LlamaConfig::preset("tiny").to_json();
  j.erase("rope_theta");
  expect_error([&] { LlamaConfig::from_json(j); }, {"missing key 'rope_theta'"});
  j = LlamaConfig::preset("llama3.2-1b").to_json();
  j["rope_scaling"].erase("factor");
  expect_error([&] { LlamaConfig::from_json(j); }, {"rope_scaling", "missing key 'factor'"});
  j = LlamaConfig::preset("tiny").to_json();
  j["family"] = "gpt2";
  expect_error([&] { LlamaConfig::from_json(j); }, {"family", "llama", "gpt2"});
}

TEST(LlamaConfig, ValidationNamesTheFields) {
  auto with = [](auto edit) {
    LlamaConfig c = LlamaConfig::preset("tiny");
    edit(c);
    return [c] { c.validate(); };
  };
  expect_error(with([](LlamaConfig& c) { c.num_key_value_heads = 4; }),
               {"num_attention_heads 6", "num_key_value_heads 4"});
  expect_error(with([](LlamaConfig& c) { c.num_attention_heads = 5; }), {"hidden_size 48", "num_attention_heads 5"});
  expect_error(with([](LlamaConfig& c) { c.hidden_size = 42; }), {"even", "got 7"});  // 6 heads of 7
  expect_error(with([](LlamaConfig& c) { c.vocab_size = 0; }), {"positive", "vocab_size 0"});
  expect_error(with([](LlamaConfig& c) { c.rms_norm_eps = 0; }), {"rms_norm_eps"});
  expect_error(with([](LlamaConfig& c) { c.rope_scaling = models::LlamaRopeScaling{.high_freq_factor = 1.0}; }),
               {"low_freq_factor", "high_freq_factor"});
}

TEST(LlamaConfig, Llama3ScalingKeepsStretchesAndInterpolates) {
  LlamaConfig c = LlamaConfig::preset("tiny");  // head dim 8
  c.rope_theta = 500.0;
  const std::vector<double> plain = models::llama_rope_inv_freq(c);
  ASSERT_EQ(plain.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(plain[i], std::pow(500.0, -double(2 * i) / 8.0));
  c.rope_scaling = models::LlamaRopeScaling{.factor = 4.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                            .original_max_position_embeddings = 32};
  const std::vector<double> s = models::llama_rope_inv_freq(c);
  EXPECT_DOUBLE_EQ(s[0], plain[0]);  // wavelength 6.3 < 8: kept
  const double wavelen = 2 * M_PI / plain[1], smooth = (32.0 / wavelen - 1.0) / 3.0;  // 30: between 8 and 32
  EXPECT_DOUBLE_EQ(s[1], (1 - smooth) * plain[1] / 4.0 + smooth * plain[1]);
  EXPECT_DOUBLE_EQ(s[2], plain[2] / 4.0);  // > 32: stretched
  EXPECT_DOUBLE_EQ(s[3], plain[3] / 4.0);
  auto [cos, sin] = models::llama_rope_tables(c, 5, DType::f32, kCPU);
  ASSERT_EQ(cos.shape(), Shape({5, 8}));
  EXPECT_FLOAT_EQ(float(to_vector(cos)[3 * 8 + 1]), float(std::cos(3 * s[1])));
  EXPECT_FLOAT_EQ(float(to_vector(sin)[3 * 8 + 5]), float(std::sin(3 * s[1])));  // both halves
}

// --- the model ---

TEST(LlamaModel, RegistryBuildsItDeterministicallyWithHfNames) {
  const nlohmann::json cfg = models::family("llama").preset("tiny");
  auto a = models::build_model(cfg, 42), b = models::build_model(cfg, 42), c = models::build_model(cfg, 43);
  EXPECT_EQ(a->family(), "llama");
  EXPECT_EQ(a->config(), cfg);
  EXPECT_TRUE(same_state(*a, *b)) << "same seed, same weights";
  EXPECT_FALSE(same_state(*a, *c)) << "another seed, other weights";
  auto rebuilt = models::build_model(a->config(), 42);
  EXPECT_TRUE(same_state(*a, *rebuilt)) << "config() round-trips through the registry";

  std::vector<std::string> names;
  for (auto& [name, p] : a->named_parameters()) names.push_back(name);
  const std::vector<std::string> layer0 = {
      "model.layers.0.self_attn.q_proj.weight",  "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight",  "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.mlp.gate_proj.weight",     "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight",     "model.layers.0.input_layernorm.weight",
      "model.layers.0.post_attention_layernorm.weight"};
  ASSERT_EQ(names.size(), 1 + 2 * layer0.size() + 2);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(std::vector<std::string>(names.begin() + 1, names.begin() + 10), layer0);
  EXPECT_EQ(names[names.size() - 2], "model.norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(a->state_dict().size(), names.size()) << "no buffers (the RoPE tables are not state)";

  EXPECT_EQ(models::resolve_model_config("llama:tiny"), cfg);
  expect_error([] { models::resolve_model_config("llama:llama-7b"); }, {"llama-7b", "smollm-135m"});
  {  // An exported folder (and its config.json) as a --model spec.
    TempDir tmp;
    models::export_hf_llama(static_cast<Llama&>(*a), tmp.path + "/m");
    EXPECT_TRUE(models::is_hf_spec(tmp.path + "/m"));
    EXPECT_EQ(models::resolve_model_config(tmp.path + "/m"), cfg);
    EXPECT_EQ(models::resolve_model_config(tmp.path + "/m/config.json"), cfg);
  }

  auto blocks = a->blocks();
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1].name, "model.layers.1");
  EXPECT_EQ(a->find_module(blocks[1].name), blocks[1].module);
  auto* head = dynamic_cast<nn::Linear*>(a->find_module("lm_head"));
  ASSERT_NE(head, nullptr);
  EXPECT_TRUE(a->output_weight().is_same(head->weight));
  EXPECT_FALSE(a->tied_embeddings());
}

TEST(LlamaModel, InitIsNormal002AndNormsOne) {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.tie_word_embeddings = true;
  Llama m(cfg, 7);
  EXPECT_TRUE(m.tied_embeddings());
  EXPECT_TRUE(m.output_weight().is_same(m.token_embedding().weight));
  EXPECT_EQ(m.find_module("lm_head"), nullptr);
  for (auto& [name, p] : m.named_parameters()) {
    const std::vector<double> v = to_vector(p);
    double s = 0, s2 = 0;
    for (double x : v) s += x, s2 += x * x;
    const double mean = s / double(v.size()), std = std::sqrt(s2 / double(v.size()) - mean * mean);
    if (p.dim() == 1) {
      EXPECT_EQ(v, std::vector<double>(v.size(), 1.0)) << name;
    } else {
      EXPECT_NEAR(std, 0.02, 0.004) << name;
      EXPECT_NEAR(mean, 0.0, 0.004) << name;
    }
  }
}

TEST(LlamaModel, FlopsPerTokenCountTheMatmulWeightsAndScores) {
  // tiny: per layer q 48·48, k and v 48·16, o 48·48, MLP 3·48·80, norms 2·48 = 17,760; two layers,
  // the final norm and the head (101·48): 40,416 weights a token multiplies through; the untied
  // embedding table is a lookup, the tied one is the head.
  for (bool tied : {false, true}) {
    LlamaConfig cfg = LlamaConfig::preset("tiny");
    cfg.tie_word_embeddings = tied;
    Llama m(cfg, 1);
    EXPECT_EQ(m.num_parameters(), tied ? 40416 : 45264);
    EXPECT_DOUBLE_EQ(m.flops_per_token(16), 6.0 * 40416 + 12.0 * 2 * 48 * 16) << (tied ? "tied" : "untied");
  }
}

TEST(LlamaModel, CachedForwardAndGenerationMatchTheUncachedArgmax) {
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  cfg.max_position_embeddings = 24;
  cfg.rope_scaling = models::LlamaRopeScaling{.factor = 4.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                              .original_max_position_embeddings = 16};
  Llama m(cfg, 3);
  randomize(m, 4);
  const std::vector<int32_t> prompt = {5, 17, 99, 0, 42};
  Generator gen(1);
  const std::vector<int32_t> got = m.generate(prompt, 12, /*temperature=*/0.0, /*top_k=*/0, gen);

  NoGradGuard ng;
  std::vector<int32_t> seq = prompt;
  for (int step = 0; step < 12; ++step) {
    const int64_t n = int64_t(seq.size());
    Tensor idx = from_vector(std::vector<double>(seq.begin(), seq.end()), {1, n}, DType::i64);
    Tensor last = select(select(m.forward(idx).logits, 0, 0), 0, n - 1);
    seq.push_back(int32_t(to_vector(argmax(last, 0))[0]));
  }
  EXPECT_EQ(got, std::vector<int32_t>(seq.begin() + int64_t(prompt.size()), seq.end()));

  // The cached logits of every position equal the uncached forward's (B = 2).
  Generator g(9);
  Tensor idx = randint(0, cfg.vocab_size, {2, 20}, DType::i64, kCPU, &g);
  Tensor full = m.forward(idx).logits;
  models::KVCache cache;
  std::vector<Tensor> steps = {m.forward_cached(narrow(idx, 1, 0, 8), cache)};
  for (int64_t t = 8; t < 20; ++t) steps.push_back(m.forward_cached(narrow(idx, 1, t, 1), cache));
  EXPECT_EQ(cache.length(), 20);
  ASSERT_EQ(cache.k.size(), 2u);
  EXPECT_EQ(cache.k[0].shape(), Shape({2, 2, 20, 8})) << "the cache holds the key/value heads only";
  // fp32 sums in another order (one-row GEMMs against 20-row ones): the logits reach 7.8 here and
  // differ by up to ~2e-5, a few parts in a million of that scale.
  EXPECT_EQ(compare(cat(steps, 1), full, 5e-5, 1e-4), "");
  expect_error([&] { m.forward_cached(narrow(idx, 1, 0, 2), cache); }, {"one position", "got 2"});
  models::KVCache long_cache;
  m.forward_cached(narrow(idx, 1, 0, 20), long_cache);
  for (int i = 0; i < 4; ++i) m.forward_cached(narrow(idx, 1, 0, 1), long_cache);
  expect_error([&] { m.forward_cached(narrow(idx, 1, 0, 1), long_cache); }, {"positions 24..24",
                                                                              "max_position_embeddings 24"});
}

TEST(LlamaModel, MixedPrecisionForwardStaysNearFp32) {
  Llama m(LlamaConfig::preset("tiny"), 5);
  randomize(m, 6);
  Generator g(2);
  Tensor idx = randint(0, 101, {2, 16}, DType::i64, kCPU, &g), tgt = randint(0, 101, {2, 16}, DType::i64, kCPU, &g);
  const double fp32 = m.forward(idx, tgt).loss.item();
  m.set_compute_dtype(DType::bf16);
  auto out = m.forward(idx, tgt);
  EXPECT_EQ(out.logits.dtype(), DType::bf16);
  EXPECT_NEAR(out.loss.item(), fp32, 0.03 * fp32);
  out.loss.backward();
  for (auto& [name, p] : m.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().dtype(), DType::f32) << name << ": master weights get f32 gradients";
  }
}

// --- Hugging Face config.json ---

nlohmann::json smollm_hf() {  // HuggingFaceTB/SmolLM-135M's config.json
  return nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": true, "vocab_size": 49152})");
}

nlohmann::json llama32_hf() {  // meta-llama/Llama-3.2-1B's config.json
  return nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
    "use_cache": true, "vocab_size": 128256})");
}

TEST(LlamaHfConfig, PublicConfigsGiveThePresets) {
  const auto& from_hf = models::family("llama").from_hf_config;
  EXPECT_EQ(LlamaConfig::from_json(from_hf(smollm_hf(), "smollm/config.json")), LlamaConfig::preset("smollm-135m"));
  EXPECT_EQ(LlamaConfig::from_json(from_hf(llama32_hf(), "llama/config.json")), LlamaConfig::preset("llama3.2-1b"));
  // HF's defaults for what a config leaves out.
  nlohmann::json minimal = {{"hidden_size", 48}, {"intermediate_size", 80}, {"num_hidden_layers", 2},
                            {"num_attention_heads", 6}, {"vocab_size", 101}};
  const LlamaConfig c = LlamaConfig::from_json(from_hf(minimal, "min.json"));
  EXPECT_EQ(c.num_key_value_heads, 6);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.rope_scaling);
  // to_hf and back.
  for (const auto& name : LlamaConfig::preset_names()) {
    const LlamaConfig p = LlamaConfig::preset(name);
    EXPECT_EQ(LlamaConfig::from_json(from_hf(models::llama_config_to_hf(p), "x.json")), p) << name;
  }
}

TEST(LlamaHfConfig, BadConfigsNameFileFieldExpectedAndGot) {
  const auto& from_hf = models::family("llama").from_hf_config;
  auto bad = [&](auto edit, std::initializer_list<std::string> parts) {
    nlohmann::json hf = smollm_hf();
    edit(hf);
    expect_error([&] { from_hf(hf, "/models/smol/config.json"); }, parts);
  };
  const std::string file = "/models/smol/config.json";
  bad([](auto& j) { j["sliding_window"] = 4096; }, {file, "unknown key 'sliding_window'"});
  bad([](auto& j) { j["num_key_value_heads"] = 4; },
      {file, "num_key_value_heads", "expected a positive divisor of num_attention_heads (9)", "got 4"});
  bad([](auto& j) { j["num_attention_heads"] = 7; }, {file, "num_attention_heads", "hidden_size (576)", "got 7"});
  bad([](auto& j) { j["hidden_act"] = "gelu"; }, {file, "hidden_act", "expected \"silu\"", "got \"gelu\""});
  bad([](auto& j) { j["attention_bias"] = true; }, {file, "attention_bias", "expected false", "got true"});
  bad([](auto& j) { j["mlp_bias"] = true; }, {file, "mlp_bias", "expected false", "got true"});
  bad([](auto& j) { j["head_dim"] = 128; }, {file, "head_dim", "expected 64", "got 128"});
  bad([](auto& j) { j["model_type"] = "mistral"; }, {file, "model_type", "expected \"llama\"", "\"mistral\""});
  bad([](auto& j) { j.erase("hidden_size"); }, {file, "hidden_size", "expected an integer", "got nothing"});
  bad([](auto& j) { j["vocab_size"] = "big"; }, {file, "vocab_size", "expected an integer", "got \"big\""});
  bad([](auto& j) { j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}}; },
      {file, "rope_scaling.rope_type", "expected \"llama3\"", "got \"linear\""});
  bad([](auto& j) { j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}}; },
      {file, "rope_scaling.type", "expected \"llama3\"", "got \"dynamic\""});
  bad([](auto& j) { j["attention_dropout"] = 0.1; }, {file, "attention_dropout", "expected 0", "got 0.1"});
  bad([](auto& j) { j["intermediate_size"] = 0; }, {file, "sizes must be positive", "intermediate_size 0"});
  bad([](auto& j) { j["hidden_size"] = 63; j["num_attention_heads"] = 9; }, {file, "even", "got 7"});
}

// --- weights ---

TEST(LlamaHf, ExportThenImportIsBitExact) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (bool tied : {false, true}) {
      for (int64_t shard : {int64_t(0), int64_t(9000)}) {
        SCOPED_TRACE(std::string(tied ? "tied" : "untied") + ", shard bytes " + std::to_string(shard) + ", " +
                     (dtype == DType::f32 ? "f32" : "bf16"));
        LlamaConfig cfg = LlamaConfig::preset("tiny");
        cfg.tie_word_embeddings = tied;
        Llama a(cfg, 1);
        randomize(a, 2);
        a.to(dtype);
        TempDir tmp;
        const std::string dir = tmp.path + "/out";
        models::export_hf_llama(a, dir, {.max_shard_bytes = shard});
        const nlohmann::json hf = read_json(dir + "/config.json");
        EXPECT_EQ(hf["architectures"], nlohmann::json::array({"LlamaForCausalLM"}));
        EXPECT_EQ(hf["model_type"], "llama");
        EXPECT_EQ(hf["torch_dtype"], dtype == DType::f32 ? "float32" : "bfloat16");
        EXPECT_EQ(fs::exists(dir + "/model.safetensors"), shard == 0);
        EXPECT_EQ(fs::exists(dir + "/model.safetensors.index.json"), shard != 0);
        if (shard) {
          const nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
          std::set<std::string> files;
          for (auto& [name, f] : index["weight_map"].items()) files.insert(f.get<std::string>());
          EXPECT_GT(files.size(), 3u);
          EXPECT_EQ(index["weight_map"].size(), a.state_dict().size());
          EXPECT_EQ(index["weight_map"].contains("lm_head.weight"), !tied);
        }
        // Back through the registry, into a model of the same dtype and into an f32 one.
        auto b = models::build_model(models::family("llama").from_hf_config(hf, dir + "/config.json"), 99);
        EXPECT_EQ(b->config(), a.config());
        b->to(dtype);
        models::family("llama").import_hf(*b, dir);
        EXPECT_TRUE(same_state(a, *b));
        if (dtype == DType::bf16) {  // bf16 files into an f32 model: the exact widening
          Llama c(cfg, 98);
          models::import_hf_llama(c, dir);
          const auto want = a.state_dict();
          const auto got = c.state_dict();
          for (size_t i = 0; i < got.size(); ++i)
            EXPECT_TRUE(bitwise_equal(got[i].second, to_dtype(want[i].second, DType::f32))) << got[i].first;
        }
      }
    }
  }
}

TEST(LlamaHf, ExportRefusesANonEmptyFolderUnlessAskedAndReplacesOldShards) {
  Llama a(LlamaConfig::preset("tiny"), 1), b(LlamaConfig::preset("tiny"), 2);
  TempDir tmp;
  models::export_hf_llama(a, tmp.path + "/m", {.max_shard_bytes = 9000});
  std::ofstream(tmp.path + "/m/README.md") << "keep me";
  expect_error([&] { models::export_hf_llama(b, tmp.path + "/m"); }, {tmp.path + "/m", "not empty"});
  Llama check(LlamaConfig::preset("tiny"), 3);
  models::import_hf_llama(check, tmp.path + "/m");
  EXPECT_TRUE(same_state(check, a)) << "the refused export changed nothing";
  models::export_hf_llama(b, tmp.path + "/m", {.overwrite = true});
  for (const auto& e : fs::directory_iterator(tmp.path + "/m")) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "model.safetensors" || name == "config.json" || name == "README.md") << "left behind: " << name;
  }
  models::import_hf_llama(check, tmp.path + "/m");
  EXPECT_TRUE(same_state(check, b));
  // A file where the folder should be.
  std::ofstream(tmp.path + "/file") << "x";
  expect_error([&] { models::export_hf_llama(b, tmp.path + "/file"); }, {"not a folder"});
}

// Writes `tensors` as one safetensors file.
void write_st(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<Tensor> keep;
  SafeTensorsWriter w;
  for (auto& [name, t] : tensors) {
    keep.push_back(contiguous(t));
    w.add(name, t.dtype(), t.shape(), {static_cast<const std::byte*>(keep.back().raw_data()), keep.back().nbytes()});
  }
  w.write(path);
}

TEST(LlamaHf, ImportErrorsNameFileTensorExpectedAndGotAndChangeNothing) {
  TempDir tmp;
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  Llama src(cfg, 1);
  const std::string dir = tmp.path + "/m";
  models::export_hf_llama(src, dir);
  Llama m(cfg, 2);
  Llama before(cfg, 2);
  auto import_error = [&](const std::string& path, std::initializer_list<std::string> parts) {
    expect_error([&] { models::import_hf_llama(m, path); }, parts);
    EXPECT_TRUE(same_state(m, before)) << "a failed import changed the model";
  };

  // config.json says a wider MLP than the weights have: the registry builds that model, and the
  // import names the file, the tensor, expected and got.
  nlohmann::json hf = read_json(dir + "/config.json");
  hf["intermediate_size"] = 96;
  write_json(dir + "/config.json", hf);
  {
    auto wide = models::build_model(models::family("llama").from_hf_config(hf, dir + "/config.json"), 1);
    expect_error([&] { models::family("llama").import_hf(*wide, dir); },
                 {dir + "/model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[80, 48]", "expected [96, 48]",
                  "intermediate_size 96"});
  }

  auto tensors = src.state_dict();
  auto without = [&](const std::string& drop) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (auto& [n, t] : tensors)
      if (n != drop) out.emplace_back(n, t.detach());
    return out;
  };
  write_st(tmp.path + "/missing.safetensors", without("model.norm.weight"));
  import_error(tmp.path + "/missing.safetensors", {"missing.safetensors", "no tensor 'model.norm.weight'", "[48]"});

  auto extra = without("");
  extra.emplace_back("model.layers.0.self_attn.q_proj.bias", zeros({48}));
  write_st(tmp.path + "/extra.safetensors", extra);
  import_error(tmp.path + "/extra.safetensors",
               {"extra.safetensors", "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"});

  auto f64 = without("model.norm.weight");
  f64.emplace_back("model.norm.weight", ones({48}, DType::f64));
  write_st(tmp.path + "/f64.safetensors", f64);
  import_error(tmp.path + "/f64.safetensors", {"f64.safetensors", "model.norm.weight", "F64", "F32, BF16 or F16"});

  // HF checkpoints' rotary buffers are ignored.
  auto inv = without("");
  inv.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", ones({4}));
  write_st(tmp.path + "/inv.safetensors", inv);
  Llama ok(cfg, 5);
  models::import_hf_llama(ok, tmp.path + "/inv.safetensors");
  EXPECT_TRUE(same_state(ok, src));

  // A tied model: lm_head.weight may be there only as the embedding.
  LlamaConfig tied_cfg = cfg;
  tied_cfg.tie_word_embeddings = true;
  Llama tied(tied_cfg, 1), tied_before(tied_cfg, 1);
  auto with_head = without("lm_head.weight");
  with_head.emplace_back("lm_head.weight", tensors[0].second.detach());  // the embedding: fine
  write_st(tmp.path + "/tied_ok.safetensors", with_head);
  models::import_hf_llama(tied, tmp.path + "/tied_ok.safetensors");
  EXPECT_TRUE(bitwise_equal(tied.token_embedding().weight, src.token_embedding().weight));
  with_head.back().second = src.lm_head->weight.detach();
  write_st(tmp.path + "/tied_bad.safetensors", with_head);
  Llama tied2(tied_cfg, 1);
  expect_error([&] { models::import_hf_llama(tied2, tmp.path + "/tied_bad.safetensors"); },
               {"tied_bad.safetensors", "'lm_head.weight' differs from 'model.embed_tokens.weight'"});
  EXPECT_TRUE(same_state(tied2, tied_before));
  // An untied model needs its head.
  write_st(tmp.path + "/nohead.safetensors", without("lm_head.weight"));
  import_error(tmp.path + "/nohead.safetensors", {"nohead.safetensors", "no tensor 'lm_head.weight'", "[101, 48]"});

  import_error(tmp.path + "/nothing", {tmp.path + "/nothing", "no such file or folder"});
  fs::create_directories(tmp.path + "/empty");
  import_error(tmp.path + "/empty", {"model.safetensors.index.json", "found neither"});
}

TEST(LlamaHf, ShardedIndexErrorsNameTheFiles) {
  TempDir tmp;
  LlamaConfig cfg = LlamaConfig::preset("tiny");
  Llama src(cfg, 1);
  const std::string dir = tmp.path + "/m";
  models::export_hf_llama(src, dir, {.max_shard_bytes = 9000});
  const std::string index_path = dir + "/model.safetensors.index.json";
  const nlohmann::json index = read_json(index_path);
  Llama m(cfg, 2), before(cfg, 2);
  auto with_index = [&](const nlohmann::json& j, std::initializer_list<std::string> parts) {
    write_json(index_path, j);
    expect_error([&] { models::import_hf_llama(m, dir); }, parts);
    EXPECT_TRUE(same_state(m, before));
  };
  const std::string first = index["weight_map"]["model.embed_tokens.weight"];
  const std::string other = index["weight_map"]["model.norm.weight"];
  ASSERT_NE(first, other);

  nlohmann::json j = index;
  j["weight_map"]["model.embed_tokens.weight"] = other;  // the tensor is in `first`
  with_index(j, {index_path, "puts 'model.embed_tokens.weight' in " + other, "has no such tensor"});
  j = index;
  j["weight_map"].erase("model.norm.weight");
  with_index(j, {other, "'model.norm.weight' is not in the weight_map", index_path});
  j = index;
  j["weight_map"]["model.extra.weight"] = first;
  with_index(j, {index_path, "'model.extra.weight'", first, "has no such tensor"});
  j = index;
  j["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors";
  with_index(j, {index_path, "model.norm.weight", "../elsewhere.safetensors"});
  j = index;
  j["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors";
  with_index(j, {"model-00099-of-00099.safetensors"});
  with_index(nlohmann::json::object({{"metadata", {}}}), {index_path, "weight_map"});

  // The same tensor in two shards.
  write_json(index_path, index);
  const std::string norm_file = dir + "/" + other;
  SafeTensorsFile f = SafeTensorsFile::open(dir + "/" + first);
  std::vector<std::pair<std::string, Tensor>> twice;
  for (const TensorEntry& e : f.entries()) {
    Tensor t = empty(e.shape, e.dtype);
    std::memcpy(t.raw_data(), f.bytes(e).data(), e.nbytes());
    twice.emplace_back(e.name, t);
  }
  twice.emplace_back("model.norm.weight", ones({48}));
  write_st(dir + "/" + first, twice);
  expect_error([&] { models::import_hf_llama(m, dir); },
               {first, "'model.norm.weight' is also here", "maps it to " + other});
  EXPECT_TRUE(same_state(m, before));
}

}  // namespace
}  // namespace blu::test
