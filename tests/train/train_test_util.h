// Shared by the trainer tests on the CPU (tests/train) and on the GPU (tests/cuda): a token
// stream a small model can learn, written as shards, and the options of a small run over it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "blu/data/shard.h"
#include "blu/models/gpt2/gpt2.h"
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

}  // namespace blu::train::test_util
