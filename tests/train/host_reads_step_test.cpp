// A training step makes no host read of a tensor value: the trainer reads a step's loss and
// gradient norm once, on a logged step (Strategy::read), and nowhere else — not after a
// micro-batch's forward, not for clipping, not for the non-finite skip. Counted with
// core/host_reads.h over ten steps of a small GPT with gradient accumulation and clipping: three
// logged steps (the first, every fifth) make three reads. The GPU's version of this test
// (tests/cuda/sync_count_test.cpp) counts device synchronisations and synchronous copies.
#include <gtest/gtest.h>

#include "blu/core/host_reads.h"
#include "blu/train/trainer.h"
#include "data/data_test_util.h"
#include "train/train_test_util.h"

namespace blu::train {
namespace {

using test::TempDir;

TrainOptions options(const TempDir& data, const std::string& precision) {
  TrainOptions o = test_util::toy_run(data.path(), "", 128, precision);
  o.val_pattern = "";
  o.model["n_layer"] = 2;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 32;
  o.model["block_size"] = 16;
  o.batch_size = 2;
  o.seq_len = 16;
  o.grad_accum = 3;
  o.steps = 10;
  o.log_every = 5;
  o.grad_clip = 0.05;  // clipping active every step
  return o;
}

void expect_one_read_per_logged_step(const std::string& precision, const std::string& optimizer) {
  TempDir data;
  test_util::write_toy_shards(data.path(), 128, 512, 4096);
  TrainOptions o = options(data, precision);
  o.optimizer = optimizer;
  std::vector<int64_t> logged;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) { logged.push_back(s.step); };
  Trainer t(o, cb);
  const uint64_t before = host_reads();
  const TrainSummary sum = t.run();
  const uint64_t reads = host_reads() - before;
  EXPECT_EQ(sum.end_step, 10);
  EXPECT_EQ(logged, (std::vector<int64_t>{1, 5, 10}));
  EXPECT_EQ(reads, 3u) << precision << " " << optimizer << ": " << reads << " host reads over 10 steps";
}

TEST(TrainerHostReads, OnePerLoggedStepFp32AdamW) { expect_one_read_per_logged_step("fp32", "adamw"); }
TEST(TrainerHostReads, OnePerLoggedStepBf16AdamW) { expect_one_read_per_logged_step("bf16", "adamw"); }
TEST(TrainerHostReads, OnePerLoggedStepSgd) { expect_one_read_per_logged_step("fp32", "sgd"); }
// fp16: the loss scale and its overflow decision stay on the device too.
TEST(TrainerHostReads, OnePerLoggedStepFp16AdamW) { expect_one_read_per_logged_step("fp16", "adamw"); }

}  // namespace
}  // namespace blu::train
