#include "blu/data/pretokenize.h"

#include <cstdint>

#include "blu/data/unicode_tables.h"

namespace blu {
namespace {

enum class CharClass : uint8_t { space, letter, number, other };

// One code point (or one stray byte of invalid UTF-8) starting at some byte offset.
struct Unit {
  char32_t cp;  // kInvalid for a byte that does not start a well-formed sequence
  uint32_t len;
  CharClass cls;
};

constexpr char32_t kInvalid = 0xFFFFFFFF;

// JavaScript's \s: WhiteSpace and LineTerminator of ECMA-262 (ECMAScript, not Python: U+FEFF is in,
// U+0085 and U+001C..U+001F are out).
bool is_js_space(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000: case 0xFEFF:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

// The Unicode White_Space property (PropList.txt, unchanged since Unicode 6.3): Oniguruma's \s.
bool is_unicode_space(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

CharClass classify(char32_t cp, Whitespace ws) {
  if (cp == kInvalid) return CharClass::other;
  if (cp < 0x80) {  // fast path for ASCII, where both whitespace sets agree
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::space;
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::letter;
    if (cp >= '0' && cp <= '9') return CharClass::number;
    return CharClass::other;
  }
  if (ws == Whitespace::javascript ? is_js_space(cp) : is_unicode_space(cp)) return CharClass::space;
  if (unicode::is_letter(cp)) return CharClass::letter;
  if (unicode::is_number(cp)) return CharClass::number;
  return CharClass::other;
}

bool is_cont(unsigned char b) { return (b & 0xC0) == 0x80; }

// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF), as TextDecoder accepts it.
Unit decode_at(std::string_view s, size_t pos, Whitespace ws) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  const size_t left = s.size() - pos;
  const unsigned char b0 = p[0];
  char32_t cp = kInvalid;
  uint32_t len = 1;
  if (b0 < 0x80) {
    cp = b0;
  } else if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (left >= 2 && is_cont(p[1])) cp = char32_t(b0 & 0x1F) << 6 | (p[1] & 0x3F), len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    const unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
    if (left >= 3 && p[1] >= lo && p[1] <= hi && is_cont(p[2]))
      cp = char32_t(b0 & 0x0F) << 12 | char32_t(p[1] & 0x3F) << 6 | (p[2] & 0x3F), len = 3;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    const unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (left >= 4 && p[1] >= lo && p[1] <= hi && is_cont(p[2]) && is_cont(p[3]))
      cp = char32_t(b0 & 0x07) << 18 | char32_t(p[1] & 0x3F) << 12 | char32_t(p[2] & 0x3F) << 6 | (p[3] & 0x3F),
      len = 4;
  }
  if (cp == kInvalid) len = 1;
  return {cp, len, classify(cp, ws)};
}

// End of the run of units of class `cls` starting at pos.
size_t run_end(std::string_view s, size_t pos, CharClass cls, Whitespace ws) {
  while (pos < s.size()) {
    const Unit u = decode_at(s, pos, ws);
    if (u.cls != cls) break;
    pos += u.len;
  }
  return pos;
}

// Length in bytes of the contraction ('s 't 're 've 'm 'll 'd) starting at pos, or 0. With
// ignore_case, letters match as Oniguruma's (?i:...) matches them: ASCII either case, and U+017F
// (LATIN SMALL LETTER LONG S, whose case folding is 's') for s.
size_t contraction_at(std::string_view s, size_t pos, bool ignore_case) {
  if (s[pos] != '\'' || pos + 1 >= s.size()) return 0;
  auto fold = [&](char c) { return ignore_case && c >= 'A' && c <= 'Z' ? char(c + ('a' - 'A')) : c; };
  const char c1 = fold(s[pos + 1]);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (ignore_case && s.substr(pos + 1, 2) == "\xC5\xBF") return 3;  // U+017F
  if (pos + 2 >= s.size()) return 0;
  const char c2 = fold(s[pos + 2]);
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// The whitespace run [pos, end) and its shape, for the \s alternatives at the end of each pattern.
struct SpaceRun {
  size_t end = 0;        // one past the run
  size_t last = 0;       // start of the run's last character
  size_t count = 0;      // characters in the run
  size_t after_crlf = 0; // one past the run's last \r or \n; 0 if it has none
};

SpaceRun space_run(std::string_view s, size_t pos, Whitespace ws) {
  SpaceRun r;
  r.end = r.last = pos;
  while (r.end < s.size()) {
    const Unit u = decode_at(s, r.end, ws);
    if (u.cls != CharClass::space) break;
    r.last = r.end;
    r.end += u.len;
    ++r.count;
    if (u.cp == '\r' || u.cp == '\n') r.after_crlf = r.end;
  }
  return r;
}

// '\s+(?!\S)|\s+': the whitespace run, less its last character when a non-space follows and that
// leaves at least one; otherwise the whole run.
size_t trailing_space_match(std::string_view s, size_t pos, const SpaceRun& r) {
  if (r.end < s.size() && r.count >= 2) return r.last - pos;
  return r.end - pos;
}

// GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t gpt2_match_at(std::string_view s, size_t pos, Whitespace ws) {
  if (size_t n = contraction_at(s, pos, /*ignore_case=*/false)) return n;

  // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space, then a run of one class.
  const Unit first = decode_at(s, pos, ws);
  size_t run_start = pos;
  CharClass cls = first.cls;
  if (first.cp == ' ' && pos + 1 < s.size()) {
    const Unit next = decode_at(s, pos + 1, ws);
    if (next.cls != CharClass::space) run_start = pos + 1, cls = next.cls;
  }
  if (cls != CharClass::space) return run_end(s, run_start, cls, ws) - pos;
  return trailing_space_match(s, pos, space_run(s, pos, ws));
}

// Llama 3 (max_digits 3) and Qwen2 (max_digits 1):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// The alternatives are tried in order and the first that matches wins, as in the regex.
size_t llama3_match_at(std::string_view s, size_t pos, Whitespace ws, int max_digits) {
  if (size_t n = contraction_at(s, pos, /*ignore_case=*/true)) return n;

  const Unit first = decode_at(s, pos, ws);
  // '[^\r\n\p{L}\p{N}]?\p{L}+': letters, after at most one character that is none of \r, \n,
  // letter or number (a space, a tab, a quote...).
  if (first.cls == CharClass::letter) return run_end(s, pos, CharClass::letter, ws) - pos;
  const bool crlf = first.cp == '\r' || first.cp == '\n';
  if (first.cls != CharClass::number && !crlf && pos + first.len < s.size() &&
      decode_at(s, pos + first.len, ws).cls == CharClass::letter)
    return run_end(s, pos + first.len, CharClass::letter, ws) - pos;

  // '\p{N}{1,3}' (or '\p{N}').
  if (first.cls == CharClass::number) {
    size_t end = pos;
    for (int k = 0; k < max_digits && end < s.size(); ++k) {
      const Unit u = decode_at(s, end, ws);
      if (u.cls != CharClass::number) break;
      end += u.len;
    }
    return end - pos;
  }

  // ' ?[^\s\p{L}\p{N}]+[\r\n]*': symbols after an optional space, then any \r and \n.
  size_t sym = pos;
  if (first.cp == ' ' && pos + 1 < s.size() && decode_at(s, pos + 1, ws).cls == CharClass::other) sym = pos + 1;
  if (decode_at(s, sym, ws).cls == CharClass::other) {
    size_t end = run_end(s, sym, CharClass::other, ws);
    while (end < s.size() && (s[end] == '\r' || s[end] == '\n')) ++end;
    return end - pos;
  }

  // first is whitespace. '\s*[\r\n]+': \s* backs off from the whole run to its last \r or \n, which
  // [\r\n]+ then takes (no \r or \n follows it inside the run).
  const SpaceRun r = space_run(s, pos, ws);
  if (r.after_crlf) return r.after_crlf - pos;
  return trailing_space_match(s, pos, r);
}

size_t match_at(std::string_view s, size_t pos, SplitPattern pattern, Whitespace ws) {
  switch (pattern) {
    case SplitPattern::gpt2: return gpt2_match_at(s, pos, ws);
    case SplitPattern::llama3: return llama3_match_at(s, pos, ws, 3);
    case SplitPattern::qwen2: return llama3_match_at(s, pos, ws, 1);
  }
  return 1;
}

constexpr std::string_view kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

void regex_pretokenize(std::string_view text, SplitPattern pattern, Whitespace ws,
                       std::vector<std::string_view>& out) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = match_at(text, pos, pattern, ws);
    out.push_back(text.substr(pos, n));
    pos += n;
  }
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  pieces.reserve(text.size() / 4 + 1);
  regex_pretokenize(text, SplitPattern::gpt2, Whitespace::javascript, pieces);
  return pieces;
}

void split_digits(std::string_view text, bool individual, std::vector<std::string_view>& out) {
  size_t start = 0, pos = 0;  // [start, pos): the piece being grown
  bool in_number = false;
  while (pos < text.size()) {
    const Unit u = decode_at(text, pos, Whitespace::unicode);
    const bool number = u.cls == CharClass::number;
    if (pos > start && (number != in_number || (number && individual))) {
      out.push_back(text.substr(start, pos - start));
      start = pos;
    }
    in_number = number;
    pos += u.len;
  }
  if (pos > start) out.push_back(text.substr(start, pos - start));
}

size_t leading_whitespace(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const Unit u = decode_at(text, pos, Whitespace::unicode);
    if (u.cls != CharClass::space) break;
    pos += u.len;
  }
  return pos;
}

size_t trailing_whitespace_start(std::string_view text) {
  size_t start = 0;  // start of the current whitespace run, or of the next candidate one
  for (size_t pos = 0; pos < text.size();) {
    const Unit u = decode_at(text, pos, Whitespace::unicode);
    pos += u.len;
    if (u.cls != CharClass::space) start = pos;
  }
  return start;
}

std::optional<SplitPattern> split_pattern_from_regex(std::string_view regex) {
  for (SplitPattern p : {SplitPattern::gpt2, SplitPattern::llama3, SplitPattern::qwen2})
    if (regex == split_pattern_regex(p)) return p;
  return std::nullopt;
}

std::string_view split_pattern_regex(SplitPattern pattern) {
  switch (pattern) {
    case SplitPattern::gpt2: return kGpt2Regex;
    case SplitPattern::llama3: return kLlama3Regex;
    case SplitPattern::qwen2: return kQwen2Regex;
  }
  return {};
}

}  // namespace blu
