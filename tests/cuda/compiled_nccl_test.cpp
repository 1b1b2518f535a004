// The compiled step over NCCL on one GPU: a one-rank NCCL group wrapped by compiler::capturable, so
// DDP's (and ZeRO-1/2's) collectives are recorded into the step and replayed between its CUDA
// graphs, issued where eager issued them and waited for where eager waited (Note [Deferred
// collective waits], compiler/capture.cpp), while the group's watchdog tracks them as it tracks
// eager ones (the graphs are recorded in thread-local capture mode, so its event queries go on).
// Six AdamW steps of the tiny GPT-2, compiled, against the same strategy run eagerly on the same
// group: losses within 1e-5 relative, weights within 2e-5 (bitwise is not asked of the GPU: the
// flash-attention backward sums with atomics), every step after the warm-up compiled, none falling
// back; no collective is left `captured` in the flight recorder. The parent test re-runs this
// binary as one rank under dist::launch (BLU_COMPILED_NCCL=1 selects the worker).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/compile.h"
#include "blu/dist/env.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/models/registry.h"
#include "common/tiny_gpt.h"
#include "dist/dist_test_util.h"

namespace blu::dist {
namespace {

using namespace std::chrono_literals;

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
  int64_t compiled = 0, fallback = 0;
};

Run train(const std::shared_ptr<ProcessGroup>& pg, int zero, bool compiled, Device dev) {
  std::unique_ptr<models::CausalLM> model = models::build_model(::blu::test::tiny_gpt().to_json(), 1234);
  model->to(dev);
  StrategyConfig sc;
  sc.zero = zero;
  const std::shared_ptr<ProcessGroup> group = compiled ? compiler::capturable(pg) : pg;
  Strategy s(*model, group, sc, OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95});
  compiler::CompiledStep cs;
  cs.set_named(compiler::BufferKind::parameter, model->named_parameters());
  const Tensor idx = empty({4, 16}, DType::i32, dev), targets = empty({4, 16}, DType::i32, dev);
  Run run;
  for (int step = 0; step < 6; ++step) {
    std::vector<double> in, tg;
    for (int i = 0; i < 4 * 17; ++i) {
      const double t = double((i * 37 + step * 11) % 101);
      if (i % 17 < 16) in.push_back(t);
      if (i % 17 > 0) tg.push_back(t);
    }
    {
      NoGradGuard ng;
      copy_(idx, to_device(from_vector(in, {4, 16}, DType::i32), dev));
      copy_(targets, to_device(from_vector(tg, {4, 16}, DType::i32), dev));
    }
    StepValues v;
    const double lr = 1e-3 * (1.0 - 0.1 * step);
    auto one = [&] { v = s.step(1, [&](int64_t) { return model->forward(idx, targets).loss; }, lr, 1.0); };
    if (compiled)
      cs.run({idx, targets}, one);
    else
      one();
    run.losses.push_back(s.read(v, false).loss);
  }
  for (const Tensor& p : model->parameters()) run.params.push_back(to_vector(to_device(p.detach(), kCPU)));
  run.compiled = cs.counts().compiled;
  run.fallback = cs.counts().fallback;
  return run;
}

void worker() {
  const DistEnv env = detect_env();
  const Device dev(DeviceType::cuda, env.local_rank);
  cuda::set_device(dev.index);
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 20000ms);
  auto pg = make_nccl_group(store, env.rank, env.world_size, NcclOptions{.timeout = 60000ms, .device = dev.index});
  for (const int zero : {0, 1, 2}) {
    const Run eager = train(pg, zero, false, dev);
    const Run compiled = train(pg, zero, true, dev);
    EXPECT_EQ(compiled.compiled, 5) << "zero " << zero;  // step 1 is the eager warm-up
    EXPECT_EQ(compiled.fallback, 0) << "zero " << zero;
    ASSERT_EQ(eager.losses.size(), compiled.losses.size());
    for (size_t i = 0; i < eager.losses.size(); ++i)
      EXPECT_NEAR(compiled.losses[i], eager.losses[i], 1e-5 * std::abs(eager.losses[i])) << "zero " << zero << " step " << i;
    double worst = 0;
    for (size_t k = 0; k < eager.params.size(); ++k)
      for (size_t i = 0; i < eager.params[k].size(); ++i)
        worst = std::max(worst, std::abs(eager.params[k][i] - compiled.params[k][i]));
    EXPECT_LE(worst, 2e-5) << "zero " << zero;
    std::printf("zero %d: compiled over NCCL vs eager, max |param diff| %.3g\n", zero, worst);
  }
  // The replayed collectives ran outside the graphs: the watchdog saw them complete.
  int captured = 0, completed = 0;
  for (const FlightEntry& e : FlightRecorder::global().snapshot()) {
    captured += e.state == OpState::captured;
    completed += e.state == OpState::completed;
  }
  EXPECT_EQ(captured, 0);
  EXPECT_GT(completed, 0);
  std::printf("flight recorder: %d completed collectives, %d captured\n", completed, captured);
}

TEST(CompiledNcclWorker, Run) {
  if (!std::getenv("BLU_COMPILED_NCCL")) GTEST_SKIP() << "only runs as the rank of CompiledNccl.OneRankMatchesEager";
  worker();
}

TEST(CompiledNccl, OneRankMatchesEager) {
  if (cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const test::LaunchResult res = test::run_command(
      1, {test::self_exe(), "--gtest_filter=CompiledNcclWorker.Run", "--gtest_brief=1"},
      {{"BLU_COMPILED_NCCL", "1"}, {"OMP_NUM_THREADS", "2"}});
  EXPECT_EQ(res.status, 0) << "stdout:\n" << res.out << "\nstderr:\n" << res.err;
  std::printf("%s", res.out.c_str());
}

}  // namespace
}  // namespace blu::dist
