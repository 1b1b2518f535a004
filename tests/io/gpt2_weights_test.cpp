// io/gpt2_weights: export → import round trip (Conv1D transposes, wte padding), the tolerated
// extras of HF files (prefix, mask buffers, tied lm_head), and the strict errors: a missing
// tensor, a wrong shape, an unexpected tensor — each naming the tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/hf.h"
#include "blu/io/safetensors.h"

namespace blu::io {
namespace {

namespace fs = std::filesystem;

struct TmpDir {
  TmpDir() {
    char tmpl[] = "/tmp/blu_gpt2w_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TmpDir() { fs::remove_all(path); }
  std::string path;
};

// Rewrites `src` with tensors renamed/replaced/removed by `edit` (name → new name, "" drops it).
void rewrite(const std::string& src, const std::string& dst,
             const std::function<std::string(const std::string&)>& rename,
             std::vector<std::pair<std::string, Tensor>> extra = {}) {
  SafeTensorsFile f = SafeTensorsFile::open(src);
  std::vector<std::vector<std::byte>> keep;
  SafeTensorsWriter w;
  for (const TensorEntry& e : f.entries()) {
    const std::string n = rename(e.name);
    if (n.empty()) continue;
    auto b = f.bytes(e);
    keep.emplace_back(b.begin(), b.end());
    w.add(n, e.dtype, e.shape, keep.back());
  }
  for (auto& [n, t] : extra) w.add(n, t.dtype(), t.shape(), {static_cast<const std::byte*>(t.raw_data()), t.nbytes()});
  w.write(dst);
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    for (auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(Gpt2Weights, ExportImportRoundTrip) {
  TmpDir d;
  auto cfg = ::blu::test::tiny_gpt();
  models::GPT a(cfg, 1), b(cfg, 2);
  export_hf_gpt2(a, d.path + "/w.safetensors");
  SafeTensorsFile f = SafeTensorsFile::open(d.path + "/w.safetensors");
  EXPECT_EQ(f.at("wte.weight").shape, (std::vector<int64_t>{101, 48})) << "padding dropped";
  EXPECT_EQ(f.at("h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{48, 144})) << "Conv1D layout";
  EXPECT_EQ(f.at("h.1.mlp.c_proj.weight").shape, (std::vector<int64_t>{192, 48}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  // c_attn in the file is the transpose of ours.
  Tensor ours = (*a.h)[0].attn->c_attn->weight;
  float file_01;
  std::memcpy(&file_01, f.bytes(f.at("h.0.attn.c_attn.weight")).data() + sizeof(float), sizeof(float));
  EXPECT_EQ(double(file_01), to_vector(select(select(ours, 0, 1), 0, 0))[0]);

  import_hf_gpt2(d.path + "/w.safetensors", b);
  auto sa = a.state_dict(), sb = b.state_dict();
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(to_vector(sa[i].second), to_vector(sb[i].second)) << sa[i].first;
}

TEST(Gpt2Weights, AcceptsPrefixBuffersAndTiedHead) {
  TmpDir d;
  auto cfg = ::blu::test::tiny_gpt();
  models::GPT a(cfg, 1), b(cfg, 2);
  export_hf_gpt2(a, d.path + "/w.safetensors");
  SafeTensorsFile f = SafeTensorsFile::open(d.path + "/w.safetensors");
  Tensor wte = contiguous(narrow(a.wte->weight.detach(), 0, 0, 101));
  Tensor mask = ones({1, 1, 16, 16});
  rewrite(d.path + "/w.safetensors", d.path + "/hf.safetensors", [](const std::string& n) { return "transformer." + n; },
          {{"lm_head.weight", wte}, {"transformer.h.0.attn.bias", mask}, {"transformer.h.1.attn.masked_bias", mask}});
  import_hf_gpt2(d.path + "/hf.safetensors", b);
  EXPECT_EQ(to_vector(a.wte->weight), to_vector(b.wte->weight));

  Tensor other = add(wte, 1.0);
  rewrite(d.path + "/w.safetensors", d.path + "/untied.safetensors", [](const std::string& n) { return n; },
          {{"lm_head.weight", other}});
  expect_error([&] { import_hf_gpt2(d.path + "/untied.safetensors", b); }, {"lm_head.weight", "differs"});
}

TEST(Gpt2Weights, RefusesMissingWrongShapeAndUnexpected) {
  TmpDir d;
  auto cfg = ::blu::test::tiny_gpt();
  models::GPT a(cfg, 1), b(cfg, 2);
  const auto before = to_vector((*b.h)[0].ln_1->weight);
  const std::string good = d.path + "/w.safetensors";
  export_hf_gpt2(a, good);

  rewrite(good, d.path + "/missing.safetensors",
          [](const std::string& n) { return n == "h.1.mlp.c_fc.bias" ? "" : n; });
  expect_error([&] { import_hf_gpt2(d.path + "/missing.safetensors", b); }, {"no tensor 'h.1.mlp.c_fc.bias'"});

  // A wrong shape: a model with another n_embd reads this file.
  auto wide = cfg;
  wide.n_embd = 60;
  models::GPT c(wide, 3);
  expect_error([&] { import_hf_gpt2(good, c); }, {"'wte.weight' has shape [101, 48], expected [101, 60]"});
  // A c_attn stored in our [out, in] layout instead of Conv1D's [in, out].
  Tensor wrong = zeros({144, 48});
  rewrite(good, d.path + "/shape.safetensors", [](const std::string& n) { return n == "h.0.attn.c_attn.weight" ? "" : n; },
          {{"h.0.attn.c_attn.weight", wrong}});
  expect_error([&] { import_hf_gpt2(d.path + "/shape.safetensors", b); },
               {"'h.0.attn.c_attn.weight' has shape [144, 48], expected [48, 144]"});

  // More layers in the file than in the model.
  Tensor extra = zeros({48});
  rewrite(good, d.path + "/extra.safetensors", [](const std::string& n) { return n; }, {{"h.2.ln_1.weight", extra}});
  expect_error([&] { import_hf_gpt2(d.path + "/extra.safetensors", b); }, {"unexpected tensor 'h.2.ln_1.weight'"});

  EXPECT_EQ(to_vector((*b.h)[0].ln_1->weight), before) << "a failed import changes nothing";
}

}  // namespace
}  // namespace blu::io
