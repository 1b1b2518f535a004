// Data-parallel training of the tiny GPT for the multi-process tests: one function runs a rank in
// any mode — "single" (plain AdamW, one process), "ddp" (DistributedDataParallel + AdamW),
// "zero1" (DDP + ZeroAdamW stage 1), "zero2" (ZeroAdamW stage 2), "zero2rows" (stage 2 with the
// tied embedding's row exchange; BLU_DIST_ROWS_LIMIT its gather limit) — on a fixed global batch of 8
// rows × 16 tokens per micro-batch, rank r taking rows [r·8/W, (r+1)·8/W). Settings come from the
// environment (BLU_DIST_MODE, _STEPS, _ACCUM, _OUT, _SAVE_DIR, _SAVE_AT, _RESUME_DIR); rank 0
// writes <out>.losses (the global mean loss per step), <out>.params (every parameter, f32) and
// <out>.peak (the CPU allocator's peak tensor bytes over the run).
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/dist/ddp.h"
#include "blu/dist/env.h"
#include "blu/dist/zero.h"
#include "blu/io/checkpoint.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/optim/optimizer.h"

namespace blu::dist::test {

inline constexpr int64_t kRows = 8, kT = 16;

// Token ids of global row `row`, micro-batch `micro` of step `step` (inputs; targets are the next).
inline int32_t token(int64_t step, int64_t micro, int64_t row, int64_t t) {
  uint64_t x = uint64_t(step * 1000003 + micro * 7919 + row * 131 + t) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return int32_t(x % 101);
}

inline std::string getenv_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline void train_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const std::string mode = getenv_or("BLU_DIST_MODE", "single");
  const int64_t steps = std::stoll(getenv_or("BLU_DIST_STEPS", "4"));
  const int64_t accum = std::stoll(getenv_or("BLU_DIST_ACCUM", "1"));
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  const std::string save_dir = getenv_or("BLU_DIST_SAVE_DIR", "");
  const int64_t save_at = std::stoll(getenv_or("BLU_DIST_SAVE_AT", "-1"));
  const std::string resume_dir = getenv_or("BLU_DIST_RESUME_DIR", "");
  const double rows_limit = std::stod(getenv_or("BLU_DIST_ROWS_LIMIT", "1"));
  const bool zero2 = mode == "zero2" || mode == "zero2rows";
  const int W = env.world_size, r = env.rank;
  ASSERT_EQ(kRows % W, 0);
  ASSERT_TRUE(mode == "single" ? W == 1 : true);

  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  if (mode != "single") {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    pg = make_gloo_group(*store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  }
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  models::GPT model(cfg, 1234 + uint64_t(r));  // different per rank on purpose: DDP/ZeRO broadcast rank 0's
  if (mode == "single") model.load_state_dict(models::GPT(cfg, 1234).state_dict());
  std::vector<Tensor> params = model.parameters();
  auto groups = optim::decay_groups(model.named_parameters(), 0.1);
  const optim::AdamWOptions adam{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<optim::Optimizer> opt;
  ZeroAdamW* zero = nullptr;
  if (mode == "ddp" || mode == "zero1") ddp = std::make_unique<DistributedDataParallel>(model, pg, DDPOptions{.bucket_mib = 0.02});
  if (zero2) broadcast_parameters(model, *pg);
  if (mode == "zero1" || zero2) {
    // Stage 2: small buckets (several, a parameter split across ranks' chunks) in the order
    // backward completes the gradients, as the trainer gives it.
    ZeroOptions zo = zero_options_for(model, 0.02, model.wte.get(), mode == "zero2rows");
    zo.rows_gather_limit = rows_limit;
    auto z = std::make_unique<ZeroAdamW>(groups, adam, pg, mode == "zero1" ? 1 : 2, std::move(zo));
    zero = z.get();
    opt = std::move(z);
  } else {
    opt = optim::make_adamw(groups, adam);
  }
  int64_t step = 0;
  if (!resume_dir.empty()) {
    ASSERT_NE(zero, nullptr) << "resume is tested through sharded (ZeRO) checkpoints";
    const std::string ckpt = latest_sharded_checkpoint(resume_dir);
    ASSERT_FALSE(ckpt.empty());
    step = load_sharded_checkpoint(ckpt, model, *zero, cfg.to_json()).step;
  }

  std::vector<double> losses;
  const int64_t rows = kRows / W;
  for (; step < steps; ++step) {
    opt->zero_grad();
    double local = 0;
    for (int64_t m = 0; m < accum; ++m) {
      std::vector<double> in, tg;
      for (int64_t row = r * rows; row < (r + 1) * rows; ++row)
        for (int64_t t = 0; t < kT; ++t) {
          in.push_back(token(step, m, row, t));
          tg.push_back(token(step, m, row, t + 1));
        }
      const Tensor idx = from_vector(in, {rows, kT}, DType::i32), targets = from_vector(tg, {rows, kT}, DType::i32);
      std::unique_ptr<DistributedDataParallel::NoSync> no_sync;
      if (ddp && m + 1 < accum) no_sync = std::make_unique<DistributedDataParallel::NoSync>(*ddp);
      if (zero2) zero->set_sync(m + 1 == accum);  // only the last micro-batch reduces
      const Tensor loss = mul(model.forward(idx, targets).loss, 1.0 / double(accum));
      loss.backward();
      local += loss.item();
    }
    if (ddp) ddp->finish();
    if (zero) {
      zero->clip_grad_norm(1.0);
    } else {
      optim::clip_grad_norm(params, 1.0);
    }
    opt->step();
    if (mode == "zero2rows") {  // the path the limit asks for
      const std::string want = double(W) * double(rows * kT) <= rows_limit * double(cfg.padded_vocab_size) ? "gather" : "dense";
      EXPECT_EQ(zero->row_exchange_paths(), std::vector<std::string>{want});
    }
    double global = local;
    if (pg) {
      Tensor l = full({1}, local, DType::f64);
      pg->all_reduce(l, ReduceOp::avg)->wait();
      global = l.item();
    }
    losses.push_back(global);
    if (step + 1 == save_at) {
      ASSERT_NE(zero, nullptr);
      TrainState st;
      st.step = step + 1;
      st.model_config = cfg.to_json();
      save_sharded_checkpoint(save_dir, model, *zero, st);
    }
  }
  if (r == 0 && !out.empty()) {
    std::ofstream lf(out + ".losses");
    char buf[64];
    for (double l : losses) {
      std::snprintf(buf, sizeof buf, "%.17g\n", l);
      lf << buf;
    }
    std::ofstream pf(out + ".params", std::ios::binary);
    for (const Tensor& p : params) pf.write(static_cast<const char*>(p.raw_data()), std::streamsize(p.nbytes()));
    std::ofstream(out + ".peak") << cpu_allocator().stats().peak_bytes << "\n";  // tensor bytes, this rank
  }
  if (pg) pg->barrier()->wait();
}

}  // namespace blu::dist::test
