// DDP's gradients as bucket views, for the multi-process tests: scenario "ddp_grads" runs a rank of
// two steps of three micro-batches (no_sync before the last) of the tiny GPT — no optimizer, so
// the parameters stay rank 0's initial ones — and rank 0 writes every parameter's gradient after
// each finish() to <BLU_DIST_OUT>.grads (f32, parameter order, step after step). With
// BLU_DIST_REPLACE=1 a third of the parameters get a new .grad before backward, a third between
// micro-batches and a third after the synced backward: the averages must come out the same.
// BLU_DIST_ROWS=gather|dense exchanges the tied embedding's rows apart (DDPOptions::exchange_rows),
// gathered or as a dense all-reduce; the no_sync micro-batches then add their rows locally.
// Every rank checks that each gradient aliases a bucket buffer after finish(). reference_grads()
// computes the same gradients in one process on the concatenated batch (24 rows per step).
#pragma once
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "common/tiny_gpt.h"
#include "train_harness.h"

namespace blu::dist::test {

inline constexpr int64_t kGradSteps = 2, kGradMicro = 3;
inline const DDPOptions kGradBuckets{.bucket_mib = 0.02, .first_bucket_mib = 0.001};

// Rows [row0, row0 + rows) of micro-batch `micro` of step `step`: inputs and targets.
inline std::pair<Tensor, Tensor> micro_batch(int64_t step, int64_t micro, int64_t row0, int64_t rows) {
  std::vector<double> in, tg;
  for (int64_t row = row0; row < row0 + rows; ++row)
    for (int64_t t = 0; t < kT; ++t) {
      in.push_back(token(step, micro, row, t));
      tg.push_back(token(step, micro, row, t + 1));
    }
  return {from_vector(in, {rows, kT}, DType::i32), from_vector(tg, {rows, kT}, DType::i32)};
}

inline std::vector<float> flat_grads(const nn::Module& model) {
  std::vector<float> out;
  for (const Tensor& p : model.parameters())
    for (double v : to_vector(p.grad())) out.push_back(float(v));
  return out;
}

// One process, every micro-batch of a step concatenated into one batch: the gradients DDP must
// reproduce (step after step, as the worker writes them).
inline std::vector<float> reference_grads() {
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  models::GPT model(cfg, 1234);
  std::vector<float> all;
  for (int64_t step = 0; step < kGradSteps; ++step) {
    model.zero_grad();
    std::vector<Tensor> ins, tgs;
    for (int64_t m = 0; m < kGradMicro; ++m) {
      auto [in, tg] = micro_batch(step, m, 0, kRows);
      ins.push_back(in);
      tgs.push_back(tg);
    }
    model.forward(cat(ins, 0), cat(tgs, 0)).loss.backward();
    const std::vector<float> g = flat_grads(model);
    all.insert(all.end(), g.begin(), g.end());
  }
  return all;
}

inline void ddp_grads_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const int W = env.world_size, r = env.rank;
  const bool replace = getenv_or("BLU_DIST_REPLACE", "0") == "1";
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  ASSERT_EQ(kRows % W, 0);
  TcpStore store(env.master_addr, env.master_port, r == 0, 10000ms);
  auto pg = make_gloo_group(store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  models::GPT model(::blu::test::tiny_gpt(), 1234 + uint64_t(r));  // DDP broadcasts rank 0's
  const std::string rows_path = getenv_or("BLU_DIST_ROWS", "");
  DDPOptions options = kGradBuckets;
  if (const std::string wire = getenv_or("BLU_DIST_REDUCE_DTYPE", ""); !wire.empty()) options.reduce_dtype = dtype_from_name(wire);
  if (!rows_path.empty()) {
    options.exchange_rows = {model.wte.get()};
    options.rows_gather_limit = rows_path == "gather" ? 1e9 : 0.0;
  }
  DistributedDataParallel ddp(model, pg, options);
  std::set<const Storage*> buckets;
  for (size_t b = 0; b < ddp.bucket_layout().size(); ++b) buckets.insert(ddp.bucket_buffer(b).storage().get());
  const std::vector<Tensor> params = model.parameters();
  // A new tensor with the same values (or zeros). After the last backward (which == 2) the buckets
  // are being all-reduced, so .grad is not read then (that read would race with the reduction):
  // zeros replace it, and finish() must still make .grad the averaged bucket view.
  auto replace_grads = [&](size_t which) {
    for (size_t i = which; i < params.size(); i += 3) {
      Tensor p = params[i];
      const Tensor g = p.grad();
      p.set_grad(g.defined() && which != 2 ? clone(g) : zeros(p.shape()));
    }
  };
  std::ofstream gf;
  if (r == 0) gf.open(out + ".grads", std::ios::binary);
  const int64_t rows = kRows / W;
  for (int64_t step = 0; step < kGradSteps; ++step) {
    model.zero_grad();
    if (replace) replace_grads(0);
    for (int64_t m = 0; m < kGradMicro; ++m) {
      std::unique_ptr<DistributedDataParallel::NoSync> no_sync;
      if (m + 1 < kGradMicro) no_sync = std::make_unique<DistributedDataParallel::NoSync>(ddp);
      auto [in, tg] = micro_batch(step, m, r * rows, rows);
      mul(model.forward(in, tg).loss, 1.0 / double(kGradMicro)).backward();
      if (replace && m == 0) replace_grads(1);
    }
    if (replace) replace_grads(2);
    ddp.finish();
    if (!rows_path.empty()) {
      EXPECT_EQ(ddp.row_exchange_paths(), std::vector<std::string>{rows_path});
    }
    for (size_t i = 0; i < params.size(); ++i)
      ASSERT_TRUE(params[i].grad().defined() && buckets.count(params[i].grad().storage().get()))
          << "step " << step << ": the gradient of parameter " << i << " is not a bucket view after finish()";
    if (r == 0) {
      const std::vector<float> g = flat_grads(model);
      gf.write(reinterpret_cast<const char*>(g.data()), std::streamsize(g.size() * sizeof(float)));
    }
  }
  if (replace) {
    EXPECT_GT(ddp.copied_gradients(), 0);
  } else {
    EXPECT_EQ(ddp.copied_gradients(), 0) << "the fast path copied gradients";
  }
  pg->barrier()->wait();
}

}  // namespace blu::dist::test
