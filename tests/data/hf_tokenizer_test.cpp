// Tests for data/hf_tokenizer (tokenizer.json), the pre-tokenisation patterns it uses
// (data/pretokenize) and data/text_tokenizer's load_tokenizer. The oracle is the npm package
// @huggingface/tokenizers (scripts/fetch_hf_tokenizers.sh), run with node through
// tests/data/hf_encode_reference.js on tokenizer.json files that tests/data/make_hf_tokenizer_json.js
// builds at test time from GPT-2's vocabulary (scripts/fetch_gpt2_vocab.sh) in the shapes of GPT-2,
// Llama 3, Qwen2 and SmolLM. Without node, the vocabulary or the package, the tests fail, or skip
// when BLU_ALLOW_SKIP=1. The pattern and error tests need none of them.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "blu/core/error.h"
#include "blu/data/bpe.h"
#include "blu/data/hf_tokenizer.h"
#include "blu/data/pretokenize.h"
#include "blu/data/text_tokenizer.h"
#include "blu/data/tokenizer.h"
#include "blu/data/unicode_tables.h"
#include "data/data_test_util.h"
#include "data/tokenizer_samples.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace blu {
namespace {

using test::escaped;
using test::TempDir;

bool allow_skip() {
  const char* v = std::getenv("BLU_ALLOW_SKIP");
  return v && std::string(v) == "1";
}

std::string hf_package_dir() {
  return std::string(BLU_SOURCE_DIR) + "/.deps/hf-tokenizers/node_modules/@huggingface/tokenizers";
}

// Strict UTF-8, as pretokenize's decoder reads it.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    size_t n = b0 < 0x80 ? 1 : b0 >= 0xC2 && b0 <= 0xDF ? 2 : b0 >= 0xE0 && b0 <= 0xEF ? 3 : b0 >= 0xF0 && b0 <= 0xF4 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    const auto b1 = static_cast<unsigned char>(s[i + 1 < s.size() ? i + 1 : i]);
    if ((b0 == 0xE0 && b1 < 0xA0) || (b0 == 0xED && b1 > 0x9F) || (b0 == 0xF0 && b1 < 0x90) || (b0 == 0xF4 && b1 > 0x8F))
      return false;
    i += n;
  }
  return true;
}

std::string hex_of(std::string_view s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += digits[c >> 4], out += digits[c & 15];
  return out;
}

// --- pre-tokenisation patterns, by hand ------------------------------------------------------------

using V = std::vector<std::string>;

V pieces(std::string_view text, SplitPattern p, Whitespace ws = Whitespace::unicode) {
  std::vector<std::string_view> out;
  regex_pretokenize(text, p, ws, out);
  return V(out.begin(), out.end());
}

V digit_pieces(std::string_view text, bool individual) {
  std::vector<std::string_view> out;
  split_digits(text, individual, out);
  return V(out.begin(), out.end());
}

TEST(HfPretokenize, Llama3PatternBranches) {
  const auto L = SplitPattern::llama3;
  EXPECT_EQ(pieces("", L), V{});
  EXPECT_EQ(pieces("Hello world", L), (V{"Hello", " world"}));
  // (?i:...) contractions, in any case, and U+017F (long s) whose case fold is s.
  EXPECT_EQ(pieces("HELLO'S it's I'LL we'Re", L), (V{"HELLO", "'S", " it", "'s", " I", "'LL", " we", "'Re"}));
  EXPECT_EQ(pieces("x'\xC5\xBFy", L), (V{"x", "'\xC5\xBF", "y"}));
  EXPECT_EQ(pieces("'sam", L), (V{"'s", "am"}));      // the first alternative wins, not the longest
  EXPECT_EQ(pieces(" 'll", L), (V{" '", "ll"}));      // a contraction only starts a match
  EXPECT_EQ(pieces("(hello) \"x\"", L), (V{"(hello", ")", " \"", "x", "\""}));  // one symbol before letters
  EXPECT_EQ(pieces("\thello\u3000x", L), (V{"\thello", "\u3000x"}));     // so is one whitespace character
  EXPECT_EQ(pieces("a\nb", L), (V{"a", "\n", "b"}));                      // but not \r or \n
  EXPECT_EQ(pieces("1234567 89", L), (V{"123", "456", "7", " ", "89"}));
  EXPECT_EQ(pieces("x !!\n\ny", L), (V{"x", " !!\n\n", "y"}));            // symbols take the newlines after
  EXPECT_EQ(pieces("a\r\n\r\n  b", L), (V{"a", "\r\n\r\n", " ", " b"}));  // \s*[\r\n]+ ends at the last newline
  EXPECT_EQ(pieces("a  \n  ", L), (V{"a", "  \n", "  "}));
  EXPECT_EQ(pieces("a   b", L), (V{"a", "  ", " b"}));                    // \s+(?!\S)
  EXPECT_EQ(pieces("x\xC2\x85y", L), (V{"x", "\xC2\x85y"}));             // U+0085 is \s, not a letter
}

TEST(HfPretokenize, Qwen2SplitsEveryNumber) {
  EXPECT_EQ(pieces("abc 12345", SplitPattern::qwen2), (V{"abc", " ", "1", "2", "3", "4", "5"}));
  EXPECT_EQ(pieces("HE'LL", SplitPattern::qwen2), (V{"HE", "'LL"}));
}

TEST(HfPretokenize, Gpt2PatternWhitespaceSets) {
  const auto G = SplitPattern::gpt2;
  // Unicode White_Space (Oniguruma, the Rust library): U+0085 is whitespace, U+FEFF is a symbol.
  EXPECT_EQ(pieces("a\xC2\x85\xC2\x85" "b", G, Whitespace::unicode), (V{"a", "\xC2\x85", "\xC2\x85", "b"}));
  EXPECT_EQ(pieces("a \xEF\xBB\xBF" "b", G, Whitespace::unicode), (V{"a", " \xEF\xBB\xBF", "b"}));
  // JavaScript's \s (gpt-3-encoder): the other way round.
  EXPECT_EQ(pieces("a\xC2\x85\xC2\x85" "b", G, Whitespace::javascript), (V{"a", "\xC2\x85\xC2\x85", "b"}));
  EXPECT_EQ(pieces("a \xEF\xBB\xBF" "b", G, Whitespace::javascript), (V{"a", " ", "\xEF\xBB\xBF", "b"}));
  // GPT-2's contractions are lower case only.
  EXPECT_EQ(pieces("IT'S it's", G), (V{"IT", "'", "S", " it", "'s"}));
  EXPECT_EQ(pieces("A'LL", G), (V{"A", "'", "LL"}));
}

TEST(HfPretokenize, Digits) {
  // Every character of general category N (char::is_numeric in the Rust library), not only 0-9.
  const std::string text = "ab12c\xD9\xA3\xD9\xA4 \xC2\xB2x";  // ab12c٣٤ ²x
  EXPECT_EQ(digit_pieces(text, true), (V{"ab", "1", "2", "c", "\xD9\xA3", "\xD9\xA4", " ", "\xC2\xB2", "x"}));
  EXPECT_EQ(digit_pieces(text, false), (V{"ab", "12", "c", "\xD9\xA3\xD9\xA4", " ", "\xC2\xB2", "x"}));
  EXPECT_EQ(digit_pieces("", true), V{});
  EXPECT_EQ(digit_pieces("\xFF" "1\x80", true), (V{"\xFF", "1", "\x80"}));
}

TEST(HfPretokenize, PatternsCoverInvalidUtf8) {
  const std::string text = "ab\x80\xC3 c\xE2\x82\xC0\xAF\xED\xA0\x80\xF4\x90\x80\x80 z\r\n\xFF" "12";
  for (auto p : {SplitPattern::gpt2, SplitPattern::llama3, SplitPattern::qwen2}) {
    std::string joined;
    for (const auto& piece : pieces(text, p)) {
      EXPECT_FALSE(piece.empty());
      joined += piece;
    }
    EXPECT_EQ(joined, text);
  }
  EXPECT_EQ(pieces("a\x80hello", SplitPattern::llama3), (V{"a", "\x80hello"}));  // a stray byte is a symbol
}

TEST(HfPretokenize, RegexStringsAreRecognisedExactly) {
  for (auto p : {SplitPattern::gpt2, SplitPattern::llama3, SplitPattern::qwen2})
    EXPECT_EQ(split_pattern_from_regex(split_pattern_regex(p)), p);
  EXPECT_FALSE(split_pattern_from_regex(std::string(split_pattern_regex(SplitPattern::llama3)) + " "));
  EXPECT_FALSE(split_pattern_from_regex(R"(\p{L}+)"));
}

// --- tokenizer.json files built from GPT-2's vocabulary ------------------------------------------

const char* const kFlavours[] = {"gpt2", "gpt2_prefix", "llama3", "qwen2", "smollm"};

class HfTokenizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    const std::string vocab = default_vocab_dir();
    if (!fs::exists(fs::path(vocab) / "encoder.json")) {
      problem_ = "GPT-2 vocabulary not found in " + vocab + ": run scripts/fetch_gpt2_vocab.sh";
      return;
    }
    if (std::system("node --version > /dev/null 2>&1") != 0) {
      problem_ = "node not found on PATH: the tokenizer.json files are built and checked with Node.js";
      return;
    }
    dir_ = new TempDir();
    const std::string cmd = "node '" BLU_TEST_DIR "/data/make_hf_tokenizer_json.js' '" + vocab + "' '" +
                            dir_->path().string() + "'";
    if (std::system(cmd.c_str()) != 0) {
      problem_ = "building the test tokenizer.json files failed: " + cmd;
      return;
    }
    for (const char* f : kFlavours)
      toks_.emplace(f, std::make_unique<HfTokenizer>(HfTokenizer::load((dir_->path() / f / "tokenizer.json").string())));
  }
  static void TearDownTestSuite() {
    toks_.clear();
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (problem_.empty()) return;
    if (allow_skip()) GTEST_SKIP() << problem_;
    FAIL() << problem_ << "; set BLU_ALLOW_SKIP=1 to skip instead";
  }
  static const HfTokenizer& tok(const std::string& flavour) { return *toks_.at(flavour); }
  static fs::path file(const std::string& flavour) { return dir_->path() / flavour / "tokenizer.json"; }

  static inline std::string problem_;
  static inline TempDir* dir_ = nullptr;
  static inline std::map<std::string, std::unique_ptr<HfTokenizer>> toks_;
};

// Text the GPT-2 tests do not stress: digit runs, CRLF, space runs, upper-case contractions,
// emoji, the characters where the whitespace sets and number sets of the implementations differ,
// and every flavour's special tokens inside text (each flavour sees the others' as plain text).
std::vector<std::string> extra_samples() {
  return {
      "1234567890 12 1 123456789012345 3.14159 1,000,000.00 007 \xD9\xA3\xD9\xA4\xD9\xA5\xD9\xA6 \xC2\xB2\xC2\xB3 12ab34",
      "line one\r\nline two\r\n\r\nthree\rfour\n\r\n end\r\n",
      "a  b   c     d\t\t e \xE3\x80\x80 f\xC2\xA0\xC2\xA0g   \n   h      ",
      "IT'S THEY'RE WE'VE I'M YOU'LL HE'D DON'T 'S 'LL 'Re 'rE x'\xC5\xBF x'\xC5\xBFy ' s '' s",
      "emoji \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD family \xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7 "
      "flags \xF0\x9F\x87\xAB\xF0\x9F\x87\xB7 keycap 1\xEF\xB8\x8F\xE2\x83\xA3 text\xF0\x9F\x99\x82text",
      "nel\xC2\x85\xC2\x85x bom\xEF\xBB\xBF\xEF\xBB\xBFx a \xEF\xBB\xBF" "b a\xC2\x85\xC2\x85" "b \xC2\x85\n",
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat's 2+2?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|><|end_of_text|>",
      "<|begin_of_text|<|begin_of_text|>> <|reserved_special_token_1|><|python_tag|>x blutrain blutrainer ablutrain blutrai bl",
      "<|im_start|>system\nYou are 42.<|im_end|>\n<|im_start|>user\nHi 123<|im_end|><|object_ref_start|><|box_start|>(1,2)",
      "<repo_name>blu<file_sep>a.py\n12+34=46<|endoftext|><reponame><filename>x<filename <gh_stars>10",
      "a <mask> b a   <mask>  <sep>   b <mask><sep> x \t<mask>\t <|endoftext|> <mask>",
      "<|endoftext|><|endoftext|> <|endoftext| <|endoftext|>",
      "BluTrain BluTrain, BluTrains  BluTrain\n BluTrain",
  };
}

// Random concatenations of fragments that meet at the patterns' edges: special tokens, spaces,
// newlines, contractions, digits, letters, symbols, emoji.
std::vector<std::string> fragment_samples(uint32_t seed, int count) {
  static const char* frags[] = {
      "<|begin_of_text|>", "<|eot_id|>", "<|endoftext|>", "<mask>", "<sep>", "<|im_start|>", "<file_sep>",
      "blutrain", "blu", "trai", " BluTrain", " ", "  ", "   ", "\r\n", "\n", "\r", "\t", "'s", "'S", "'LL", "'", "1", "23", "4567",
      "\xD9\xA3", "a", "Hello", "WORLD", "\xC5\xBF", "!", "?!", "(", "\xF0\x9F\x98\x80", "\xC3\xA9",
      "\xE4\xB8\xAD\xE6\x96\x87", "\xC2\x85", "\xEF\xBB\xBF", "\xC2\xA0", "<", "|", ">", ".", ","};
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (int s = 0; s < count; ++s) {
    std::string text;
    for (uint32_t n = 1 + rng() % 20; n > 0; --n) text += frags[rng() % std::size(frags)];
    out.push_back(text);
  }
  return out;
}

// Byte strings that are not valid UTF-8.
std::vector<std::string> invalid_samples() {
  std::vector<std::string> out = {
      "ab\x80\xC3 c\xE2\x82\xC0\xAF\xED\xA0\x80\xF4\x90\x80\x80 z",
      "<|eot_id|>\xFF<|eot_id|>\xFE<mask>\xC0",
      "12\xC3\x28 34 \xE2\x82 x'\xC5",
      std::string("\0\0 \0x", 6),
  };
  std::mt19937 rng(11);
  for (int i = 0; i < 40; ++i) {
    std::string bytes(1 + rng() % 60, '\0');
    for (auto& c : bytes) c = char(rng() & 0xFF);
    out.push_back(bytes);
  }
  return out;
}

std::vector<std::string> oracle_samples() {
  const char* n_env = std::getenv("BLU_ORACLE_SAMPLES");  // a longer soak: BLU_ORACLE_SAMPLES=20000
  const int n = n_env ? std::atoi(n_env) : 120;
  std::vector<std::string> samples = test::fixed_samples();
  for (auto& s : extra_samples()) samples.push_back(s);
  for (auto& s : test::random_samples(1234, n)) samples.push_back(s);
  for (auto& s : test::punctuation_samples(99, n)) samples.push_back(s);
  for (auto& s : fragment_samples(5, n)) samples.push_back(s);
  for (auto& s : invalid_samples()) samples.push_back(s);
  return samples;
}

struct Reference {
  std::string text;  // what was encoded: the sample, or its U+FFFD-replaced text if not UTF-8
  std::vector<int32_t> ids;
  std::string decoded;
  V pieces;  // pre-tokenisation pieces, spelled in the byte alphabet
};

std::string spelling_of(unsigned char b) {
  const char32_t cp = byte_to_code_point(b);
  return cp < 0x80 ? std::string(1, char(cp)) : std::string{char(0xC0 | cp >> 6), char(0x80 | (cp & 0x3F))};
}

// HfTokenizer::pretokenize's pieces spelled as the reference prints them.
V spelled_pieces(const HfTokenizer& t, std::string_view text) {
  V out;
  for (const auto& piece : t.pretokenize(text)) {
    std::string s;
    for (unsigned char b : piece) s += spelling_of(b);
    out.push_back(s);
  }
  return out;
}

// Runs hf_encode_reference.js on the samples with the given tokenizer.json.
std::vector<Reference> run_reference(const fs::path& tokenizer_json, const std::vector<std::string>& samples,
                                     bool as_is = false) {
  TempDir tmp;
  json arr = json::array();
  for (const auto& s : samples) arr.push_back(valid_utf8(s) ? json(s) : json{{"hex", hex_of(s)}});
  test::write_bytes(tmp / "samples.json", arr.dump());
  const std::string cmd = std::string(as_is ? "BLU_HF_ORACLE_AS_IS=1 " : "") + "node '" BLU_TEST_DIR
                          "/data/hf_encode_reference.js' '" + hf_package_dir() + "' '" + tokenizer_json.string() +
                          "' '" + (tmp / "samples.json").string() + "' > '" + (tmp / "ref.json").string() + "'";
  if (std::system(cmd.c_str()) != 0) throw Error("reference encoder failed: " + cmd);
  const json ref = json::parse(test::read_bytes(tmp / "ref.json"));
  std::vector<Reference> out;
  for (const auto& r : ref)
    out.push_back({r["text"].get<std::string>(), r["ids"].get<std::vector<int32_t>>(), r["decoded"].get<std::string>(),
                   r["pieces"].get<V>()});
  return out;
}

void require_reference_package() {
  if (fs::exists(hf_package_dir() + "/dist/tokenizers.cjs")) return;
  const std::string msg = "@huggingface/tokenizers not found in " + hf_package_dir() +
                          ": run scripts/fetch_hf_tokenizers.sh";
  if (allow_skip()) GTEST_SKIP() << msg;
  FAIL() << msg << "; set BLU_ALLOW_SKIP=1 to skip instead";
}

// decode(encode(s)) == s, except where the tokenizer drops or adds spaces by design: the added
// tokens with lstrip/rstrip (gpt2's <mask> and <sep>) take the whitespace next to them, and
// add_prefix_space adds one.
bool round_trips(const std::string& flavour, std::string_view text) {
  if (flavour == "gpt2_prefix") return false;
  return flavour != "gpt2" || (text.find("<mask>") == text.npos && text.find("<sep>") == text.npos);
}

TEST_P(HfTokenizerTest, MatchesReference) {
  require_reference_package();
  const std::string flavour = GetParam();
  const HfTokenizer& t = tok(flavour);
  const auto samples = oracle_samples();
  const auto ref = run_reference(file(flavour), samples);
  ASSERT_EQ(ref.size(), samples.size());
  int failures = 0;
  size_t invalid = 0;
  for (size_t i = 0; i < samples.size() && failures < 5; ++i) {
    invalid += !valid_utf8(samples[i]);
    const std::vector<int32_t> got = t.encode(ref[i].text);
    EXPECT_EQ(got, ref[i].ids) << flavour << " sample " << i << ": " << escaped(ref[i].text);
    EXPECT_EQ(spelled_pieces(t, ref[i].text), ref[i].pieces) << flavour << " sample " << i << ": " << escaped(ref[i].text);
    // The reference decodes to text too; without add_prefix_space, both give the text back.
    EXPECT_EQ(t.decode(got), ref[i].decoded) << flavour << " sample " << i << ": " << escaped(ref[i].text);
    if (round_trips(flavour, ref[i].text)) {
      EXPECT_EQ(ref[i].decoded, ref[i].text) << "sample " << i;
    }
    failures += got != ref[i].ids;
  }
  EXPECT_GT(invalid, 40u);  // the invalid-UTF-8 samples went through as U+FFFD text
}

TEST_P(HfTokenizerTest, RoundTrip) {
  const std::string flavour = GetParam();
  const HfTokenizer& t = tok(flavour);
  std::vector<std::string> texts = oracle_samples();
  texts.push_back(std::string(3000, ' ') + std::string(2000, 'a') + std::string(500, '\n') + std::string(700, '7'));
  for (const auto& text : texts) {
    if (flavour == "gpt2_prefix" && text.find('<') == text.npos) {  // one stretch: one space added
      EXPECT_EQ(t.decode(t.encode(text)), text.starts_with(' ') ? text : " " + text) << escaped(text);
      continue;
    }
    if (!round_trips(flavour, text)) continue;
    const auto ids = t.encode(text);  // invalid UTF-8 included: its bytes go through as symbols
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size()) << id;
    EXPECT_EQ(t.decode(ids), text) << flavour << ": " << escaped(text);
    std::string joined;
    for (int32_t id : ids) joined += t.decode_token(id);
    EXPECT_EQ(joined, text);
  }
}

INSTANTIATE_TEST_SUITE_P(Flavours, HfTokenizerTest, ::testing::Values("gpt2", "gpt2_prefix", "llama3", "qwen2", "smollm"),
                         [](const auto& info) { return info.param; });

// hf_encode_reference.js sets the port to the Rust library's behaviour in four documented places.
// Unpatched, the port must differ only on samples holding the characters those places are about:
// so the patches neither hide other differences nor are themselves idle.
TEST_F(HfTokenizerTest, ReferencePatchesCoverExactlyTheDocumentedDifferences) {
  require_reference_package();
  auto mentions = [](std::string_view s) {  // U+0085, U+FEFF, U+017F, or a number outside 0-9
    if (s.find("\xC2\x85") != s.npos || s.find("\xEF\xBB\xBF") != s.npos || s.find("\xC5\xBF") != s.npos) return true;
    std::vector<std::string_view> parts;
    split_digits(s, true, parts);
    for (auto p : parts)
      if (static_cast<unsigned char>(p[0]) >= 0x80 && digit_pieces(std::string(p) + "x", true).size() == 2) return true;
    return false;
  };
  const auto samples = oracle_samples();
  for (const char* flavour : {"gpt2", "llama3", "smollm"}) {
    const auto ref = run_reference(file(flavour), samples, /*as_is=*/true);
    int differing = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      if (tok(flavour).encode(ref[i].text) == ref[i].ids && spelled_pieces(tok(flavour), ref[i].text) == ref[i].pieces)
        continue;
      ++differing;
      EXPECT_TRUE(mentions(ref[i].text)) << flavour << ": undocumented difference on " << escaped(ref[i].text);
    }
    EXPECT_GT(differing, 0) << flavour << ": the unpatched port agrees everywhere; is a patch still needed?";
  }
}

TEST_F(HfTokenizerTest, KnownIdsAndSpecialTokens) {
  // GPT-2's own ids, through every flavour whose split leaves "Hello world" as GPT-2 does.
  for (const char* f : {"gpt2", "llama3", "qwen2", "smollm"})
    EXPECT_EQ(tok(f).encode("Hello world"), (std::vector<int32_t>{15496, 995})) << f;
  EXPECT_EQ(tok("gpt2_prefix").encode("Hello world"), (std::vector<int32_t>{18435, 995}));  // " Hello"
  EXPECT_EQ(tok("gpt2").vocab_size(), 50259);
  EXPECT_EQ(tok("llama3").vocab_size(), 50270);
  // The longest added token at a position wins: "blutrain", not its prefix "blu".
  EXPECT_EQ(tok("llama3").encode("blutrain blutrai"), (std::vector<int32_t>{50267, 220, 50268, 9535, 72}));

  EXPECT_EQ(tok("llama3").special_token_id("<|eot_id|>"), 50265);
  EXPECT_EQ(tok("llama3").special_token_id("<|endoftext|>"), std::nullopt);
  EXPECT_EQ(tok("llama3").bos_id(), 50256);   // from the TemplateProcessing post-processor
  EXPECT_EQ(tok("llama3").eos_id(), std::nullopt);
  EXPECT_EQ(tok("smollm").bos_id(), 50256);   // from tokenizer_config.json
  EXPECT_EQ(tok("smollm").eos_id(), 50256);
  EXPECT_EQ(tok("gpt2").bos_id(), std::nullopt);

  const auto ids = tok("llama3").encode("<|begin_of_text|>Hi<|eot_id|>");
  EXPECT_EQ(ids.front(), 50256);
  EXPECT_EQ(ids.back(), 50265);
  EXPECT_EQ(tok("llama3").decode_token(50256), "<|begin_of_text|>");
  // In GPT-2's vocabulary "<|endoftext|>" is token 50256 and an added token.
  EXPECT_EQ(tok("gpt2").encode("a<|endoftext|>"), (std::vector<int32_t>{64, 50256}));
  // lstrip takes the spaces before <mask>; rstrip the spaces after <sep>.
  EXPECT_EQ(tok("gpt2").encode("a   <mask>"), (std::vector<int32_t>{64, 50257}));
  EXPECT_EQ(tok("gpt2").encode("<sep>   b"), (std::vector<int32_t>{50258, 65}));

  HfTokenizer copy = HfTokenizer::load(file("llama3").string());
  copy.set_eos("<|eot_id|>");
  EXPECT_EQ(copy.eos_id(), 50265);
  EXPECT_THROW(copy.set_bos("<|nope|>"), Error);
}

TEST_F(HfTokenizerTest, IgnoreMergesTakesWholeVocabularyTokens) {
  // "ĠBluTrain" (50269) is in the llama3 flavour's vocabulary, but no merge makes it.
  EXPECT_EQ(tok("llama3").encode(" BluTrain"), (std::vector<int32_t>{50269}));
  EXPECT_GT(tok("llama3").encode(" BluTrains").size(), 1u);  // not a token: BPE
  EXPECT_GT(tok("qwen2").encode(" BluTrain").size(), 1u);     // not in its vocabulary
  EXPECT_EQ(tok("llama3").pretokenize("a 123456"), (V{"a", " ", "123", "456"}));
  EXPECT_EQ(tok("smollm").pretokenize("a 12"), (V{"a", " ", "1", "2"}));
}

TEST_F(HfTokenizerTest, LoadTokenizerPicksTheImplementation) {
  auto hf = load_tokenizer((dir_->path() / "llama3").string());
  ASSERT_NE(dynamic_cast<HfTokenizer*>(hf.get()), nullptr);
  EXPECT_EQ(hf->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(hf->bos_id(), 50256);
  auto direct = load_tokenizer(file("smollm").string());
  EXPECT_EQ(direct->eos_id(), 50256);
  auto gpt2 = load_tokenizer(default_vocab_dir());
  ASSERT_NE(dynamic_cast<Tokenizer*>(gpt2.get()), nullptr);
  EXPECT_EQ(gpt2->eos_id(), 50256);
  EXPECT_EQ(gpt2->special_token_id("<|endoftext|>"), 50256);
  EXPECT_EQ(gpt2->vocab_size(), 50257);

  TempDir empty;
  try {
    load_tokenizer(empty.path().string());
    ADD_FAILURE() << "an empty folder loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("found neither"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_tokenizer((empty / "missing").string()), Error);
}

TEST_F(HfTokenizerTest, ConcurrentEncodeMatchesSerial) {
  const auto texts = fragment_samples(3, 200);
  const HfTokenizer fresh = HfTokenizer::load(file("llama3").string());  // its own, cold cache
  std::vector<std::vector<int32_t>> serial;
  for (const auto& t : texts) serial.push_back(fresh.encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int th = 0; th < 4; ++th)
    threads.emplace_back([&, th] {
      for (size_t i = 0; i < texts.size(); ++i)
        if (tok("llama3").encode(texts[(i + 50 * th) % texts.size()]) != serial[(i + 50 * th) % texts.size()])
          ++mismatches[th];
    });
  for (auto& th : threads) th.join();
  for (int th = 0; th < 4; ++th) EXPECT_EQ(mismatches[th], 0) << "thread " << th;
}

TEST_F(HfTokenizerTest, EncodesMegabytesInSeconds) {
  static const char* words[] = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "was", "On", "ARE",
                                "model", "gradient", "tensor", "training", "token", "Hello", "world", "don't",
                                "naïve", "2024", "3.14", "(see", "below)", "—", "e.g.,", "“quoted”", "<|eot_id|>"};
  std::mt19937 rng(5);
  std::string text;
  while (text.size() < 3'000'000) {
    text += words[rng() % std::size(words)];
    text += (rng() % 12 == 0) ? ".\r\n" : " ";
  }
  const HfTokenizer fresh = HfTokenizer::load(file("llama3").string());
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = fresh.encode(text);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ perf     ] llama3 flavour: %.2f MB into %zu ids in %.2f s (%.1f MB/s, fresh cache)\n",
              text.size() / 1e6, ids.size(), secs, text.size() / 1e6 / secs);
  EXPECT_EQ(fresh.decode(ids), text);
  EXPECT_LT(secs, 30.0) << "encoding is far slower than expected";
}

TEST_F(HfTokenizerTest, BadIdsNameTheId) {
  for (int32_t bad : {-1, 50270, 1 << 30}) {
    try {
      tok("llama3").decode(std::vector<int32_t>{15496, bad});
      ADD_FAILURE() << "decode accepted id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos) << e.what();
    }
    EXPECT_THROW(tok("llama3").decode_token(bad), Error);
  }
}

// --- errors: a small valid tokenizer.json, then one thing wrong at a time ---------------------------

// 256 byte tokens, "ab" and "abc" by two merges, <|end|> as an added token.
json small_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[spelling_of(static_cast<unsigned char>(b))] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 258}, {"content", "<|end|>"}, {"single_word", false}, {"lstrip", false},
                                     {"rstrip", false}, {"normalized", false}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"byte_fallback", false},
        {"vocab", vocab}, {"merges", json::array({"a b", json::array({"ab", "c"})})}}},
  };
}

std::string error_of(const json& j) {
  try {
    HfTokenizer::from_json(j.dump(), "my/tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

#define EXPECT_ERROR(j, text)                                                         \
  do {                                                                                \
    const std::string msg_ = error_of(j);                                             \
    EXPECT_NE(msg_.find(text), std::string::npos) << "want: " << (text) << "\ngot:  " << msg_; \
  } while (0)

TEST(HfTokenizerErrors, SmallTokenizerWorks) {
  const HfTokenizer t = HfTokenizer::from_json(small_tokenizer().dump());
  EXPECT_EQ(t.encode("abc ab<|end|>"), (std::vector<int32_t>{257, ' ', 256, 258}));  // byte b is token b here
  EXPECT_EQ(t.encode("abc"), (std::vector<int32_t>{257}));
  EXPECT_EQ(t.encode("ab<|end|>"), (std::vector<int32_t>{256, 258}));
  EXPECT_EQ(t.vocab_size(), 259);
  EXPECT_EQ(t.decode(t.encode("xabcy <|end|> z")), "xabcy <|end|> z");
}

TEST(HfTokenizerErrors, IgnoreMergesOption) {
  json j = small_tokenizer();
  j["model"]["vocab"]["xyz"] = 300;  // no merge makes it
  EXPECT_EQ(HfTokenizer::from_json(j.dump()).encode("xyz"), (std::vector<int32_t>{'x', 'y', 'z'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(HfTokenizer::from_json(j.dump()).encode("xyz"), (std::vector<int32_t>{300}));
  EXPECT_EQ(HfTokenizer::from_json(j.dump()).encode("xyzw"), (std::vector<int32_t>{'x', 'y', 'z', 'w'}));
  j["model"]["ignore_merges"] = "yes";
  EXPECT_ERROR(j, R"(model.ignore_merges: expected true or false, got "yes")");
}

TEST(HfTokenizerErrors, UnsupportedModelsAndOptions) {
  json j = small_tokenizer();
  j["model"]["type"] = "Unigram";
  EXPECT_ERROR(j, R"(my/tokenizer.json: model.type: expected "BPE", got "Unigram")");
  j["model"]["type"] = "WordPiece";
  EXPECT_ERROR(j, R"(model.type: expected "BPE", got "WordPiece")");

  j = small_tokenizer();
  j["model"]["byte_fallback"] = true;
  EXPECT_ERROR(j, "model.byte_fallback: expected false");
  j = small_tokenizer();
  j["model"]["dropout"] = 0.1;
  EXPECT_ERROR(j, "model.dropout: expected null");
  j = small_tokenizer();
  j["model"]["continuing_subword_prefix"] = "##";
  EXPECT_ERROR(j, R"(model.continuing_subword_prefix: expected null or "")");
  j = small_tokenizer();
  j["normalizer"] = {{"type", "NFC"}};
  EXPECT_ERROR(j, R"(my/tokenizer.json: normalizer: expected null (normalizers are not supported), got {"type":"NFC"})");
  j = small_tokenizer();
  j["truncation"] = {{"max_length", 512}};
  EXPECT_ERROR(j, "truncation: expected null");
  j = small_tokenizer();
  j["decoder"] = {{"type", "Metaspace"}};
  EXPECT_ERROR(j, R"(decoder: expected {"type": "ByteLevel", ...}, got {"type":"Metaspace"})");
  j = small_tokenizer();
  j["added_tokens"][0]["single_word"] = true;
  EXPECT_ERROR(j, "added_tokens[0].single_word: expected false (single_word is not supported), got true");
}

TEST(HfTokenizerErrors, UnsupportedPreTokenizers) {
  json j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Split"},
                                                        {"pattern", {{"Regex", R"(\p{L}+|\s+)"}}},
                                                        {"behavior", "Isolated"},
                                                        {"invert", false}},
                                                       {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  EXPECT_ERROR(j, R"(my/tokenizer.json: pre_tokenizer.pretokenizers[0].pattern.Regex: expected the regex of GPT-2, Llama 3 or Qwen2 (see docs/tokenizer.md), got "\\p{L}+|\\s+")");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = std::string(split_pattern_regex(SplitPattern::llama3));
  EXPECT_NO_THROW(HfTokenizer::from_json(j.dump()));
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  EXPECT_ERROR(j, R"(pre_tokenizer.pretokenizers[0].behavior: expected "Isolated", got "Removed")");
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Isolated";
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", " "}};
  EXPECT_ERROR(j, R"(pre_tokenizer.pretokenizers[0].pattern: expected {"Regex": one of the supported regexes}, got {"String":" "})");

  j = small_tokenizer();
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
  EXPECT_ERROR(j, R"(pre_tokenizer.type: expected "ByteLevel" as the last step (byte-level BPE), got "Metaspace")");
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "ByteLevel"}}, {{"type", "Digits"}}})}};
  EXPECT_ERROR(j, "pre_tokenizer.pretokenizers[0].type: expected ByteLevel only as the last step");
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array()}};
  EXPECT_ERROR(j, "pre_tokenizer.pretokenizers: expected a list ending in a ByteLevel pre-tokenizer, got an empty list");
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Whitespace"}}, {{"type", "ByteLevel"}}})}};
  EXPECT_ERROR(j, R"(pre_tokenizer.pretokenizers[0].type: expected "Split", "Digits" or "ByteLevel", got "Whitespace")");
  j.erase("pre_tokenizer");
  EXPECT_ERROR(j, "pre_tokenizer: expected a ByteLevel pre-tokenizer, or a Sequence ending in one, got nothing (the field is missing)");
}

TEST(HfTokenizerErrors, BadJsonAndMissingFields) {
  const std::string bad = "{\"model\": {";
  try {
    HfTokenizer::from_json(bad, "my/tokenizer.json");
    ADD_FAILURE() << "bad JSON accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("my/tokenizer.json: not valid JSON"), std::string::npos) << e.what();
  }
  EXPECT_ERROR(json::array({1, 2}), "my/tokenizer.json: (top level): expected a JSON object, got [1,2]");
  json j = small_tokenizer();
  j.erase("model");
  EXPECT_ERROR(j, "my/tokenizer.json: model: expected an object, got nothing (the field is missing)");
  j = small_tokenizer();
  j["model"].erase("type");
  EXPECT_ERROR(j, "model.type: expected a string naming the type, got nothing (the field is missing)");
  j = small_tokenizer();
  j["model"].erase("vocab");
  EXPECT_ERROR(j, "model.vocab: expected an object of token -> id, got nothing (the field is missing)");
  j = small_tokenizer();
  j["model"].erase("merges");
  EXPECT_ERROR(j, "model.merges: expected an array of merges, got nothing (the field is missing)");
  j = small_tokenizer();
  j["model"]["vocab"]["ab"] = "x";
  EXPECT_ERROR(j, R"(model.vocab["ab"]: expected an id in [0, 2^24), got "x")");
  j["model"]["vocab"]["ab"] = int64_t(1) << 40;
  EXPECT_ERROR(j, R"(model.vocab["ab"]: expected an id in [0, 2^24), got 1099511627776)");
  j = small_tokenizer();
  j["model"]["vocab"]["ab"] = 257;
  EXPECT_ERROR(j, "model.vocab: expected distinct ids, got id 257 twice");
  j = small_tokenizer();
  j["model"]["vocab"].erase(spelling_of('\n'));
  EXPECT_ERROR(j, R"(model.vocab: expected a token for every byte (byte-level BPE), got none for byte 0x0A (spelled "Ċ"))");
  j = small_tokenizer();
  j["added_tokens"][0].erase("content");
  EXPECT_ERROR(j, "added_tokens[0].content: expected the token's text, got nothing (the field is missing)");
  j = small_tokenizer();
  j["added_tokens"][0]["id"] = -3;
  EXPECT_ERROR(j, "added_tokens[0].id: expected an id in [0, 2^24), got -3");
  j = small_tokenizer();
  j["added_tokens"].push_back(j["added_tokens"][0]);
  EXPECT_ERROR(j, R"(added_tokens[1].content: expected a text no other added token has, got "<|end|>" a second time)");
}

TEST(HfTokenizerErrors, MergesNamingUnknownTokens) {
  json j = small_tokenizer();
  j["model"]["merges"].push_back("q zz");
  EXPECT_ERROR(j, R"(my/tokenizer.json: model.merges[2]: expected tokens of model.vocab, got "q zz", whose "zz" is not in model.vocab)");
  j = small_tokenizer();
  j["model"]["merges"].push_back(json::array({"b", "c"}));
  EXPECT_ERROR(j, R"(model.merges[2]: expected tokens of model.vocab, got ["b","c"], whose result "bc" is not in model.vocab)");
  j = small_tokenizer();
  j["model"]["merges"].push_back("a b c");
  EXPECT_ERROR(j, R"(model.merges[2]: expected "<left> <right>", got "a b c")");
  j = small_tokenizer();
  j["model"]["merges"].push_back(json::array({"a"}));
  EXPECT_ERROR(j, R"(model.merges[2]: expected "<left> <right>" or ["<left>", "<right>"], got ["a"])");
  j = small_tokenizer();
  j["model"]["merges"].push_back("a b");
  EXPECT_ERROR(j, R"(model.merges[2]: expected each merge once, got "a b" again)");
}

TEST(HfTokenizerErrors, FilesNameThemselves) {
  TempDir tmp;
  try {
    HfTokenizer::load((tmp / "tokenizer.json").string());
    ADD_FAILURE() << "a missing file loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open tokenizer file " + (tmp / "tokenizer.json").string()),
              std::string::npos)
        << e.what();
  }
  test::write_bytes(tmp / "tokenizer.json", small_tokenizer().dump());
  test::write_bytes(tmp / "tokenizer_config.json", R"({"bos_token": {"content": "<|end|>"}, "eos_token": "<|nope|>"})");
  try {
    HfTokenizer::load((tmp / "tokenizer.json").string());
    ADD_FAILURE() << "an unknown eos_token loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: eos_token: expected a token of "), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(R"(got "<|nope|>", which is neither an added token nor in model.vocab)"),
              std::string::npos)
        << e.what();
  }
  test::write_bytes(tmp / "tokenizer_config.json", R"({"bos_token": {"content": "<|end|>"}, "eos_token": "abc"})");
  const HfTokenizer t = HfTokenizer::load((tmp / "tokenizer.json").string());
  EXPECT_EQ(t.bos_id(), 258);
  EXPECT_EQ(t.eos_id(), 257);  // a vocabulary token may serve too
}

}  // namespace
}  // namespace blu
