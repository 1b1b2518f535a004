#include "blu/data/loader.h"

#include <gtest/gtest.h>

#include <set>

#include "blu/data/shard.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

// Shards whose every token tells where it sits: shard s, position i -> s*10000 + i (all < 65536).
struct Shards {
  TempDir dir;
  std::vector<fs::path> files;
  std::vector<std::vector<uint16_t>> tokens;
  explicit Shards(const std::vector<int64_t>& sizes, const std::string& name = "d_train_") {
    for (size_t s = 0; s < sizes.size(); ++s) {
      std::vector<uint16_t> t(static_cast<size_t>(sizes[s]));
      for (int64_t i = 0; i < sizes[s]; ++i) t[i] = static_cast<uint16_t>(s * 10000 + i);
      char num[32];
      std::snprintf(num, sizeof num, "%06zu", s);
      files.push_back(dir / (name + num + ".bin"));
      write_shard(files.back(), t);
      tokens.push_back(std::move(t));
    }
  }
  Batch window(size_t shard, int64_t start, int64_t bt) const {
    Batch b;
    for (int64_t i = 0; i < bt; ++i) {
      b.inputs.push_back(tokens[shard][start + i]);
      b.targets.push_back(tokens[shard][start + i + 1]);
    }
    return b;
  }
};

bool same(const Batch& a, const Batch& b) { return a.inputs == b.inputs && a.targets == b.targets; }

std::vector<Batch> take(DataLoader& dl, int64_t n) {
  std::vector<Batch> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(dl.next());
  return out;
}

void expect_same(const std::vector<Batch>& a, const std::vector<Batch>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(same(a[i], b[i])) << "batch " << i << " differs: first input " << a[i].inputs[0] << " vs "
                                  << b[i].inputs[0];
  }
}

// Uneven shards: 12, 8 and 6 windows of B*T = 8.
const std::vector<int64_t> kUneven = {100, 70, 50};
// Windows per shard divisible by 4, so 1, 2 and 4 ranks read every window: 8, 16, 12.
const std::vector<int64_t> kEven = {65, 129, 97};

TEST(Loader, SequentialBatchesAreConsecutiveWindows) {
  Shards sh(kUneven);
  for (int prefetch : {0, 2}) {
    DataLoader dl(sh.files, 2, 4, 0, 1, {.prefetch = prefetch});
    ASSERT_EQ(dl.batches_per_epoch(), 12 + 8 + 6);
    std::vector<Batch> expected;
    for (int epoch = 0; epoch < 2; ++epoch)
      for (size_t s = 0; s < 3; ++s)
        for (int64_t k = 0; k < (kUneven[s] - 1) / 8; ++k) expected.push_back(sh.window(s, k * 8, 8));
    expected.push_back(sh.window(0, 0, 8));
    std::vector<Batch> got;
    for (size_t i = 0; i < expected.size(); ++i) {
      if (i == 26) {
        EXPECT_EQ(dl.state().epoch, 1);  // wrapped to the first shard
        EXPECT_EQ(dl.state().shard, 0);
        EXPECT_EQ(dl.state().batch, 0);
      }
      if (i % 2) {
        got.push_back(dl.next());
      } else {  // the span form gives the same
        Batch b{std::vector<int32_t>(8), std::vector<int32_t>(8)};
        dl.next(b.inputs, b.targets);
        got.push_back(b);
      }
    }
    expect_same(got, expected);
    EXPECT_EQ(dl.state().epoch, 2);
  }
}

TEST(Loader, PatternPicksSortedMatches) {
  Shards sh({40, 40, 40});
  write_shard(sh.dir / "d_val_000000.bin", std::vector<uint16_t>(40, 1));
  DataLoader dl((sh.dir / "d_train_*.bin").string(), 1, 8, 0, 1);
  EXPECT_EQ(dl.files(), sh.files);
  expect_error([&] { DataLoader x((sh.dir / "nothing_*.bin").string(), 1, 8, 0, 1); },
               {"no shard files match", "nothing_*.bin"});
}

TEST(Loader, RanksInterleaveTheSingleRankStream) {
  Shards sh(kEven);
  DataLoader single(sh.files, 2, 4, 0, 1);
  const int64_t n = single.batches_per_epoch();
  ASSERT_EQ(n, 36);
  const auto stream = take(single, 2 * n);  // two epochs
  for (int world : {2, 4}) {
    for (int r = 0; r < world; ++r) {
      DataLoader dl(sh.files, 2, 4, r, world, {.prefetch = 3});
      ASSERT_EQ(dl.batches_per_epoch() * world, n);
      const auto mine = take(dl, 2 * n / world);
      for (size_t i = 0; i < mine.size(); ++i)
        EXPECT_TRUE(same(mine[i], stream[i * world + r])) << "world " << world << " rank " << r << " batch " << i;
    }
  }
}

TEST(Loader, RanksAreDisjointWhenShardsDoNotDivide) {
  Shards sh(kUneven);
  for (int world : {2, 4}) {
    std::set<int32_t> seen;
    int64_t per_rank = -1;
    for (int r = 0; r < world; ++r) {
      DataLoader dl(sh.files, 2, 4, r, world);
      if (per_rank < 0) per_rank = dl.batches_per_epoch();
      EXPECT_EQ(dl.batches_per_epoch(), per_rank);  // ranks stay in lockstep
      for (const auto& b : take(dl, per_rank)) EXPECT_TRUE(seen.insert(b.inputs[0]).second) << "window read twice";
    }
  }
}

TEST(Loader, ShuffleIsDeterministicPerSeed) {
  Shards sh(kEven);
  auto run = [&](uint64_t seed, int rank, int world) {
    DataLoader dl(sh.files, 2, 4, rank, world, {.shuffle = true, .seed = seed});
    return take(dl, 2 * dl.batches_per_epoch());
  };
  const auto a = run(7, 0, 1), b = run(7, 0, 1), c = run(8, 0, 1);
  expect_same(a, b);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) differs |= !same(a[i], c[i]);
  EXPECT_TRUE(differs) << "seeds 7 and 8 gave the same order";

  // Each epoch is a permutation of the sequential epoch's windows, and the two epochs differ.
  DataLoader seq(sh.files, 2, 4, 0, 1);
  std::multiset<int32_t> all;
  for (const auto& x : take(seq, 36)) all.insert(x.inputs[0]);
  std::multiset<int32_t> e0, e1;
  bool epochs_differ = false;
  for (size_t i = 0; i < 36; ++i) {
    e0.insert(a[i].inputs[0]);
    e1.insert(a[36 + i].inputs[0]);
    epochs_differ |= !same(a[i], a[36 + i]);
  }
  EXPECT_EQ(e0, all);
  EXPECT_EQ(e1, all);
  EXPECT_TRUE(epochs_differ);
  for (const auto& x : a) EXPECT_TRUE(same(x, sh.window(x.inputs[0] / 10000, x.inputs[0] % 10000, 8)));
  // A shard is read through before the next one starts, in shuffled window order.
  int changes = 0, descents = 0;
  for (size_t i = 1; i < 36; ++i) {
    if (a[i].inputs[0] / 10000 != a[i - 1].inputs[0] / 10000)
      ++changes;
    else
      descents += a[i].inputs[0] < a[i - 1].inputs[0];
  }
  EXPECT_EQ(changes, 2);
  EXPECT_GT(descents, 3) << "windows within a shard look unshuffled";

  // Shuffled ranks: disjoint within an epoch, together every window.
  for (int world : {2, 4}) {
    std::multiset<int32_t> union_;
    for (int r = 0; r < world; ++r) {
      const auto mine = run(7, r, world);
      for (size_t i = 0; i < mine.size() / 2; ++i) union_.insert(mine[i].inputs[0]);
    }
    EXPECT_EQ(union_, all) << "world " << world;
  }
}

TEST(Loader, ResumeGivesTheSameBatches) {
  Shards sh(kUneven);
  struct Config {
    bool shuffle;
    int rank, world;
  };
  for (Config cfg : {Config{false, 0, 1}, Config{true, 0, 1}, Config{false, 1, 2}, Config{true, 3, 4}}) {
    const LoaderOptions opt{.shuffle = cfg.shuffle, .seed = 42, .prefetch = 3};
    DataLoader straight(sh.files, 2, 4, cfg.rank, cfg.world, opt);
    const int64_t per_epoch = straight.batches_per_epoch();
    const auto all = take(straight, 2 * per_epoch + 5);
    // Stop points: at the start, mid first shard, at a shard edge, at the epoch wrap, in epoch 1.
    for (int64_t k : {int64_t{0}, int64_t{3}, (kUneven[0] - 1) / (8 * cfg.world), per_epoch - 1, per_epoch,
                      per_epoch + 2}) {
      DataLoader first(sh.files, 2, 4, cfg.rank, cfg.world, opt);
      const auto head = take(first, k);
      // The prefetch thread is ahead by now; the state must still point at batch k.
      const nlohmann::json saved = first.state();
      DataLoader second(sh.files, 2, 4, cfg.rank, cfg.world, opt);
      take(second, 1);  // some other position, to be overwritten
      second.restore(saved.get<LoaderState>());
      EXPECT_EQ(second.state(), first.state());
      const auto tail = take(second, static_cast<int64_t>(all.size()) - k);
      std::vector<Batch> joined = head;
      joined.insert(joined.end(), tail.begin(), tail.end());
      expect_same(joined, all);
      // The first loader keeps going as if nothing happened.
      EXPECT_TRUE(same(first.next(), all[k]));
    }
  }
}

// Note [Resuming on other ranks]: a state saved by 4 ranks of B=1 restores into 2 ranks of B=2
// and into 1 rank of B=4, and every later round holds the same tokens, split differently.
TEST(Loader, ResumesOnAnotherWorldSizeWithTheSameGlobalBatch) {
  Shards sh(kUneven);
  const int64_t T = 4, rounds = 2 * (6 + 4 + 3) + 3;  // rounds of 16 tokens: 6, 4, 3 a shard; past the wrap
  // n rounds of `world` ranks of B rows (after restoring `from`, if given), each round as the
  // inputs of rank 0, 1, ... then their targets.
  auto read_rounds = [&](int world, int64_t B, const LoaderState* from, int64_t n) {
    std::vector<std::vector<Batch>> per_rank;
    for (int r = 0; r < world; ++r) {
      DataLoader dl(sh.files, B, T, r, world, {.prefetch = 1});
      if (from) dl.restore(*from);
      per_rank.push_back(take(dl, n));
    }
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(n));
    for (size_t k = 0; k < out.size(); ++k) {
      for (const auto& rank : per_rank) out[k].insert(out[k].end(), rank[k].inputs.begin(), rank[k].inputs.end());
      for (const auto& rank : per_rank) out[k].insert(out[k].end(), rank[k].targets.begin(), rank[k].targets.end());
    }
    return out;
  };
  const auto straight = read_rounds(4, 1, nullptr, rounds);
  for (int64_t k : {int64_t{0}, int64_t{3}, int64_t{6}, int64_t{14}}) {  // start, mid shard, shard edge, epoch 1
    DataLoader first(sh.files, 1, T, 0, 4, {.prefetch = 2});
    take(first, k);
    const LoaderState saved = nlohmann::json(first.state()).get<LoaderState>();
    for (auto [world, B] : {std::pair{2, int64_t{2}}, std::pair{1, int64_t{4}}}) {
      SCOPED_TRACE("stopped after " + std::to_string(k) + " rounds, resumed on " + std::to_string(world) + " ranks");
      const auto resumed = read_rounds(world, B, &saved, rounds - k);
      for (int64_t j = 0; j < rounds - k; ++j) ASSERT_EQ(resumed[size_t(j)], straight[size_t(k + j)]) << "round " << k + j;
    }
  }
  // Refused: another global batch, and any change of split in shuffle mode.
  DataLoader four(sh.files, 1, T, 0, 4);
  DataLoader two(sh.files, 1, T, 0, 2);
  expect_error([&] { two.restore(four.state()); },
               {"B=1 on world_size=4 (4 rows a round)", "B=1 on world_size=2 (2 rows)", "keep B x world_size"});
  DataLoader four_shuffled(sh.files, 1, T, 0, 4, {.shuffle = true, .seed = 1});
  DataLoader two_shuffled(sh.files, 2, T, 0, 2, {.shuffle = true, .seed = 1});
  expect_error([&] { two_shuffled.restore(four_shuffled.state()); }, {"B=1", "this loader has B=2"});
}

TEST(Loader, StateJsonRoundTripAndReset) {
  Shards sh(kUneven);
  DataLoader dl(sh.files, 2, 4, 0, 1, {.shuffle = true, .seed = 5});
  const auto first = take(dl, 30);
  const LoaderState s = dl.state();
  EXPECT_EQ(s.epoch, 1);
  const nlohmann::json j = s;
  EXPECT_EQ(j.at("epoch"), 1);
  EXPECT_EQ(j.at("seed"), 5u);
  EXPECT_EQ(j.get<LoaderState>(), s);
  dl.reset();
  EXPECT_EQ(dl.state().epoch, 0);
  expect_same(take(dl, 30), first);
}

TEST(Loader, BadArguments) {
  Shards sh(kUneven);
  expect_error([&] { DataLoader dl(sh.files, 0, 4, 0, 1); }, {"B and T must be positive", "B=0"});
  expect_error([&] { DataLoader dl(sh.files, 2, -1, 0, 1); }, {"B and T must be positive", "T=-1"});
  expect_error([&] { DataLoader dl(sh.files, 2, 4, 2, 2); }, {"rank", "got 2"});
  // 50 tokens hold one 8-token window for 4 ranks (33 tokens) but not for 8 (65).
  expect_error([&] { DataLoader dl(sh.files, 2, 4, 0, 8); },
               {"d_train_000002.bin", "has 50 tokens", "65 are needed"});
  expect_error([&] { DataLoader dl(sh.files, 7, 8, 0, 1); }, {"d_train_000002.bin", "57 are needed"});

  DataLoader dl(sh.files, 2, 4, 0, 1);
  std::vector<int32_t> small(7), ok(8);
  expect_error([&] { dl.next(small, ok); }, {"B*T = 8", "inputs 7"});

  LoaderState s = dl.state();
  s.B = 3;
  expect_error([&] { dl.restore(s); }, {"B=3", "this loader has B=2"});
  s = dl.state();
  s.shard_file = "other.bin";
  expect_error([&] { dl.restore(s); }, {"other.bin", "d_train_000000.bin"});
  s = dl.state();
  s.batch = 12;
  expect_error([&] { dl.restore(s); }, {"batch 12", "12 batches"});
  expect_error([&] { (void)nlohmann::json{{"epoch", 0}}.get<LoaderState>(); }, {"no field 'shard'"});
  expect_error([&] { (void)nlohmann::json::parse(R"({"epoch":"x"})").get<LoaderState>(); }, {"'epoch'", "wrong type"});
  // The loader still works after the refused calls.
  EXPECT_TRUE(same(dl.next(), sh.window(0, 0, 8)));
}

// A saved state comes from a file: numbers out of range are refused, not computed with (found by
// fuzz/loader_state.cpp; both were undefined behaviour).
TEST(Loader, HostileStateNumbersAreRefused) {
  Shards sh(kUneven);
  DataLoader dl(sh.files, 2, 4, 0, 1);
  LoaderState s = dl.state();
  s.B = int64_t(1) << 62;
  s.world_size = 4;  // B x world_size overflows int64
  expect_error([&] { dl.restore(s); }, {"B=4611686018427387904 on world_size=4 (more than int64 holds rows"});
  nlohmann::json j = dl.state();
  j["epoch"] = 1e300;  // a double far outside int64
  expect_error([&] { (void)j.get<LoaderState>(); }, {"field 'epoch' must be an integer, got 1e+300"});
  j["epoch"] = 1.5;
  expect_error([&] { (void)j.get<LoaderState>(); }, {"field 'epoch' must be an integer"});
  EXPECT_TRUE(same(dl.next(), sh.window(0, 0, 8)));
}

TEST(Loader, PrefetchThreadErrorsReachTheCaller) {
  Shards sh({161, 40});  // 20 batches in the first shard; the thread is at most a few ahead
  DataLoader dl(sh.files, 1, 8, 0, 1, {.prefetch = 2});
  const LoaderState start = dl.state();
  test::write_bytes(sh.files[1], test::raw_shard(99, 1, 0, {}));  // corrupt the second shard
  for (int i = 0; i < 20; ++i) dl.next();
  expect_error([&] { dl.next(); }, {"d_train_000001.bin", "expected 20240520", "got 99"});
  expect_error([&] { dl.next(); }, {"got 99"});  // stays failed
  dl.restore(start);  // a fresh thread
  EXPECT_TRUE(same(dl.next(), sh.window(0, 0, 8)));

  // Token ids are checked against the vocabulary when a shard is first mapped.
  Shards big({200});
  DataLoader v(big.files, 1, 8, 0, 1, {.prefetch = 2, .vocab_size = 150});
  expect_error([&] { v.next(); }, {"d_train_000000.bin", "position 150", "vocab_size 150"});
}

TEST(Loader, DestructorStopsAFullQueue) {
  Shards sh(kUneven);
  for (int i = 0; i < 20; ++i) {
    DataLoader dl(sh.files, 2, 4, 0, 1, {.prefetch = 4});
    if (i % 2) dl.next();
  }  // no hang, no crash
}

// Uneven rows per rank (LoaderOptions::rows, replicas of unequal weight): ranks of 3 and 1 rows read
// between them the rows one loader of 4 rows reads, round after round (across a shard change), and
// the state restores into the single loader (the same global batch); shuffle is refused.
TEST(DataLoader, UnevenRowsPerRankReadTheGlobalBatch) {
  const Shards sh({8 * 4 * 3 + 5, 8 * 4 * 2 + 1});
  LoaderOptions o;
  o.rows = {3, 1};
  DataLoader r0(sh.files, 3, 8, 0, 2, o), r1(sh.files, 1, 8, 1, 2, o), one(sh.files, 4, 8, 0, 1);
  for (int k = 0; k < 7; ++k) {
    const Batch a = r0.next(), b = r1.next(), whole = one.next();
    std::vector<int32_t> inputs = a.inputs, targets = a.targets;
    inputs.insert(inputs.end(), b.inputs.begin(), b.inputs.end());
    targets.insert(targets.end(), b.targets.begin(), b.targets.end());
    EXPECT_EQ(inputs, whole.inputs) << "round " << k;
    EXPECT_EQ(targets, whole.targets) << "round " << k;
  }
  DataLoader again(sh.files, 4, 8, 0, 1);
  again.restore(r1.state());
  EXPECT_EQ(again.next().inputs, one.next().inputs);
  LoaderOptions shuffled = o;
  shuffled.shuffle = true;
  expect_error([&] { DataLoader x(sh.files, 3, 8, 0, 2, shuffled); }, {"shuffle is not supported with them"});
  expect_error([&] { DataLoader x(sh.files, 2, 8, 0, 2, o); }, {"rows[0] = 3 must equal this rank's B = 2"});
}

}  // namespace
}  // namespace blu
