// data/ngram_baseline: what a model has to beat — the loss of count-based unigram and bigram
// models of the training shards, measured on the tokens a validation pass reads. A run prints
// them beside its validation loss (train/trainer.h), so "val loss 1.9" comes with "bigram 2.5".
//   Counts: the training shards read as one token stream (in file order, at most max_tokens of
//   it), unigram c(b) and bigram c(a, b) over consecutive tokens.
//   Smoothing: add-one (Laplace) over the tokenizer's vocabulary V:
//     P(b)     = (c(b) + 1) / (N + V)              N = tokens counted
//     P(b | a) = (c(a, b) + 1) / (c(a, ·) + V)     c(a, ·) = pairs starting with a
//   Loss: the mean of -ln P(target) (unigram) and -ln P(target | input) (bigram) over the
//   (input, target) pairs of the batches given, in nats per token.
// Depends on data/shard, data/loader. Keep: a pure function of (shards, vocab, max_tokens) and the
// batches; the bigram table is dense for small vocabularies (V <= 1024: bytes) and a sorted
// list of the pairs seen otherwise (GPT-2's 50257), so memory stays at O(min(V², N)).
#pragma once
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "blu/data/loader.h"

namespace blu {

class NgramCounts {
 public:
  // Counts the first `max_tokens` tokens of `shards` (all when max_tokens <= 0). Ids must be
  // below vocab (BLU_CHECK naming the shard).
  NgramCounts(const std::vector<std::filesystem::path>& shards, int32_t vocab, int64_t max_tokens = 0);

  int32_t vocab() const { return vocab_; }
  int64_t tokens() const { return tokens_; }  // N
  double unigram_nll(int32_t b) const;        // -ln P(b)
  double bigram_nll(int32_t a, int32_t b) const;  // -ln P(b | a)

 private:
  int64_t pair_count(int32_t a, int32_t b) const;

  int32_t vocab_ = 0;
  int64_t tokens_ = 0;
  std::vector<int64_t> unigram_, context_;  // c(b), c(a, ·)
  std::vector<int64_t> dense_;              // V*V bigram counts when V is small
  std::vector<uint64_t> pair_keys_;         // otherwise: sorted distinct a*V+b ...
  std::vector<int64_t> pair_counts_;        // ... and their counts
};

struct BaselineLoss {
  double unigram = 0, bigram = 0;  // nats per token
  int64_t tokens = 0;              // (input, target) pairs scored
};

// Scores (inputs[i], targets[i]) pairs; `add` accumulates, `result` averages.
class BaselineScorer {
 public:
  explicit BaselineScorer(const NgramCounts& counts) : counts_(counts) {}
  void add(std::span<const int32_t> inputs, std::span<const int32_t> targets);
  BaselineLoss result() const;

 private:
  const NgramCounts& counts_;
  double uni_ = 0, bi_ = 0;
  int64_t n_ = 0;
};

// The baseline over the first `batches` batches of `loader` (reset to its start before and after:
// the batches evaluate() reads), capped at one epoch.
BaselineLoss baseline_loss(const NgramCounts& counts, DataLoader& loader, int64_t batches);

}  // namespace blu
