// The pipeline's code path on one GPU: a one-rank pipeline of two chunks (interleaved 1F1B, three
// micro-batches; the hand-off between the virtual stages stays on the rank and the device) trains
// as the plain step on the same GPU, for the tied GPT-2 and the untied Llama, in fp32 and bf16.
// Tolerance: the stages run the same kernels on the same shapes, so the untied Llama's losses and
// weights are the same bits; GPT-2's tied weight sums the head's parts of every micro-batch before
// the embedding's, where the plain step adds both per micro-batch — one rounding of the sum (fp32:
// 2e-6 relative on the loss, 1e-5 on a weight; bf16 compute with fp32 masters: 1e-3 and 1e-4).
#include <gtest/gtest.h>

#include <cmath>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/strategy.h"
#include "dist/pipeline_harness.h"

namespace blu::dist {
namespace {

TEST(PipelineCuda, OneRankInterleavedMatchesThePlainStep) {
  if (cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const Device dev(DeviceType::cuda, 0);
  for (const std::string precision : {"fp32", "bf16"})
    for (const std::string family : {"gpt2", "llama"}) {
      const bool tied = family == "gpt2", half = precision == "bf16";
      const double loss_tol = tied ? (half ? 1e-3 : 2e-6) : 0.0, param_tol = tied ? (half ? 1e-4 : 1e-5) : 0.0;
      auto plain = test::tiny_model(family, 4), piped = test::tiny_model(family, 4);
      for (models::CausalLM* m : {plain.get(), piped.get()}) {
        m->to(dev);
        if (half) m->set_compute_dtype(DType::bf16);
      }
      const OptimizerConfig oc{.lr = 1e-3, .weight_decay = 0.1};
      Strategy a(*plain, nullptr, StrategyConfig{}, oc);
      Strategy b(*piped, nullptr, test::one_rank_two_chunks(), StrategyConfig{}, oc);
      ASSERT_EQ(b.name(), "pipeline");
      const std::string what = family + " " + precision;
      for (int64_t step = 0; step < 3; ++step) {
        const auto batch = [&](int64_t m) {
          const auto [x, y] = test::pipe_batch(step, m);
          return std::make_pair(to_device(x, dev), to_device(y, dev));
        };
        const double la = a.read(a.step(3, batch, 1e-3, 1.0), false).loss;
        const double lb = b.read(b.step(3, batch, 1e-3, 1.0), false).loss;
        EXPECT_NEAR(la, lb, loss_tol * std::abs(la)) << what << " step " << step;
      }
      for (const auto& [name, p] : piped->named_parameters()) EXPECT_TRUE(p.device() == dev) << name;
      const double worst = test::max_param_diff(*plain, *piped);
      std::printf("%s, one rank on %s, 2 chunks: max |param diff| %.3g\n", what.c_str(), dev.str().c_str(), worst);
      EXPECT_LE(worst, param_tol) << what;
    }
}

}  // namespace
}  // namespace blu::dist
