// The norm gate under ZeRO for the multi-process tests (scenario "zero_gate", stage from
// BLU_DIST_STAGE): every rank trains two copies of the tiny GPT side by side on its own rows —
// one with clip_grad_norm + step() (the step skipped when the norm is not finite, as a trainer
// does), one with norm_gate + step(gate) — and checks after every step that both hold the same
// parameters and moments bit for bit, that both see the same norm, and that the gated path made
// no host read. Clipping is active on steps 0 and 2 (max_norm 0.05), inactive on step 1; on step 3
// rank 1's loss is NaN, so every averaged gradient is, and both leave everything as it was.
// Stage 1 runs under DistributedDataParallel, stage 2 with its own bucketed reduction.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/dist/ddp.h"
#include "blu/dist/env.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/zero.h"
#include "blu/models/gpt2/gpt2.h"

namespace blu::dist::test {

inline void zero_gate_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const char* stage_env = std::getenv("BLU_DIST_STAGE");
  const int stage = stage_env ? std::atoi(stage_env) : 2;
  ASSERT_TRUE(stage == 1 || stage == 2) << stage;
  const int W = env.world_size, r = env.rank;
  TcpStore store(env.master_addr, env.master_port, r == 0, 10000ms);
  std::shared_ptr<ProcessGroup> pg =
      make_gloo_group(store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});

  struct Run {
    std::unique_ptr<models::GPT> model;
    std::unique_ptr<DistributedDataParallel> ddp;
    std::unique_ptr<ZeroAdamW> zero;
  };
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  const optim::AdamWOptions adam{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  auto make = [&] {
    Run run;
    run.model = std::make_unique<models::GPT>(cfg, 1234);  // the same on every rank
    if (stage == 1) run.ddp = std::make_unique<DistributedDataParallel>(*run.model, pg, DDPOptions{.bucket_mib = 0.02});
    run.zero = std::make_unique<ZeroAdamW>(optim::decay_groups(run.model->named_parameters(), 0.1), adam, pg, stage,
                                           stage == 2 ? zero_options_for(*run.model, 0.02, run.model->wte.get())
                                                      : ZeroOptions{});
    return run;
  };
  Run ref = make(), gated = make();

  const int64_t rows = 2;
  for (int step = 0; step < 4; ++step) {
    std::vector<double> in, tg;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t t = 0; t < 16; ++t) {
        in.push_back(double((step * 31 + (r * rows + row) * 7 + t * 13) % 101));
        tg.push_back(double((step * 31 + (r * rows + row) * 7 + (t + 1) * 13) % 101));
      }
    const Tensor idx = from_vector(in, {rows, 16}, DType::i32), targets = from_vector(tg, {rows, 16}, DType::i32);
    const bool poison = step == 3;
    const double max_norm = step == 1 ? 1e3 : 0.05;
    for (Run* run : {&ref, &gated}) {
      run->zero->zero_grad();
      Tensor loss = run->model->forward(idx, targets).loss;
      if (poison && r == 1) loss = mul(loss, NAN);
      loss.backward();
      if (run->ddp) run->ddp->finish();
    }
    const double norm = ref.zero->clip_grad_norm(max_norm);
    if (std::isfinite(norm)) ref.zero->step();
    const uint64_t reads = host_reads();
    const NormGate gate = gated.zero->norm_gate(max_norm);
    gated.zero->step(gate);
    EXPECT_EQ(host_reads() - reads, 0u) << "rank " << r << " step " << step;
    const double gate_norm = optim::gate_norm(gate);
    if (poison) {
      EXPECT_TRUE(std::isnan(norm) && std::isnan(gate_norm)) << norm << " " << gate_norm;
    } else {
      EXPECT_EQ(gate_norm, norm) << "rank " << r << " step " << step;
      EXPECT_EQ(norm > max_norm, step != 1) << norm;  // clipping active where meant
    }
    const nn::NamedTensors pa = ref.model->named_parameters(), pb = gated.model->named_parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_TRUE(::blu::test::bitwise_equal(pa[i].second, pb[i].second))
          << "rank " << r << " step " << step << ": " << pa[i].first;
    const nn::NamedTensors sa = ref.zero->state(), sb = gated.zero->state();
    for (size_t i = 0; i < sa.size(); ++i) {
      if (sa[i].first == "step") continue;  // a skipped gated step still counts (optimizer.h)
      EXPECT_TRUE(::blu::test::bitwise_equal(sa[i].second, sb[i].second))
          << "rank " << r << " step " << step << ": " << sa[i].first;
    }
  }
  pg->barrier()->wait();
}

}  // namespace blu::dist::test
