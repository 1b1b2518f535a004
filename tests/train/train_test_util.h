// Shared by the trainer tests on the CPU (tests/train) and on the GPU (tests/cuda): a token
// stream a small model can learn, written as shards, the options of a small run over it, and a
// run on the device pool read back (losses, weights, peaks, plan, log).
#pragma once
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "blu/data/shard.h"
#include "blu/memory/device_pool.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/offload/plan.h"
#include "blu/ops/factory.h"
#include "blu/train/trainer.h"
#include "data/data_test_util.h"

namespace blu::train::test_util {

// A noisy counting pattern over `vocab` ids, from a fixed LCG.
inline std::vector<uint16_t> pattern_tokens(size_t n, uint32_t seed, int64_t vocab) {
  std::vector<uint16_t> t(n);
  uint32_t s = seed;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    t[i] = (s >> 24) < 32 ? uint16_t((s >> 8) % uint32_t(vocab)) : uint16_t((i * 7 + i / 13) % size_t(vocab));
  }
  return t;
}

// toy_val_000000.bin and toy_train_000000.bin in `dir`.
inline void write_toy_shards(const std::filesystem::path& dir, int64_t vocab, size_t val_tokens, size_t train_tokens) {
  write_shard(dir / "toy_val_000000.bin", pattern_tokens(val_tokens, 1, vocab));
  write_shard(dir / "toy_train_000000.bin", pattern_tokens(train_tokens, 2, vocab));
}

// A small AdamW run over the toy shards (the caller sets the model, batch and step counts).
inline TrainOptions toy_run(const std::filesystem::path& data, const std::filesystem::path& out, int64_t vocab,
                            const std::string& precision) {
  TrainOptions o;
  o.model = models::GPTConfig().to_json();
  o.precision = precision;
  o.train_pattern = (data / "toy_train_*.bin").string();
  o.val_pattern = (data / "toy_val_*.bin").string();
  o.model["vocab_size"] = vocab;
  o.model["padded_vocab_size"] = vocab;
  o.warmup = 3;
  o.schedule = "cosine";
  o.weight_decay = 0.1;
  o.grad_clip = 1.0;
  o.out = out.string();
  return o;
}

// A two-layer, 32-wide GPT over the toy shards on the device pool cpu:1 (whose peak the tests
// read): 8 steps of two micro-batches of 2 × 16 tokens, lr 1e-2, no validation.
inline TrainOptions pool_run(const std::filesystem::path& data, const std::filesystem::path& out, int64_t vocab,
                             const std::string& precision) {
  TrainOptions o = toy_run(data, out, vocab, precision);
  o.model["n_layer"] = 2;
  o.model["n_head"] = 2;
  o.model["n_embd"] = 32;
  o.model["block_size"] = 32;
  o.batch_size = 2;
  o.seq_len = 16;
  o.grad_accum = 2;
  o.steps = 8;
  o.lr = 1e-2;
  o.min_lr = 1e-3;
  o.seed = 42;
  o.val_every = 0;
  o.device = "cpu:1";
  return o;
}

struct PoolRunResult {
  std::vector<double> losses;
  std::vector<std::vector<double>> weights;  // the model's state_dict, read through its fp32 values
  int64_t step_peak = 0;  // the training steps' peak (TrainSummary::peak_mem_bytes)
  int64_t pool_peak = 0;  // cpu:1's peak over the whole run (after training: evaluation, checkpoint)
  int64_t released = 0;   // parameter elements whose fp32 values lived only on the host
  int64_t split = 0;      // parameter elements held as split masters
  std::optional<offload::MemoryPlan> plan;
  std::string log;
};

// Trains `o`, a pool_run (cpu:1 with no budget of its own: the trainer's plan sets one), and
// reads back what the offload and split-master tests compare. stop_at > 0: stopped after that
// step the way Ctrl-C stops the CLI (the flag, then a checkpoint).
inline PoolRunResult run_on_pool(const TrainOptions& o, int64_t stop_at = 0) {
  PoolRunResult r;
  std::ostringstream log;
  std::atomic<bool> stop{false};
  TrainCallbacks cb;
  cb.log = &log;
  cb.stop = &stop;
  cb.on_step = [&](const StepStats& s) {
    r.losses.push_back(s.loss);
    if (s.step == stop_at) stop = true;
  };
  device_pool(1).set_budget(0);
  device_pool(1).reset_peak();
  {
    Trainer t(o, cb);
    r.step_peak = t.run().peak_mem_bytes;
    r.released = t.strategy().released_elements();
    r.split = t.strategy().split_elements();
    // While `values` lives the parameters hold their fp32 values (masters on the host, split
    // masters joined).
    const auto values = t.strategy().parameter_values();
    for (const auto& [name, w] : t.model().state_dict()) r.weights.push_back(to_vector(w));
    r.pool_peak = device_pool(1).stats().peak_bytes;
    r.plan = t.memory_plan();
  }
  device_pool(1).set_budget(0);
  r.log = log.str();
  return r;
}

// A run resumed after step 4 of 8: its losses are the uninterrupted run's last four and its final
// weights the same, bit for bit.
inline void expect_continues(const PoolRunResult& straight, const PoolRunResult& rest) {
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(std::memcmp(&rest.losses[i], &straight.losses[4 + i], sizeof(double)), 0) << "step " << 5 + i;
  ASSERT_EQ(rest.weights.size(), straight.weights.size());
  for (size_t i = 0; i < rest.weights.size(); ++i)
    EXPECT_EQ(std::memcmp(rest.weights[i].data(), straight.weights[i].data(), rest.weights[i].size() * 8), 0);
}

}  // namespace blu::train::test_util
