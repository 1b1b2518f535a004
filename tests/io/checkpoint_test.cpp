// Tests for io/checkpoint: a bit-exact round trip of model, optimizer and TrainState (and a run
// that continues identically after it), keep-last-N pruning, refusal of another model's config,
// of truncated or corrupt files, and of partial state — each leaving model and optimizer as they
// were — and a failed save that leaves the earlier checkpoints intact.
#include "blu/io/checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "blu/blu.h"
#include "common/checks.h"

namespace fs = std::filesystem;

namespace blu {
namespace {

using test::bitwise_equal;
using test::error_of;

class Block : public nn::Module {
 public:
  explicit Block(Generator& gen) { register_parameter("weight", weight, randn({2, 3}, DType::f32, kCPU, &gen)); }
  Tensor weight;
};

class TinyModel : public nn::Module {
 public:
  explicit TinyModel(uint64_t seed, int64_t width = 4) {
    Generator gen(seed);
    register_parameter("w", w, randn({3, width}, DType::f32, kCPU, &gen));
    register_parameter("b", b, randn({width}, DType::f32, kCPU, &gen));
    register_buffer("scale", scale, full({1}, 0.5));
    sub = std::make_shared<Block>(gen);
    register_module("sub", sub);
  }
  Tensor w, b, scale;
  std::shared_ptr<Block> sub;
};

std::unique_ptr<optim::Optimizer> make_opt(const nn::Module& m) {
  return optim::make_adamw(optim::decay_groups(m.named_parameters(), 0.1), {.lr = 1e-2});
}

void train_steps(nn::Module& m, optim::Optimizer& opt, Generator& gen, int n) {
  for (int i = 0; i < n; ++i) {
    opt.zero_grad();
    for (Tensor p : m.parameters()) p.set_grad(randn(p.shape(), DType::f32, kCPU, &gen));
    opt.step();
  }
}

void expect_same_tensors(const nn::NamedTensors& a, const nn::NamedTensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(bitwise_equal(a[i].second, b[i].second)) << a[i].first;
  }
}

// Deep copies, to compare against later.
nn::NamedTensors snapshot(const nn::NamedTensors& s) {
  nn::NamedTensors out;
  for (auto& [n, t] : s) out.emplace_back(n, clone(t.detach()));
  return out;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/blu_ckpt_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  TrainState state(int64_t step) const {
    TrainState st;
    st.step = step;
    st.rng_seed = 0xfedcba9876543210ull;  // above INT64_MAX: must survive JSON
    st.rng_offset = 12345;
    st.loader = {{"epoch", 1}, {"shard", 2}, {"batch", 7}};
    st.model_config = config;
    st.run = {{"lr", 6e-4}, {"schedule", "cosine"}};
    return st;
  }
  std::string dir_;
  nlohmann::json config = {{"n_layer", 2}, {"n_embd", 4}, {"vocab_size", 50257}};
};

TEST_F(CheckpointTest, RoundTripIsBitExactAndResumesIdentically) {
  TinyModel a(1);
  auto opt_a = make_opt(a);
  Generator grads(9);
  train_steps(a, *opt_a, grads, 3);
  const std::string path = save_checkpoint(dir_, a, opt_a.get(), state(3));
  EXPECT_EQ(fs::path(path).filename(), "ckpt_00000003.safetensors");
  EXPECT_EQ(latest_checkpoint(dir_), path);

  TinyModel b(2);  // other values
  auto opt_b = make_opt(b);
  const TrainState st = load_checkpoint(path, b, opt_b.get(), config);
  EXPECT_EQ(st.step, 3);
  EXPECT_EQ(st.rng_seed, 0xfedcba9876543210ull);
  EXPECT_EQ(st.rng_offset, 12345u);
  EXPECT_EQ(st.loader, state(3).loader);
  EXPECT_EQ(st.model_config, config);
  EXPECT_EQ(st.run, state(3).run);
  expect_same_tensors(a.state_dict(), b.state_dict());
  expect_same_tensors(opt_a->state(), opt_b->state());
  EXPECT_EQ(opt_b->steps(), 3);

  Generator grads_b = grads;
  train_steps(a, *opt_a, grads, 2);
  train_steps(b, *opt_b, grads_b, 2);
  expect_same_tensors(a.state_dict(), b.state_dict());
  expect_same_tensors(opt_a->state(), opt_b->state());
}

TEST_F(CheckpointTest, ModelOnlyAndNullOptimizer) {
  TinyModel a(1);
  save_checkpoint(dir_, a, nullptr, state(0));
  TinyModel b(2);
  load_checkpoint(latest_checkpoint(dir_), b, nullptr);
  expect_same_tensors(a.state_dict(), b.state_dict());
  // A checkpoint without optimizer state cannot feed an optimizer.
  auto opt = make_opt(b);
  EXPECT_NE(error_of([&] { load_checkpoint(latest_checkpoint(dir_), b, opt.get()); }).find("missing 'step'"),
            std::string::npos);
}

TEST_F(CheckpointTest, KeepsTheNewestN) {
  TinyModel a(1);
  for (int64_t step : {10, 20, 30, 40, 50}) save_checkpoint(dir_, a, nullptr, state(step), 3);
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt_00000030.safetensors", "ckpt_00000040.safetensors",
                                             "ckpt_00000050.safetensors"}));
  EXPECT_EQ(fs::path(latest_checkpoint(dir_)).filename(), "ckpt_00000050.safetensors");
  save_checkpoint(dir_, a, nullptr, state(60), 0);  // keep all
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 4);
  EXPECT_EQ(latest_checkpoint(dir_ + "/nowhere"), "");
}

TEST_F(CheckpointTest, RefusesAnotherModelConfigBeforeTouchingAnything) {
  TinyModel a(1);
  auto opt_a = make_opt(a);
  Generator grads(9);
  train_steps(a, *opt_a, grads, 1);
  const std::string path = save_checkpoint(dir_, a, opt_a.get(), state(1));
  TinyModel b(2);
  auto opt_b = make_opt(b);
  const auto before = snapshot(b.state_dict());
  nlohmann::json other = config;
  other["n_layer"] = 3;
  other.erase("vocab_size");
  const std::string err = error_of([&] { load_checkpoint(path, b, opt_b.get(), other); });
  EXPECT_NE(err.find("n_layer: checkpoint 2, expected 3"), std::string::npos) << err;
  EXPECT_NE(err.find("vocab_size: checkpoint 50257, expected (absent)"), std::string::npos) << err;
  expect_same_tensors(b.state_dict(), before);
  EXPECT_EQ(opt_b->steps(), 0);
  EXPECT_EQ(opt_b->state().size(), 1u);
}

TEST_F(CheckpointTest, RefusesTruncatedAndCorruptFiles) {
  TinyModel a(1);
  auto opt_a = make_opt(a);
  Generator grads(9);
  train_steps(a, *opt_a, grads, 1);
  const std::string path = save_checkpoint(dir_, a, opt_a.get(), state(1));
  TinyModel b(2);
  auto opt_b = make_opt(b);
  const auto before = snapshot(b.state_dict());
  const auto size = fs::file_size(path);

  const std::string truncated = dir_ + "/truncated.safetensors";
  fs::copy_file(path, truncated);
  fs::resize_file(truncated, size - 5);
  std::string err = error_of([&] { load_checkpoint(truncated, b, opt_b.get()); });
  EXPECT_NE(err.find("is not a readable checkpoint"), std::string::npos) << err;

  const std::string corrupt = dir_ + "/corrupt.safetensors";
  fs::copy_file(path, corrupt);
  {
    std::fstream f(corrupt, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(9);  // inside the JSON header
    f.put('\x01');
  }
  err = error_of([&] { load_checkpoint(corrupt, b, opt_b.get()); });
  EXPECT_NE(err.find("is not a readable checkpoint"), std::string::npos) << err;

  const std::string empty_file = dir_ + "/empty.safetensors";
  std::ofstream(empty_file).close();
  err = error_of([&] { load_checkpoint(empty_file, b, opt_b.get()); });
  EXPECT_NE(err.find("is not a readable checkpoint"), std::string::npos) << err;

  expect_same_tensors(b.state_dict(), before);
  EXPECT_EQ(opt_b->steps(), 0);
}

TEST_F(CheckpointTest, RefusesAnotherModelsTensorsAndRestoresTheOptimizer) {
  TinyModel wide(1, 5);  // w is [3, 5]
  auto opt_wide = make_opt(wide);
  Generator grads(9);
  train_steps(wide, *opt_wide, grads, 1);
  const std::string path = save_checkpoint(dir_, wide, opt_wide.get(), state(1));
  TinyModel b(2, 4);
  auto opt_b = make_opt(b);
  train_steps(b, *opt_b, grads, 2);
  const auto model_before = snapshot(b.state_dict());
  const auto optim_before = snapshot(opt_b->state());
  const std::string err = error_of([&] { load_checkpoint(path, b, opt_b.get()); });
  // The optimizer's state is loaded (and refused) first.
  EXPECT_NE(err.find("AdamW state: 'exp_avg.b' has shape [5], but parameter 'b' has shape [4]"), std::string::npos)
      << err;
  expect_same_tensors(b.state_dict(), model_before);
  expect_same_tensors(opt_b->state(), optim_before);
}

TEST_F(CheckpointTest, FailedSaveLeavesEarlierCheckpointsIntact) {
  TinyModel a(1);
  const std::string first = save_checkpoint(dir_, a, nullptr, state(1), 1);
  const auto bytes = fs::file_size(first);
  // Something in the way of the new file (a directory of that name): the rename fails.
  fs::create_directory(dir_ + "/ckpt_00000002.safetensors");
  EXPECT_NE(error_of([&] { save_checkpoint(dir_, a, nullptr, state(2), 1); }), "(no error)");
  EXPECT_TRUE(fs::exists(first));  // keep_last = 1 did not prune after the failure
  EXPECT_EQ(fs::file_size(first), bytes);
  for (auto& e : fs::directory_iterator(dir_))  // and no temp file is left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  TinyModel b(2);
  load_checkpoint(first, b, nullptr);
  expect_same_tensors(a.state_dict(), b.state_dict());
  // A directory that cannot be created (a file is in the way).
  std::ofstream(dir_ + "/plain_file").close();
  EXPECT_NE(error_of([&] { save_checkpoint(dir_ + "/plain_file/sub", a, nullptr, state(3)); })
                .find("cannot create directory"),
            std::string::npos);
}

}  // namespace
}  // namespace blu
