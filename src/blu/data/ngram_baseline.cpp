#include "blu/data/ngram_baseline.h"

#include <algorithm>
#include <cmath>

#include "blu/core/error.h"
#include "blu/data/shard.h"

namespace blu {

namespace {
constexpr int32_t kDenseVocab = 1024;  // an 8 MiB table
}

NgramCounts::NgramCounts(const std::vector<std::filesystem::path>& shards, int32_t vocab, int64_t max_tokens)
    : vocab_(vocab) {
  BLU_CHECK(vocab >= 1 && vocab <= 65536, "n-gram baseline: expected a vocabulary of 1..65536 ids, got ", vocab);
  const size_t V = static_cast<size_t>(vocab);
  unigram_.assign(V, 0);
  context_.assign(V, 0);
  const bool dense = vocab <= kDenseVocab;
  if (dense) dense_.assign(V * V, 0);
  std::vector<uint64_t> keys;  // sparse: every pair's key, sorted and counted at the end
  int32_t prev = -1;
  for (const auto& path : shards) {
    if (max_tokens > 0 && tokens_ >= max_tokens) break;
    const ShardReader shard(path, vocab);  // checks every id is below vocab
    for (const uint16_t t : shard.tokens()) {
      if (max_tokens > 0 && tokens_ >= max_tokens) break;
      ++unigram_[t];
      ++tokens_;
      if (prev >= 0) {
        ++context_[static_cast<size_t>(prev)];
        if (dense)
          ++dense_[static_cast<size_t>(prev) * V + t];
        else
          keys.push_back(static_cast<uint64_t>(prev) * V + t);
      }
      prev = t;
    }
  }
  if (!dense) {
    std::sort(keys.begin(), keys.end());
    for (size_t i = 0; i < keys.size();) {
      size_t j = i;
      while (j < keys.size() && keys[j] == keys[i]) ++j;
      pair_keys_.push_back(keys[i]);
      pair_counts_.push_back(static_cast<int64_t>(j - i));
      i = j;
    }
  }
}

int64_t NgramCounts::pair_count(int32_t a, int32_t b) const {
  const uint64_t V = static_cast<uint64_t>(vocab_);
  if (!dense_.empty()) return dense_[static_cast<size_t>(a) * V + static_cast<size_t>(b)];
  const uint64_t key = static_cast<uint64_t>(a) * V + static_cast<uint64_t>(b);
  const auto it = std::lower_bound(pair_keys_.begin(), pair_keys_.end(), key);
  return it != pair_keys_.end() && *it == key ? pair_counts_[static_cast<size_t>(it - pair_keys_.begin())] : 0;
}

double NgramCounts::unigram_nll(int32_t b) const {
  BLU_CHECK(b >= 0 && b < vocab_, "n-gram baseline: token ", b, " is outside the vocabulary [0, ", vocab_, ")");
  return -std::log((double(unigram_[size_t(b)]) + 1.0) / (double(tokens_) + double(vocab_)));
}

double NgramCounts::bigram_nll(int32_t a, int32_t b) const {
  BLU_CHECK(a >= 0 && a < vocab_ && b >= 0 && b < vocab_, "n-gram baseline: pair (", a, ", ", b,
            ") is outside the vocabulary [0, ", vocab_, ")");
  return -std::log((double(pair_count(a, b)) + 1.0) / (double(context_[size_t(a)]) + double(vocab_)));
}

void BaselineScorer::add(std::span<const int32_t> inputs, std::span<const int32_t> targets) {
  BLU_CHECK(inputs.size() == targets.size(), "n-gram baseline: ", inputs.size(), " inputs vs ", targets.size(),
            " targets");
  for (size_t i = 0; i < inputs.size(); ++i) {
    uni_ += counts_.unigram_nll(targets[i]);
    bi_ += counts_.bigram_nll(inputs[i], targets[i]);
  }
  n_ += static_cast<int64_t>(inputs.size());
}

BaselineLoss BaselineScorer::result() const {
  BaselineLoss r;
  r.tokens = n_;
  if (n_ > 0) {
    r.unigram = uni_ / double(n_);
    r.bigram = bi_ / double(n_);
  }
  return r;
}

BaselineLoss baseline_loss(const NgramCounts& counts, DataLoader& loader, int64_t batches) {
  const int64_t n = std::min(batches, loader.batches_per_epoch());
  BaselineScorer scorer(counts);
  loader.reset();
  for (int64_t i = 0; i < n; ++i) {
    const Batch b = loader.next();
    scorer.add(b.inputs, b.targets);
  }
  loader.reset();
  return scorer.result();
}

}  // namespace blu
