// The trainer on the GPU (what the README's first command runs when there is one): a small GPT
// trains on CUDA in fp32 and bf16 from shards on disk — losses fall, evaluation and samples run,
// a run stopped at step 10 resumes from its checkpoint and ends where the straight run ends
// (within rounding: the attention backward adds dQ with atomics on the GPU, so runs are not
// bit-identical there; the CPU's bitwise-resume test is tests/train/resume_test.cpp), and the
// checkpoint loads back onto the GPU for generation.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <sstream>
#include <vector>

#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/train/model_spec.h"
#include "blu/train/trainer.h"
#include "cuda/cuda_test_util.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::train {
namespace {

constexpr int64_t kVocab = 512;

TrainOptions gpu_options(const test::TempDir& data, const std::filesystem::path& out, const std::string& precision) {
  TrainOptions o = test_util::toy_run(data.path(), out, kVocab, precision);
  o.device = "cuda";
  o.model["n_layer"] = 2;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 128;  // head dim 64: the flash-attention kernels
  o.model["block_size"] = 64;
  o.batch_size = 8;
  o.seq_len = 64;
  o.steps = 20;
  o.lr = 3e-3;
  o.min_lr = 3e-4;
  o.seed = 7;
  o.val_every = 10;
  o.val_batches = 2;
  o.sample_every = 10;
  o.sample_tokens = 8;
  return o;
}

void train_resume_and_sample(const std::string& precision) {
  SKIP_WITHOUT_CUDA();
  test::TempDir data, runs;
  test_util::write_toy_shards(data.path(), kVocab, 8192, 65536);

  std::vector<double> straight;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) { straight.push_back(s.loss); };
  Trainer a(gpu_options(data, runs / "a", precision), cb);
  const TrainSummary sa = a.run();
  ASSERT_EQ(straight.size(), 20u);
  EXPECT_EQ(sa.end_step, 20);
  EXPECT_LT(straight.back(), 0.8 * straight.front()) << precision << ": the loss should fall on the GPU";
  for (double l : straight) EXPECT_TRUE(std::isfinite(l));

  std::vector<double> split;
  std::atomic<bool> stop{false};
  TrainCallbacks cb1;
  cb1.stop = &stop;
  cb1.on_step = [&](const StepStats& s) {
    split.push_back(s.loss);
    if (s.step == 10) stop = true;
  };
  {
    Trainer b(gpu_options(data, runs / "b", precision), cb1);
    EXPECT_TRUE(b.run().interrupted);
  }
  TrainOptions resumed = gpu_options(data, runs / "b", precision);
  resumed.resume = true;
  TrainCallbacks cb2;
  cb2.on_step = [&](const StepStats& s) { split.push_back(s.loss); };
  Trainer c(resumed, cb2);
  EXPECT_EQ(c.step(), 10);
  EXPECT_EQ(c.run().end_step, 20);
  ASSERT_EQ(split.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i)
    EXPECT_NEAR(split[i], straight[i], 2e-2 * std::abs(straight[i])) << precision << " step " << i + 1;

  // The checkpoint back on the GPU, generating.
  ASSERT_FALSE(sa.checkpoint.empty());
  const auto model = load_model(sa.checkpoint, Device(DeviceType::cuda, 0));
  Generator gen(3);
  const std::vector<int32_t> out = model->generate({1, 2, 3}, 8, 0.8, 20, gen);  // the new tokens only
  EXPECT_EQ(out.size(), 8u);
  for (int32_t t : out) EXPECT_TRUE(t >= 0 && t < kVocab) << t;
}

// --gemm-tune on (Note [GEMM tuning]): the run's log says what the tuning did.
TEST(TrainerCuda, GemmTuningIsReportedInTheLog) {
  SKIP_WITHOUT_CUDA();
  test::TempDir data, runs;
  test_util::write_toy_shards(data.path(), kVocab, 8192, 65536);
  const cuda::GemmTuning before = cuda::gemm_tuning();
  cuda::set_gemm_tuning({false, ""});  // the table in this process only
  TrainOptions o = gpu_options(data, runs / "tuned", "bf16");
  o.steps = 2;
  o.val_every = o.sample_every = 0;
  o.gemm_tune = "on";
  std::ostringstream log;
  TrainCallbacks cb;
  cb.log = &log;
  Trainer t(o, cb);
  EXPECT_EQ(t.run().end_step, 2);
  cuda::set_gemm_tuning(before);
  EXPECT_NE(log.str().find("gemm tuning: "), std::string::npos) << log.str();
  EXPECT_NE(log.str().find(" plans timed ("), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("taken from this process's choices"), std::string::npos) << log.str();
}

TEST(TrainerCuda, Fp32TrainsResumesAndSamples) { train_resume_and_sample("fp32"); }
TEST(TrainerCuda, Bf16TrainsResumesAndSamples) { train_resume_and_sample("bf16"); }

}  // namespace
}  // namespace blu::train
