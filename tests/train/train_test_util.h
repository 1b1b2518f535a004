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

}  // namespace blu::train::test_util
