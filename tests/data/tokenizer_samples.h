// Text samples shared by the tokenizer tests (tokenizer_test.cpp for GPT-2's files,
// hf_tokenizer_test.cpp for tokenizer.json): hand-written hostile text, random UTF-8 and random
// punctuation from fixed seeds, and helpers to show and build text.
#pragma once
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace blu::test {

// Text with visible escapes, for failure messages.
inline std::string escaped(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else out += char(c);
  }
  return out;
}

inline std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | cp >> 6), s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | cp >> 12), s += char(0x80 | (cp >> 6 & 0x3F)), s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | cp >> 18), s += char(0x80 | (cp >> 12 & 0x3F)), s += char(0x80 | (cp >> 6 & 0x3F)),
        s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// Hand-written samples covering each branch of the pre-tokenisation pattern.
inline std::vector<std::string> fixed_samples() {
  return {
      "Hello world",
      "Hello, world! How's it going? I'm fine; they're here, we've been, you'll see, he'd go. It's 'quoted'.",
      "DON'T SHOUT'S 'S 'T ''s '''re ?'ll x'd",
      "   leading spaces, trailing spaces   ",
      "tabs\tand\t\ttabs\n\nnew lines\r\n\r\nwindows\n \n  \n\tmixed \t \n",
      "a  b   c    d\n\n\ne",
      " ",
      "\n",
      "    ",
      "x ",
      "1234567890 3.14159 -42 1e10 0x1F 1,000,000 ½ ¾ ² ³ Ⅻ ① ٣٤٥ ४२",
      "!!! ??? ... --- *** ### $$$ %%% ^^^ &&& (()) [[]] {{}} <<>> ||| ~~~ `` \\\\ //",
      "x\",\"y [\"a\",\"b\"] {\"k\":[1,2,3]},\"",
      "naïve café résumé Ångström Ćevapčići Łódź straße ÉCOLE",
      "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
      "中文文本，没有空格。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
      "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ 🚀",
      "combining e\xCC\x81 a\xCC\x8A n\xCC\x83 and ZWJ\xE2\x80\x8D and ZWSP\xE2\x80\x8B",
      "nbsp\xC2\xA0here ideographic\xE3\x80\x80space bom\xEF\xBB\xBFx line\xE2\x80\xA8sep nel\xC2\x85x fs\x1C"
      "gs\x1Drs\x1Eus\x1F em\xE2\x80\x83space",
      "math 𝐀𝐁𝐂 𝟎𝟏𝟐 Linear B 𐀀𐀁 CJK-B 𠀀𠀁",
      "before<|endoftext|>after",
      "<|endoftext|>",
      "<|endoftext|><|endoftext|> twice",
      "almost <|endoftext| and <|endoftext> and endoftext",
      "code: for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // comment\n\treturn x->y;",
      "URL https://example.com/path?q=1&r=two#frag email a.b@c.de",
  };
}

// Random strings over a small ASCII alphabet heavy in quotes, commas and brackets: the merges of
// JSON-like punctuation are where a BPE keyed on joined strings (as Encoder.js keys its ranks) could
// go wrong.
inline std::vector<std::string> punctuation_samples(uint32_t seed, int count) {
  static const std::string alphabet = "\",,,'[]{}():;. .\"ab1\n";
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (int s = 0; s < count; ++s) {
    std::string text(1 + rng() % 40, ' ');
    for (auto& c : text) c = alphabet[rng() % alphabet.size()];
    out.push_back(text);
  }
  return out;
}

// Random valid UTF-8 strings from a fixed seed, drawn from blocks whose letter/number/other
// classification is the same in Unicode 14 (our tables) and in the newer Unicode node may use.
inline std::vector<std::string> random_samples(uint32_t seed, int count) {
  struct Block {
    char32_t lo, hi;
    int weight;
  };
  static const Block blocks[] = {
      {0x20, 0x7E, 40},       {0x09, 0x0D, 4},       {0xA0, 0x24F, 6},      {0x300, 0x36F, 2},
      {0x370, 0x4FF, 4},      {0x590, 0x6FF, 3},     {0x900, 0x97F, 2},     {0xE00, 0xE7F, 2},
      {0x2000, 0x206F, 3},    {0x2070, 0x218F, 2},   {0x2190, 0x257F, 2},   {0x2460, 0x24FF, 2},
      {0x3000, 0x30FF, 3},    {0x4E00, 0x9FFF, 6},   {0xAC00, 0xD7A3, 3},   {0xFF00, 0xFFEF, 2},
      {0x10000, 0x1007F, 1},  {0x1D400, 0x1D7FF, 1}, {0x1F300, 0x1F64F, 3}, {0x1F900, 0x1F9FF, 1},
      {0x20000, 0x2A6DF, 1},  {' ', ' ', 15},        {'\'', '\'', 4},       {'0', '9', 6},
      {',', ',', 3},          {'"', '"', 3},         {0x85, 0x85, 1},       {0xFEFF, 0xFEFF, 1},
  };
  int total = 0;
  for (const auto& b : blocks) total += b.weight;
  std::mt19937 rng(seed);  // mt19937's sequence is fixed by the standard; distributions are not
  auto below = [&](uint32_t n) { return uint32_t(rng() % n); };
  std::vector<std::string> out;
  for (int s = 0; s < count; ++s) {
    std::string text;
    const uint32_t len = 1 + below(80);
    for (uint32_t i = 0; i < len; ++i) {
      int pick = int(below(uint32_t(total)));
      const Block* b = blocks;
      while (pick >= b->weight) pick -= b->weight, ++b;
      const char32_t cp = b->lo + below(uint32_t(b->hi - b->lo + 1));
      text += utf8(cp);
    }
    out.push_back(text);
  }
  return out;
}

}  // namespace blu::test
