// The n-gram baselines (data/ngram_baseline.h) against a plain-Python computation of the same
// add-one smoothed counts (tests/data/ngram_baseline_reference.py, run by /usr/bin/python3), for
// the dense (bytes) and the sparse (GPT-2-sized) bigram table.
#include "blu/data/ngram_baseline.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "blu/data/shard.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

nlohmann::json python_reference(int32_t vocab, int64_t max_tokens, const fs::path& val,
                                const std::vector<fs::path>& train) {
  std::string cmd = "/usr/bin/python3 '" BLU_TEST_DIR "/data/ngram_baseline_reference.py' " + std::to_string(vocab) +
                    " " + std::to_string(max_tokens) + " '" + val.string() + "'";
  for (const auto& t : train) cmd += " '" + t.string() + "'";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  if (!p) return {};
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  EXPECT_EQ(::pclose(p), 0) << cmd << "\n" << out;
  return nlohmann::json::parse(out);
}

// Text as ids, moved up by `offset`.
std::vector<uint16_t> tokens_of(const std::string& text, uint16_t offset) {
  std::vector<uint16_t> t;
  for (unsigned char c : text) t.push_back(uint16_t(c + offset));
  return t;
}

struct Case {
  int32_t vocab;
  uint16_t offset;  // moves the ids up, into a large vocabulary's range
  int64_t max_tokens;
};

class NgramBaseline : public ::testing::TestWithParam<Case> {};

TEST_P(NgramBaseline, MatchesPython) {
  const Case c = GetParam();
  TempDir dir;
  const std::string train_text =
      "the cat sat on the mat.\nthe dog ate the cat's hat.\n%\nWhat is the matter with the hatter?\n";
  std::string longer;
  for (int i = 0; i < 20; ++i) longer += train_text;
  const std::vector<fs::path> train = {dir / "d_train_000000.bin", dir / "d_train_000001.bin"};
  write_shard(train[0], tokens_of(longer, c.offset));
  write_shard(train[1], tokens_of("a second shard: zebra quiz\n", c.offset));
  const fs::path val = dir / "d_val_000000.bin";
  const std::vector<uint16_t> val_tokens = tokens_of("the hat sat on the cat; a quizzical zebra!\n", c.offset);
  write_shard(val, val_tokens);

  const NgramCounts counts(train, c.vocab, c.max_tokens);
  BaselineScorer scorer(counts);
  std::vector<int32_t> in(val_tokens.begin(), val_tokens.end() - 1), tg(val_tokens.begin() + 1, val_tokens.end());
  scorer.add(in, tg);
  const BaselineLoss ours = scorer.result();
  const nlohmann::json ref = python_reference(c.vocab, c.max_tokens, val, train);
  ASSERT_TRUE(ref.is_object());
  EXPECT_EQ(ours.tokens, ref["pairs"].get<int64_t>());
  EXPECT_NEAR(ours.unigram, ref["unigram"].get<double>(), 1e-9);
  EXPECT_NEAR(ours.bigram, ref["bigram"].get<double>(), 1e-9);
  EXPECT_EQ(counts.tokens(), c.max_tokens > 0 ? c.max_tokens : int64_t(longer.size() + 27));
}

INSTANTIATE_TEST_SUITE_P(Tables, NgramBaseline,
                         ::testing::Values(Case{257, 0, 0},          // bytes: the dense table
                                           Case{257, 0, 500},        // counted from the first 500 tokens
                                           Case{50257, 40000, 0}));  // GPT-2's size: the sparse list

// baseline_loss scores exactly the batches a validation pass reads.
TEST(NgramBaselineLoader, ScoresTheLoadersBatches) {
  TempDir dir;
  std::vector<uint16_t> t;
  for (int i = 0; i < 400; ++i) t.push_back(uint16_t((i * 7 + i / 13) % 50));
  write_shard(dir / "d_train_000000.bin", t);
  write_shard(dir / "d_val_000000.bin", std::vector<uint16_t>(t.begin() + 3, t.begin() + 200));
  const NgramCounts counts({dir / "d_train_000000.bin"}, 257);
  DataLoader loader(std::vector<fs::path>{dir / "d_val_000000.bin"}, 2, 8, 0, 1, LoaderOptions{.prefetch = 0});
  const BaselineLoss got = baseline_loss(counts, loader, 3);
  BaselineScorer by_hand(counts);
  loader.reset();
  for (int i = 0; i < 3; ++i) {
    const Batch b = loader.next();
    by_hand.add(b.inputs, b.targets);
  }
  EXPECT_EQ(got.tokens, 3 * 2 * 8);
  EXPECT_DOUBLE_EQ(got.bigram, by_hand.result().bigram);
  EXPECT_DOUBLE_EQ(got.unigram, by_hand.result().unigram);
  // baseline_loss leaves the loader at its start.
  const NgramCounts again({dir / "d_train_000000.bin"}, 257);
  baseline_loss(again, loader, 2);
  const std::vector<int32_t> first = loader.next().inputs;
  loader.reset();
  EXPECT_EQ(first, loader.next().inputs);
}

TEST(NgramBaselineLoader, IdsOutsideTheVocabularyAreRefused) {
  TempDir dir;
  write_shard(dir / "d_train_000000.bin", std::vector<uint16_t>{1, 2, 300});
  EXPECT_THROW(NgramCounts({dir / "d_train_000000.bin"}, 257), Error);
}

}  // namespace
}  // namespace blu
