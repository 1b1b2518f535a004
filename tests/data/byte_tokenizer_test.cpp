// The byte tokenizer (data/byte_tokenizer.h) on hostile text, load_tokenizer's names, and the
// shard folder's tokenizer record (data/text_tokenizer.h).
#include "blu/data/byte_tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "blu/data/prepare.h"
#include "blu/data/shard.h"
#include "blu/data/text_tokenizer.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

void expect_round_trip(const std::string& s) {
  const ByteTokenizer tok;
  const std::vector<int32_t> ids = tok.encode(s);
  for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << id;
  EXPECT_EQ(tok.decode(ids), s);
}

TEST(ByteTokenizer, OneIdPerByte) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_EQ(tok.encode("Ab\n"), (std::vector<int32_t>{65, 98, 10}));
  EXPECT_EQ(tok.encode(std::string("\xff\x00", 2)), (std::vector<int32_t>{255, 0}));
  EXPECT_EQ(tok.decode_token(97), "a");
  EXPECT_EQ(tok.decode_token(256), "<|endoftext|>");
}

TEST(ByteTokenizer, EndOfTextIsOneToken) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.encode("a<|endoftext|>b"), (std::vector<int32_t>{97, 256, 98}));
  EXPECT_EQ(tok.encode("<|endoftext|><|endoftext|>"), (std::vector<int32_t>{256, 256}));
  // A partial spelling is just bytes.
  EXPECT_EQ(tok.encode("<|endoftext").size(), 11u);
  EXPECT_EQ(tok.bos_id(), 256);
  EXPECT_EQ(tok.eos_id(), 256);
  EXPECT_EQ(tok.special_token_id("<|endoftext|>"), 256);
  EXPECT_FALSE(tok.special_token_id("<s>").has_value());
}

TEST(ByteTokenizer, RoundTripsHostileText) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  expect_round_trip(all);
  expect_round_trip(std::string("nul\0inside\0\0", 12));
  expect_round_trip("\xc3\x28 \xa0\xa1 \xe2\x82 \xf0\x28\x8c\xbc \xed\xa0\x80 \xf8\x88\x80\x80\x80");  // invalid UTF-8
  expect_round_trip("caf\xc3\xa9 \xf0\x9f\x98\x80 \xe4\xb8\xad");                                    // valid multi-byte
  expect_round_trip("\r\n\r\n%\n\t\v\f");
  expect_round_trip("<|endoftext|>x<|endoftext|<|endoftext|>");
  expect_round_trip(std::string(1 << 20, 'x') + "\n" + std::string(1 << 16, '\0'));  // long lines
  std::mt19937 rng(7);
  for (int i = 0; i < 50; ++i) {
    std::string s(size_t(rng() % 4000), '\0');
    for (auto& c : s) c = static_cast<char>(rng() & 0xff);
    expect_round_trip(s);
  }
}

TEST(ByteTokenizer, DecodeRefusesIdsOutsideTheVocabulary) {
  const ByteTokenizer tok;
  const std::vector<int32_t> bad = {65, 257};
  expect_error([&] { tok.decode(bad); }, {"[0, 257)", "257"});
  expect_error([&] { tok.decode_token(-1); }, {"-1"});
}

TEST(LoadTokenizer, ByName) {
  const auto tok = load_tokenizer("byte");
  EXPECT_EQ(tok->vocab_size(), 257);
  EXPECT_EQ(tok->encode("hi"), (std::vector<int32_t>{104, 105}));
  expect_error([] { load_tokenizer("no/such/tokenizer"); }, {"byte, gpt2", "no/such/tokenizer"});
}

// Bytes through prepare into shards and back: the shards hold the text, documents split at 256.
TEST(ByteTokenizer, PrepareShardsHoldTheBytes) {
  TempDir dir;
  const std::string doc = "line one\n\xff\xfe not utf-8\n";
  test::write_bytes(dir / "a.txt", doc);
  const ByteTokenizer tok;
  PrepareOptions o;
  o.name = "t";
  o.shard_tokens = 8;  // several shards: the first is validation
  const EncodeFn enc = [&](std::string_view s) { return tok.encode(s); };
  const PrepareStats st = prepare({dir / "a.txt"}, dir / "out", enc, ByteTokenizer::kEot, o);
  std::vector<int32_t> all;
  for (const auto& p : st.shard_paths) {
    const ShardReader r(p, 257);
    all.insert(all.end(), r.tokens().begin(), r.tokens().end());
  }
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(all.front(), 256);
  EXPECT_EQ(tok.decode(std::vector<int32_t>(all.begin() + 1, all.end())), doc);
}

TEST(ShardsRecord, WrittenAndReadBack) {
  TempDir dir;
  // No record: GPT-2's, as every shard folder written before the record existed.
  EXPECT_EQ(shards_tokenizer(dir.path().string()), "gpt2");
  record_shards_tokenizer(dir.path().string(), "byte", ByteTokenizer(), 256);
  EXPECT_EQ(shards_tokenizer(dir.path().string()), "byte");
  const nlohmann::json j = nlohmann::json::parse(test::read_bytes(dir / "shards.json"));
  EXPECT_EQ(j["tokenizer"], "byte");
  EXPECT_EQ(j["vocab_size"], 257);
  EXPECT_EQ(j["separator"], 256);
  EXPECT_EQ(shard_dir_of_pattern((dir / "x_train_*.bin").string()), dir.path().string());
  EXPECT_EQ(shard_dir_of_pattern("x_train_*.bin"), ".");
}

TEST(ShardsRecord, TokenizerFileIsCopiedIn) {
  TempDir dir;
  fs::create_directories(dir / "model");
  test::write_bytes(dir / "model" / "tokenizer.json", "{\"stand-in\": true}");
  test::write_bytes(dir / "model" / "tokenizer_config.json", "{}");
  const fs::path shards = dir / "shards";
  fs::create_directories(shards);
  record_shards_tokenizer(shards.string(), (dir / "model").string(), ByteTokenizer(), 256);
  EXPECT_EQ(test::read_bytes(shards / "tokenizer" / "tokenizer.json"), "{\"stand-in\": true}");
  EXPECT_TRUE(fs::exists(shards / "tokenizer" / "tokenizer_config.json"));
  // The record names the copy, so the folder can move.
  EXPECT_EQ(shards_tokenizer(shards.string()), (shards / "tokenizer/tokenizer.json").string());
}

TEST(ShardsRecord, MalformedRecordIsNamed) {
  TempDir dir;
  test::write_bytes(dir / "shards.json", "{\"tokeniser\": \"byte\"}");
  expect_error([&] { shards_tokenizer(dir.path().string()); }, {"shards.json", "\"tokenizer\""});
}

}  // namespace
}  // namespace blu
