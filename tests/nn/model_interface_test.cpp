// The causal-LM interface and the model registry, on GPT-2: specs resolve to configs (presets,
// FAMILY:PRESET, Hugging Face folders), configs rebuild the same model, blocks and the tied head
// are reported, submodules are found and replaced by dotted path (type-checked), and bad specs or
// configs are refused with errors that name the spec, the file or the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/gpt2/hf.h"
#include "blu/models/registry.h"
#include "common/tiny_gpt.h"
#include "data/data_test_util.h"

namespace blu::models {
namespace {

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(ModelRegistry, SpecsResolve) {
  EXPECT_EQ(resolve_model_config("d12"), GPTConfig::preset("d12").to_json());
  EXPECT_EQ(resolve_model_config("gpt2:d12"), resolve_model_config("d12"));
  EXPECT_EQ(resolve_model_config("gpt2:tiny")["n_embd"], 64);
  EXPECT_EQ(family_of(resolve_model_config("gpt2:demo")), "gpt2");
  expect_error([] { resolve_model_config("d13"); }, {"--model 'd13'", "gpt2:d12"});
  expect_error([] { resolve_model_config("gpt2:d13"); }, {"unknown gpt2 preset 'd13'", "d12"});
  expect_error([] { resolve_model_config("nosuch:x"); }, {"unknown model family 'nosuch'", "gpt2"});
  expect_error([] { resolve_model_config(""); }, {"--model"});
}

TEST(ModelRegistry, ConfigRebuildsTheSameModel) {
  const nlohmann::json cfg = test::tiny_gpt().to_json();
  auto a = build_model(cfg, 11), b = build_model(a->config(), 11);
  EXPECT_EQ(a->family(), "gpt2");
  EXPECT_EQ(a->config(), b->config());
  const auto sa = a->state_dict(), sb = b->state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(to_vector(sa[i].second), to_vector(sb[i].second)) << sa[i].first;
  // A config written before families existed (no "family" key) is GPT-2's.
  nlohmann::json old = cfg;
  old.erase("family");
  EXPECT_EQ(build_model(old, 11)->config(), a->config());
  nlohmann::json bad = cfg;
  bad["family"] = "gpt3";
  expect_error([&] { build_model(bad); }, {"unknown model family 'gpt3'"});
}

TEST(CausalLM, GptReportsBlocksHeadAndFlops) {
  auto m = build_model(test::tiny_gpt().to_json());
  const auto blocks = m->blocks();
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1].name, "h.1");
  EXPECT_EQ(m->find_module("h.1"), blocks[1].module);
  EXPECT_TRUE(m->tied_embeddings());
  EXPECT_EQ(m->vocab_size(), 101);
  EXPECT_EQ(m->max_seq_len(), 16);
  // 6 per parameter but the position table, plus 12·L·C·T.
  const double n = double(m->num_parameters() - 16 * 48);
  EXPECT_DOUBLE_EQ(m->flops_per_token(16), 6 * n + 12.0 * 2 * 48 * 16);
}

// forward is embed → block 0 … n-1 → head and nothing else, for both families, and the block
// hooks see every block call (training forward and cached forward) in order, can replace a block's
// input or output, and stop when removed.
TEST(CausalLM, ForwardIsEmbedBlocksHead) {
  for (const std::string spec : {"gpt2:tiny", "llama:tiny"}) {
    auto m = build_model(resolve_model_config(spec), 3);
    m->eval();  // GPT-2's dropout draws from the model's generator: keep both passes alike
    Generator gen(5);
    const int64_t V = m->vocab_size();
    const Tensor idx = randint(0, V, {2, 7}, DType::i64, kCPU, &gen);
    const Tensor tgt = randint(0, V, {2, 7}, DType::i64, kCPU, &gen);
    const LMOutput whole = m->forward(idx, tgt);
    Tensor x = m->embed(idx);
    EXPECT_EQ(x.shape(), Shape({2, 7, m->config().contains("n_embd") ? m->config()["n_embd"].get<int64_t>()
                                                                    : m->config()["hidden_size"].get<int64_t>()}));
    ASSERT_EQ(m->num_blocks(), m->blocks().size());
    for (size_t i = 0; i < m->num_blocks(); ++i) x = m->block(i, x);
    const LMOutput parts = m->head(x, tgt);
    EXPECT_EQ(to_vector(parts.logits), to_vector(whole.logits)) << spec;
    EXPECT_EQ(parts.loss.item(), whole.loss.item()) << spec;

    std::vector<std::string> calls;
    const int h = m->add_block_hooks(
        [&](size_t i, const Tensor& in) { calls.push_back("before " + std::to_string(i)); return in; },
        [&](size_t i, const Tensor& out) { calls.push_back("after " + std::to_string(i)); return out; });
    EXPECT_EQ(m->forward(idx, tgt).loss.item(), whole.loss.item()) << spec;
    const std::vector<std::string> want = {"before 0", "after 0", "before 1", "after 1"};
    EXPECT_EQ(calls, want) << spec;
    calls.clear();
    KVCache cache;
    m->forward_cached(narrow(idx, 1, 0, 3), cache);
    EXPECT_EQ(calls, want) << spec << ": the cached forward runs the hooks too";
    m->remove_block_hooks(h);
    calls.clear();
    m->forward(idx);
    EXPECT_TRUE(calls.empty()) << spec;
    expect_error([&] { m->remove_block_hooks(h); }, {"no block hooks with handle"});

    // A hook's replacement is what the next part sees: doubling block 0's output.
    const int d = m->add_block_hooks(nullptr, [](size_t i, const Tensor& out) { return i == 0 ? out * 2.0 : out; });
    Tensor y = m->embed(idx);
    y = m->block(0, y);  // hooked: already doubled
    for (size_t i = 1; i < m->num_blocks(); ++i) y = m->block(i, y);
    const double hooked = m->forward(idx, tgt).loss.item();
    m->remove_block_hooks(d);
    Tensor z = m->embed(idx);
    z = m->block(0, z) * 2.0;
    for (size_t i = 1; i < m->num_blocks(); ++i) z = m->block(i, z);
    EXPECT_EQ(hooked, m->head(z, tgt).loss.item()) << spec;
    EXPECT_NE(hooked, whole.loss.item()) << spec;
    expect_error([&] { m->embed(idx, m->max_seq_len() - 3); }, {"do not fit"});
  }
}

TEST(Module, FindAndReplaceByDottedPath) {
  GPT m(test::tiny_gpt());
  EXPECT_EQ(m.find_module(""), &m);
  EXPECT_EQ(m.find_module("h.0.attn.c_attn"), m.h->operator[](0).attn->c_attn.get());
  EXPECT_EQ(m.find_module("h.0.attn.nothing"), nullptr);
  EXPECT_EQ(m.find_module("h.7"), nullptr);
  const auto names = m.named_modules();
  EXPECT_EQ(names[0].first, "");
  EXPECT_EQ(names[1].first, "wte");
  // A new Linear of the same shape goes into the owner's typed slot and its parameters replace the old.
  auto lin = std::make_shared<nn::Linear>(48, 144, true);
  {
    NoGradGuard no_grad;
    fill_(lin->weight, 0.5);
  }
  m.replace_module("h.1.attn.c_attn", lin);
  EXPECT_EQ(m.h->operator[](1).attn->c_attn, lin);
  EXPECT_EQ(m.find_module("h.1.attn.c_attn"), lin.get());
  bool found = false;
  for (auto& [name, p] : m.named_parameters())
    if (name == "h.1.attn.c_attn.weight") found = p.is_same(lin->weight);
  EXPECT_TRUE(found);
  // A block replaced in the ModuleList.
  auto block = std::make_shared<Block>(test::tiny_gpt(), nullptr);
  m.replace_module("h.0", block);
  EXPECT_EQ(&m.h->operator[](0), block.get());
  EXPECT_EQ(m.blocks()[0].module, block.get());
  // Type and path errors.
  expect_error([&] { m.replace_module("h.0.attn.c_attn", std::make_shared<nn::LayerNorm>(48)); },
               {"'h.0.attn.c_attn'", "another type"});
  expect_error([&] { m.replace_module("h.0.attn.nope", lin); }, {"no module at 'h.0.attn.nope'"});
  expect_error([&] { m.replace_module("x.y", lin); }, {"no module at 'x'"});
}

// A config.json whose model_type is not a string is refused by name, like any other unknown
// architecture (found by fuzz/model_config.cpp: a bare JSON type_error escaped).
TEST(ModelRegistry, NonStringModelTypeIsRefusedByName) {
  test::TempDir dir;
  std::ofstream(dir.path() / "config.json") << R"({"model_type": 2, "n_embd": 32})";
  expect_error([&] { (void)resolve_model_config(dir.path().string()); },
               {"config.json: architectures: expected one of", "got none"});
}

TEST(ModelRegistry, HuggingFaceGpt2Folder) {
  test::TempDir dir;
  GPT m(test::tiny_gpt(), 3);
  export_hf_gpt2_folder(m, dir.path().string());
  const nlohmann::json cfg = resolve_model_config(dir.path().string());
  EXPECT_EQ(cfg["n_embd"], 48);
  EXPECT_EQ(cfg["vocab_size"], 101);
  EXPECT_EQ(cfg["padded_vocab_size"], 128);
  auto back = build_model(cfg, 99);
  family("gpt2").import_hf(*back, dir.path().string());
  const auto sa = m.state_dict(), sb = back->state_dict();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(to_vector(sa[i].second), to_vector(sb[i].second)) << sa[i].first;
  // An unknown key, and an activation BluTrain's GPT does not have, name the file and the key.
  const std::string file = (dir.path() / "config.json").string();
  nlohmann::json hf;
  std::ifstream(file) >> hf;
  hf["rotary_dim"] = 64;
  std::ofstream(file) << hf.dump();
  expect_error([&] { resolve_model_config(dir.path().string()); }, {file, "unknown key 'rotary_dim'"});
  hf.erase("rotary_dim");
  hf["activation_function"] = "relu";
  std::ofstream(file) << hf.dump();
  expect_error([&] { resolve_model_config(file); }, {file, "activation_function", "relu"});
  // Values of the wrong type (the model_config fuzzer's find: a number here ended the process with
  // nlohmann's type_error, naming neither file nor key).
  hf["activation_function"] = 0.02;
  std::ofstream(file) << hf.dump();
  expect_error([&] { resolve_model_config(file); }, {file, "activation_function", "0.02"});
  hf["activation_function"] = "gelu_new";
  hf["layer_norm_epsilon"] = "1e-05";
  std::ofstream(file) << hf.dump();
  expect_error([&] { resolve_model_config(file); }, {file, "layer_norm_epsilon", "\"1e-05\""});
  hf["layer_norm_epsilon"] = 1e-5;
  hf["architectures"] = {"BertModel"};
  std::ofstream(file) << hf.dump();
  expect_error([&] { resolve_model_config(file); }, {file, "architectures", "GPT2LMHeadModel", "BertModel"});
}

}  // namespace
}  // namespace blu::models
