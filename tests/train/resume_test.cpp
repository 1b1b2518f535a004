// Trainer tests: exact resume (20 steps straight == 10 + checkpoint + resume + 10, bitwise; fp32,
// and bf16 with AdamW writing the compute copies),
// gradient accumulation (B=4 == 2 micro-batches of B=2 on the same tokens), and the run directory
// rules (refused without --overwrite, --overwrite removes only the trainer's own files,
// --auto-resume).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "blu/data/shard.h"
#include "blu/ops/factory.h"
#include "blu/train/trainer.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::train {
namespace {

using test::TempDir;

constexpr int64_t kVocab = 256;

void write_data(const TempDir& dir) { test_util::write_toy_shards(dir.path(), kVocab, 2048, 8192); }

TrainOptions tiny_options(const TempDir& data, const std::filesystem::path& out,
                          const std::string& precision = "fp32") {
  TrainOptions o = test_util::toy_run(data.path(), out, kVocab, precision);
  o.model["n_layer"] = 2;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 32;
  o.model["block_size"] = 32;
  o.batch_size = 2;
  o.seq_len = 16;
  o.grad_accum = 2;
  o.steps = 20;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.seed = 42;
  o.val_every = 5;
  o.val_batches = 2;
  o.sample_every = 7;
  o.sample_tokens = 4;
  return o;
}

// Every weight as its exact float values (double holds a float exactly).
std::vector<std::vector<double>> weights(models::CausalLM& model) {
  std::vector<std::vector<double>> out;
  for (const auto& [name, t] : model.state_dict()) out.push_back(to_vector(t));
  return out;
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

void check_resume_is_bitwise_exact(const std::string& precision) {
  TempDir data, runs;
  write_data(data);

  // 20 steps straight.
  std::vector<double> straight_losses, straight_val;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) { straight_losses.push_back(s.loss); };
  cb.on_eval = [&](int64_t, double v) { straight_val.push_back(v); };
  Trainer a(tiny_options(data, runs / "a", precision), cb);
  const TrainSummary sa = a.run();
  EXPECT_EQ(sa.end_step, 20);
  EXPECT_FALSE(sa.interrupted);
  ASSERT_EQ(straight_losses.size(), 20u);
  const auto wa = weights(a.model());

  // 10 steps, stopped the way Ctrl-C stops the CLI (flag → checkpoint), then resumed for 10.
  std::vector<double> split_losses, split_val;
  std::atomic<bool> stop{false};
  TrainCallbacks cb1;
  cb1.stop = &stop;
  cb1.on_step = [&](const StepStats& s) {
    split_losses.push_back(s.loss);
    if (s.step == 10) stop = true;
  };
  cb1.on_eval = [&](int64_t, double v) { split_val.push_back(v); };
  {
    Trainer b(tiny_options(data, runs / "b", precision), cb1);
    const TrainSummary sb = b.run();
    EXPECT_TRUE(sb.interrupted);
    EXPECT_EQ(sb.end_step, 10);
    EXPECT_NE(sb.checkpoint.find("ckpt_00000010"), std::string::npos) << sb.checkpoint;
  }
  TrainOptions resumed = tiny_options(data, runs / "b", precision);
  resumed.resume = true;
  TrainCallbacks cb2;
  cb2.on_step = [&](const StepStats& s) { split_losses.push_back(s.loss); };
  cb2.on_eval = [&](int64_t, double v) { split_val.push_back(v); };
  Trainer c(resumed, cb2);
  EXPECT_EQ(c.step(), 10);
  const TrainSummary sc = c.run();
  EXPECT_EQ(sc.start_step, 10);
  EXPECT_EQ(sc.end_step, 20);

  ASSERT_EQ(split_losses.size(), straight_losses.size());
  for (size_t i = 0; i < straight_losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&split_losses[i], &straight_losses[i], sizeof(double)), 0)
        << "step " << i + 1 << ": " << split_losses[i] << " vs " << straight_losses[i];
  EXPECT_EQ(split_val, straight_val);
  const auto wc = weights(c.model());
  ASSERT_EQ(wc.size(), wa.size());
  for (size_t i = 0; i < wa.size(); ++i) EXPECT_TRUE(bitwise_equal(wa[i], wc[i])) << "tensor " << i;

  // The loss fell: the run learned something (guards against a trainer that never updates).
  EXPECT_LT(straight_losses.back(), straight_losses.front());
  EXPECT_TRUE(std::filesystem::exists(runs / "b" / "metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(runs / "b" / "run.json"));
}

TEST(Trainer, ResumeIsBitwiseExact) { check_resume_is_bitwise_exact("fp32"); }
// bf16: AdamW writes the compute copies; the resumed run re-casts them from the loaded weights.
TEST(Trainer, ResumeIsBitwiseExactBf16) { check_resume_is_bitwise_exact("bf16"); }

TEST(Trainer, GradAccumMatchesOneBigBatch) {
  // Two micro-batches of B=2 read the same 64 consecutive tokens as one batch of B=4, so one
  // step must give the same loss and (up to float summation order) the same weights.
  TempDir data;
  write_data(data);
  std::vector<double> la, lb;
  TrainOptions big = tiny_options(data, "");
  big.batch_size = 4;
  big.grad_accum = 1;
  big.steps = 1;
  big.val_pattern = "";
  big.sample_every = 0;
  TrainOptions acc = big;
  acc.batch_size = 2;
  acc.grad_accum = 2;
  TrainCallbacks ca, cb;
  ca.on_step = [&](const StepStats& s) { la.push_back(s.loss); };
  cb.on_step = [&](const StepStats& s) { lb.push_back(s.loss); };
  Trainer a(big, ca), b(acc, cb);
  a.run();
  b.run();
  ASSERT_EQ(la.size(), 1u);
  ASSERT_EQ(lb.size(), 1u);
  EXPECT_NEAR(la[0], lb[0], 1e-5);
  const auto wa = weights(a.model()), wb = weights(b.model());
  ASSERT_EQ(wa.size(), wb.size());
  double max_diff = 0;
  for (size_t i = 0; i < wa.size(); ++i)
    for (size_t j = 0; j < wa[i].size(); ++j) max_diff = std::max(max_diff, std::abs(wa[i][j] - wb[i][j]));
  EXPECT_LT(max_diff, 1e-5);
}

TEST(Trainer, RunDirectoryRules) {
  TempDir data, runs;
  write_data(data);
  const auto out = runs / "r";
  std::filesystem::create_directories(out);
  test::write_bytes(out / "metrics.jsonl", "{\"event\":\"step\",\"step\":1}\n");
  test::write_bytes(out / "notes.txt", "mine");
  const auto before = test::list_dir(out);

  TrainOptions o = tiny_options(data, out);
  o.steps = 2;
  o.sample_every = 0;
  test::expect_error([&] { Trainer t(o); }, {"already holds a run", "--overwrite"});
  EXPECT_EQ(test::list_dir(out), before);
  EXPECT_EQ(test::read_bytes(out / "metrics.jsonl"), "{\"event\":\"step\",\"step\":1}\n");

  o.resume = true;  // nothing to resume from: refused, nothing touched
  test::expect_error([&] { Trainer t(o); }, {"--resume", "checkpoint"});
  EXPECT_EQ(test::list_dir(out), before);

  o.resume = false;
  o.overwrite = true;
  Trainer t(o);
  t.run();
  EXPECT_EQ(test::read_bytes(out / "notes.txt"), "mine");  // not the trainer's: kept
  EXPECT_NE(test::read_bytes(out / "metrics.jsonl").find("\"summary\""), std::string::npos);
  EXPECT_EQ(test::read_bytes(out / "metrics.jsonl").find("{\"event\":\"step\",\"step\":1}\n"), std::string::npos);
}

// --auto-resume: starts in an empty directory; over a start that died before its first checkpoint
// (run.json and metrics.jsonl only) starts again from step 0 with those metrics dropped; over a
// checkpoint resumes; over a run of another model without a checkpoint, or a run without run.json,
// refuses and touches nothing.
TEST(Trainer, AutoResume) {
  TempDir data, runs;
  write_data(data);
  TrainOptions o = tiny_options(data, runs / "a");
  o.steps = 2;
  o.val_every = 0;
  o.sample_every = 0;
  { Trainer died(o); }  // wrote run.json and an empty metrics.jsonl, then stopped before step 1
  test::write_bytes(runs / "a" / "metrics.jsonl", "{\"event\":\"step\",\"step\":1,\"loss\":99}\n");
  o.auto_resume = true;
  std::ostringstream log;
  {
    Trainer t(o, {.log = &log});
    EXPECT_EQ(t.step(), 0);
    t.run();
  }
  EXPECT_NE(log.str().find("restarting the run in"), std::string::npos) << log.str();
  const std::string metrics = test::read_bytes(runs / "a" / "metrics.jsonl");
  EXPECT_EQ(metrics.find("\"loss\":99"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\"step\":2"), std::string::npos) << metrics;

  o.steps = 3;  // a checkpoint exists now: resumed
  {
    Trainer t(o);
    EXPECT_EQ(t.step(), 2);
  }

  TrainOptions fresh = o;  // an empty directory: a new run
  fresh.out = (runs / "new").string();
  {
    Trainer t(fresh);
    EXPECT_EQ(t.step(), 0);
  }

  TrainOptions other = tiny_options(data, runs / "b");  // another model's start, no checkpoint
  other.sample_every = 0;
  { Trainer died(other); }
  other.model["n_layer"] = 3;
  other.auto_resume = true;
  const auto before = test::list_dir(runs / "b");
  test::expect_error([&] { Trainer t(other); }, {"--auto-resume", "names another model", "--overwrite"});
  EXPECT_EQ(test::list_dir(runs / "b"), before);
  std::filesystem::remove(runs / "b" / "run.json");
  test::expect_error([&] { Trainer t(other); }, {"is missing or names no model"});

  other.overwrite = true;
  test::expect_error([&] { Trainer t(other); }, {"--auto-resume", "contradicts"});
}

TEST(Trainer, MissingDataIsRefusedClearly) {
  TempDir runs;
  TrainOptions o;
  o.train_pattern = (runs / "nothing_train_*.bin").string();
  o.out = (runs / "r").string();
  test::expect_error([&] { Trainer t(o); }, {"no train shards", "nothing_train_*.bin"});
  EXPECT_FALSE(std::filesystem::exists(runs / "r"));
}

}  // namespace
}  // namespace blu::train
