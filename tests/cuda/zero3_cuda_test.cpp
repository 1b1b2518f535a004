// ZeRO-3 on one GPU: a one-rank NCCL group, so the code path — units gathered into device storage
// on the communication stream, prefetched, released, gradients reduce-scattered from device
// buffers, AdamW on the device shards — runs on the device (the collectives themselves are copies
// at one rank). Five AdamW steps of the tiny GPT-2 and the tiny Llama on cuda:0 must match the same
// model trained by a single-device Strategy (losses within 1e-5 relative, weights within 2e-5: the
// same kernels, the reduction an exact average over one rank), and between steps no parameter
// holds device bytes. The parent test re-runs this binary as one rank under dist::launch
// (BLU_ZERO3_CUDA=1 selects the worker). ZeRO-1 with its moments offloaded runs on one rank the same
// way (BLU_ZERO_OFFLOAD_CUDA=1): AdamW's parameters and moments bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "common/tiny_gpt.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/zero.h"
#include "blu/models/llama/llama.h"
#include "blu/models/registry.h"
#include "cuda/held_fills.h"
#include "dist/dist_test_util.h"

namespace blu::dist {
namespace {

using namespace std::chrono_literals;

std::vector<double> host(const Tensor& t) { return to_vector(to_device(t, kCPU)); }

// Losses and final weights of `steps` steps on fixed batches of 4 × 16 tokens.
struct Run {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
};

Run train(const nlohmann::json& cfg, const std::shared_ptr<ProcessGroup>& pg, Device dev, int steps) {
  std::unique_ptr<models::CausalLM> model = models::build_model(cfg, 1234);
  model->to(dev);
  StrategyConfig sc;
  sc.zero = pg ? 3 : 0;
  Strategy s(*model, pg, sc, OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  Run run;
  for (int step = 0; step < steps; ++step) {
    std::vector<double> in, tg;
    for (int i = 0; i < 4 * 17; ++i) {
      const double t = double((i * 37 + step * 11) % 101);
      if (i % 17 < 16) in.push_back(t);
      if (i % 17 > 0) tg.push_back(t);
    }
    const Tensor idx = to_device(from_vector(in, {4, 16}, DType::i32), dev);
    const Tensor targets = to_device(from_vector(tg, {4, 16}, DType::i32), dev);
    const StepValues v = s.step(1, [&](int64_t) { return model->forward(idx, targets).loss; }, 1e-3, 1.0);
    run.losses.push_back(s.read(v, false).loss);
    if (pg) {  // between steps the parameters hold no device bytes
      for (const auto& [name, p] : model->named_parameters())
        EXPECT_EQ(p.storage()->nbytes(), 0u) << name << " after step " << step;
    }
  }
  const auto full = s.full_parameters();
  for (const Tensor& p : model->parameters()) run.params.push_back(host(p));
  return run;
}

void worker() {
  const DistEnv env = detect_env();
  const Device dev(DeviceType::cuda, env.local_rank);
  cuda::set_device(dev.index);
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 20000ms);
  auto pg = make_nccl_group(store, env.rank, env.world_size, NcclOptions{.timeout = 60000ms, .device = dev.index});
  for (const nlohmann::json& cfg : {::blu::test::tiny_gpt().to_json(), models::LlamaConfig::preset("tiny").to_json()}) {
    const std::string family = cfg.at("family").get<std::string>();
    const Run ref = train(cfg, nullptr, dev, 5);
    const Run z3 = train(cfg, pg, dev, 5);
    ASSERT_EQ(ref.losses.size(), z3.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i)
      EXPECT_NEAR(z3.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << family << " step " << i;
    ASSERT_EQ(ref.params.size(), z3.params.size());
    double worst = 0;
    for (size_t k = 0; k < ref.params.size(); ++k)
      for (size_t i = 0; i < ref.params[k].size(); ++i) worst = std::max(worst, std::abs(ref.params[k][i] - z3.params[k][i]));
    EXPECT_LE(worst, 2e-5) << family;
    std::printf("%s: ZeRO-3 on one GPU vs single device, max |param diff| %.3g\n", family.c_str(), worst);
  }
}

// ZeRO-1 with its moments offloaded (ZeroOptions::offload_chunk_elements: the shard streams
// through two device staging buffers on the copy engine's side streams) on one GPU rank: the same
// parameters and moments as AdamW, bit for bit. The staging buffers come from the caching
// allocator, which hands a block the current stream freed back at once; the first step's uploads
// must wait for work queued on those blocks. Here fills held on the current stream
// (cuda/held_fills.h), on blocks freed right before the optimizer is made, would land on the
// uploaded moments. A first optimizer warms the pinned cache and the kernels, NCCL's too.
void offload_worker() {
  const DistEnv env = detect_env();
  const Device dev(DeviceType::cuda, env.local_rank);
  cuda::set_device(dev.index);
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 20000ms);
  auto pg = make_nccl_group(store, env.rank, env.world_size, NcclOptions{.timeout = 60000ms, .device = dev.index});
  const int64_t n = int64_t(1) << 22;  // 16 MiB of f32: one chunk
  Generator gen(5);
  Tensor a = randn({n}, DType::f32, dev, &gen);
  const Tensor g = mul(randn({n}, DType::f32, dev, &gen), 0.5);
  Tensor b = clone(a);
  a.set_grad(clone(g));
  b.set_grad(clone(g));
  const optim::AdamWOptions opt{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  const ZeroOptions zo{.offload_chunk_elements = n};
  NoGradGuard no_grad;
  auto plain = optim::make_adamw(optim::decay_groups({{"p", a}}, 0.1), opt);
  plain->step();
  const std::vector<double> want = host(a);
  {  // the host moments' pinned blocks into the pinned cache, the kernels (NCCL's too) loaded
    Tensor w = clone(b);
    w.set_grad(clone(g));
    ZeroAdamW warm(optim::decay_groups({{"w", w}}, 0.1), opt, pg, 1, zo);
    warm.step(NormGate{});
    (void)host(w);
  }
  const auto start = ::blu::test::hold_fills_on_freed_blocks(n, 4, dev);
  ZeroAdamW z(optim::decay_groups({{"p", b}}, 0.1), opt, pg, 1, zo);
  ASSERT_TRUE(z.offloads_state());
  z.step(NormGate{});
  const double queued_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(queued_ms, 300) << "the step waited for the device: this test cannot see the race";
  EXPECT_EQ(host(b), want);
  // AdamW names a moment by its parameter ("exp_avg.p"); ZeroAdamW holds the rank's flat shard
  // ("exp_avg"), here the one parameter whole.
  const nn::NamedTensors sa = plain->state(), sb = z.state();
  int moments = 0;
  for (const auto& [name, t] : sa)
    for (const auto& [name_b, u] : sb)
      if (name == name_b + ".p" && t.numel() > 1) {
        EXPECT_EQ(host(to_dtype(u, DType::f64)), host(to_dtype(t, DType::f64))) << name;
        ++moments;
      }
  EXPECT_EQ(moments, 2) << "exp_avg and exp_avg_sq in both states";
  if (!::testing::Test::HasFailure())
    std::printf("ZeRO-1 with offloaded moments on one GPU: AdamW's parameters and moments bit for bit (%.0f ms queued)\n",
                queued_ms);
}

TEST(Zero3CudaWorker, Offload) {
  if (!std::getenv("BLU_ZERO_OFFLOAD_CUDA")) GTEST_SKIP() << "only runs as the rank of Zero3Cuda.OffloadedMomentsOnOneRank";
  offload_worker();
}

// Re-runs this binary as the one rank of a job (dist::launch), on the worker test `worker` that the
// environment variable `selector` enables.
void run_one_rank(const std::string& worker, const std::string& selector) {
  if (cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const test::LaunchResult res = test::run_command(1, {test::self_exe(), "--gtest_filter=" + worker, "--gtest_brief=1"},
                                                   {{selector, "1"}, {"OMP_NUM_THREADS", "2"}});
  EXPECT_EQ(res.status, 0) << "stdout:\n" << res.out << "\nstderr:\n" << res.err;
  std::printf("%s", res.out.c_str());
}

TEST(Zero3Cuda, OffloadedMomentsOnOneRank) { run_one_rank("Zero3CudaWorker.Offload", "BLU_ZERO_OFFLOAD_CUDA"); }

TEST(Zero3CudaWorker, Run) {
  const char* v = std::getenv("BLU_ZERO3_CUDA");
  if (!v) GTEST_SKIP() << "only runs as the rank of Zero3Cuda.OneRankMatchesSingleDevice";
  worker();
}

TEST(Zero3Cuda, OneRankMatchesSingleDevice) { run_one_rank("Zero3CudaWorker.Run", "BLU_ZERO3_CUDA"); }

}  // namespace
}  // namespace blu::dist
