#include "blu/data/shard.h"

#include <gtest/gtest.h>

#include <random>

#include "data/data_test_util.h"

namespace blu {
namespace {

using test::expect_error;
using test::raw_shard;
using test::TempDir;

std::vector<uint16_t> random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> t(n);
  for (auto& x : t) x = static_cast<uint16_t>(rng() % 50257);
  return t;
}

TEST(Shard, RoundTripIsByteExactLlmcLayout) {
  TempDir dir;
  const auto tokens = random_tokens(1000, 1);
  write_shard(dir / "a.bin", tokens);
  // Byte for byte what llm.c's write_datafile produces.
  EXPECT_EQ(test::read_bytes(dir / "a.bin"), raw_shard(20240520, 1, 1000, tokens));

  ShardReader r(dir / "a.bin");
  ASSERT_EQ(r.size(), 1000);
  EXPECT_EQ(std::vector<uint16_t>(r.tokens().begin(), r.tokens().end()), tokens);
  EXPECT_EQ(r[999], tokens[999]);
  EXPECT_EQ(r.path(), dir / "a.bin");
  EXPECT_EQ(read_shard_token_count(dir / "a.bin"), 1000);
  // No temporary file left beside it.
  EXPECT_EQ(test::list_dir(dir.path()), std::vector<std::string>{"a.bin"});
}

TEST(Shard, EmptyShard) {
  TempDir dir;
  write_shard(dir / "e.bin", {});
  ShardReader r(dir / "e.bin");
  EXPECT_EQ(r.size(), 0);
  EXPECT_TRUE(r.tokens().empty());
}

TEST(Shard, RefusesToOverwriteUnlessAsked) {
  TempDir dir;
  const auto a = random_tokens(10, 2), b = random_tokens(20, 3);
  write_shard(dir / "s.bin", a);
  expect_error([&] { write_shard(dir / "s.bin", b); }, {"s.bin", "already exists", "overwrite"});
  EXPECT_EQ(ShardReader(dir / "s.bin").size(), 10);
  write_shard(dir / "s.bin", b, /*overwrite=*/true);
  ShardReader r(dir / "s.bin");
  EXPECT_EQ(std::vector<uint16_t>(r.tokens().begin(), r.tokens().end()), b);
  EXPECT_EQ(test::list_dir(dir.path()), std::vector<std::string>{"s.bin"});
}

TEST(Shard, MoveKeepsTheMapping) {
  TempDir dir;
  const auto t = random_tokens(64, 4);
  write_shard(dir / "m.bin", t);
  ShardReader a(dir / "m.bin");
  ShardReader b(std::move(a));
  EXPECT_EQ(b.size(), 64);
  EXPECT_EQ(b[5], t[5]);
  ShardReader c(dir / "m.bin");
  c = std::move(b);
  EXPECT_EQ(c[63], t[63]);
}

TEST(Shard, MissingFile) {
  TempDir dir;
  expect_error([&] { ShardReader r(dir / "nope.bin"); }, {"nope.bin", "cannot open"});
}

TEST(Shard, ShorterThanHeader) {
  TempDir dir;
  test::write_bytes(dir / "short.bin", std::string(100, '\0'));
  expect_error([&] { ShardReader r(dir / "short.bin"); },
               {"short.bin", "100 bytes", "shorter than the 1024-byte header"});
  expect_error([&] { read_shard_token_count(dir / "short.bin"); }, {"short.bin", "shorter"});
}

TEST(Shard, WrongMagic) {
  TempDir dir;
  test::write_bytes(dir / "magic.bin", raw_shard(12345, 1, 2, {1, 2}));
  expect_error([&] { ShardReader r(dir / "magic.bin"); }, {"magic.bin", "expected 20240520", "got 12345"});
}

TEST(Shard, WrongVersion) {
  TempDir dir;
  test::write_bytes(dir / "ver.bin", raw_shard(20240520, 7, 2, {1, 2}));
  expect_error([&] { ShardReader r(dir / "ver.bin"); }, {"ver.bin", "version", "expected 1", "got 7"});
}

TEST(Shard, Truncated) {
  TempDir dir;
  test::write_bytes(dir / "trunc.bin", raw_shard(20240520, 1, 10, std::vector<uint16_t>(8, 3)));
  expect_error([&] { ShardReader r(dir / "trunc.bin"); },
               {"trunc.bin", "truncated", "10 tokens", "expected 1044 bytes", "got 1040", "4 bytes missing"});
}

TEST(Shard, TrailingBytes) {
  TempDir dir;
  test::write_bytes(dir / "trail.bin", raw_shard(20240520, 1, 10, std::vector<uint16_t>(10, 3), 3));
  expect_error([&] { ShardReader r(dir / "trail.bin"); },
               {"trail.bin", "trailing bytes", "expected 1044 bytes", "got 1047", "3 bytes too many"});
}

TEST(Shard, NegativeCount) {
  TempDir dir;
  test::write_bytes(dir / "neg.bin", raw_shard(20240520, 1, -1, {}));
  expect_error([&] { ShardReader r(dir / "neg.bin"); }, {"neg.bin", "negative token count -1"});
}

TEST(Shard, TokenOutsideVocab) {
  TempDir dir;
  std::vector<uint16_t> t(16, 100);
  t[5] = 50257;
  write_shard(dir / "v.bin", t);
  expect_error([&] { ShardReader r(dir / "v.bin", 50257); },
               {"v.bin", "position 5", "is 50257", "vocab_size 50257"});
  EXPECT_EQ(ShardReader(dir / "v.bin", 50258).size(), 16);  // in range
  EXPECT_EQ(ShardReader(dir / "v.bin").size(), 16);         // no check asked for
}

}  // namespace
}  // namespace blu
