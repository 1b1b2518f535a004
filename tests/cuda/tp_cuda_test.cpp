// Tensor and sequence parallelism on GPUs over NCCL: each rank trains a tiny GPT-2 (tied, padded
// vocabulary) and a tiny Llama (GQA, untied head) tensor-parallel for five AdamW steps and, in
// the same process on the same GPU, the plain model on the same batch; losses, gradient norms and
// the final gathered weights must agree. TpNcclOneRank.* runs as a one-rank NCCL group on one GPU
// (the collectives are copies, but every sharded module, the vocabulary-parallel loss, the
// gathers, scatters and the Strategy's partial-gradient reduction run on the device and the
// communication stream); TpNccl.* as two ranks when two GPUs are visible.
// Tolerance: as tests/dist/tp_test.cpp (fp32, sums in another order), with GPU reductions whose
// order also depends on the shapes: losses and norms within 1e-5 relative, weights within 1e-4.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/process_group.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/tensor_parallel.h"
#include "dist/dist_test_util.h"
#include "dist/tp_harness.h"

namespace blu::dist {
namespace {

using namespace std::chrono_literals;

struct Run {
  std::vector<double> losses, norms;
  nn::NamedTensors params;  // full, sorted by name, on the CPU
};

Run train(models::CausalLM& model, std::shared_ptr<ProcessGroup> tp, Device dev) {
  StrategyConfig sc;
  sc.tp = tp;
  Strategy strategy(model, nullptr, sc,
                    OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  const int64_t B = 4, T = 16, V = model.vocab_size();
  Run run;
  for (int64_t step = 0; step < 5; ++step) {
    const auto loss_of = [&](int64_t) {
      std::vector<double> in, tg;
      for (int64_t row = 0; row < B; ++row)
        for (int64_t t = 0; t < T; ++t) {
          in.push_back(test::token(0, 0, row, t) % V);
          tg.push_back(t == 3 && row == 1 ? -1 : test::token(0, 0, row, t + 1) % V);
        }
      return model.forward(to_device(from_vector(in, {B, T}, DType::i32), dev),
                           to_device(from_vector(tg, {B, T}, DType::i32), dev)).loss;
    };
    const StepReadout rd = strategy.read(strategy.step(1, loss_of, 1e-3, 1.0), false);
    run.losses.push_back(rd.loss);
    run.norms.push_back(rd.grad_norm);
  }
  nn::NamedTensors full = tp ? gather_full_state(model, *tp) : model.named_parameters();
  std::sort(full.begin(), full.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [name, p] : full) run.params.emplace_back(name, to_device(p.detach(), kCPU));
  return run;
}

void tp_matches_plain() {
  const DistEnv env = detect_env();
  const Device dev(DeviceType::cuda, env.local_rank);
  cuda::set_device(dev.index);
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 20000ms);
  std::shared_ptr<ProcessGroup> pg =
      make_nccl_group(store, env.rank, env.world_size, NcclOptions{.timeout = 60000ms, .device = dev.index});
  for (const std::string family : {"gpt2", "llama"})
    for (bool sp : {false, true}) {
      const std::string what = family + " TP=" + std::to_string(env.world_size) + (sp ? " + SP" : "");
      std::unique_ptr<models::CausalLM> plain = test::tp_model(family, 1234), sharded = test::tp_model(family, 1234);
      plain->to(dev);
      sharded->to(dev);
      apply_tensor_parallel(*sharded, pg, TPOptions{.sequence_parallel = sp});
      const Run want = train(*plain, nullptr, dev), got = train(*sharded, pg, dev);
      for (size_t i = 0; i < want.losses.size(); ++i) {
        EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::abs(want.losses[i])) << what << " step " << i;
        EXPECT_NEAR(got.norms[i], want.norms[i], 1e-5 * std::abs(want.norms[i])) << what << " step " << i;
      }
      ASSERT_EQ(got.params.size(), want.params.size()) << what;
      double worst = 0;
      for (size_t i = 0; i < want.params.size(); ++i) {
        ASSERT_EQ(got.params[i].first, want.params[i].first) << what;
        const std::vector<double> a = to_vector(want.params[i].second), b = to_vector(got.params[i].second);
        ASSERT_EQ(a.size(), b.size()) << what << " " << want.params[i].first;
        for (size_t j = 0; j < a.size(); ++j) worst = std::max(worst, std::abs(a[j] - b[j]));
      }
      EXPECT_LE(worst, 1e-4) << what;
      if (env.rank == 0) std::printf("%s vs one GPU: max |param diff| %.3g\n", what.c_str(), worst);
    }
  pg->barrier()->wait();
}

TEST(TpNcclWorker, Run) {
  const char* s = std::getenv("BLU_TP_NCCL_SCENARIO");
  if (!s) GTEST_SKIP() << "only runs as a rank of a GPU tensor-parallel test";
  if (std::string(s) == "tp") return tp_matches_plain();
  FAIL() << "unknown scenario " << s;
}

void run_ranks(int n) {
  if (cuda::device_count() < n) GTEST_SKIP() << "needs " << n << " GPUs, " << cuda::device_count() << " visible";
  const test::LaunchResult res =
      test::run_command(n, {test::self_exe(), "--gtest_filter=TpNcclWorker.Run", "--gtest_brief=1"},
                        {{"BLU_TP_NCCL_SCENARIO", "tp"}, {"OMP_NUM_THREADS", "2"}});
  EXPECT_EQ(res.status, 0) << "stdout:\n" << res.out << "\nstderr:\n" << res.err;
  std::printf("%s", res.out.c_str());
}

TEST(TpNcclOneRank, TensorParallelMatchesPlainOnOneGpu) { run_ranks(1); }
TEST(TpNccl, TensorParallelMatchesOneGpu) { run_ranks(2); }

}  // namespace
}  // namespace blu::dist
