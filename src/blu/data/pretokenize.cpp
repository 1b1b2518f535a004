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

CharClass classify(char32_t cp) {
  if (cp == kInvalid) return CharClass::other;
  if (cp < 0x80) {  // fast path for ASCII
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::space;
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return CharClass::letter;
    if (cp >= '0' && cp <= '9') return CharClass::number;
    return CharClass::other;
  }
  if (is_js_space(cp)) return CharClass::space;
  if (unicode::is_letter(cp)) return CharClass::letter;
  if (unicode::is_number(cp)) return CharClass::number;
  return CharClass::other;
}

bool is_cont(unsigned char b) { return (b & 0xC0) == 0x80; }

// Strict UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF), as TextDecoder accepts it.
Unit decode_at(std::string_view s, size_t pos) {
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
  return {cp, len, classify(cp)};
}

// Length in bytes of the contraction ('s 't 're 've 'm 'll 'd) starting at pos, or 0.
size_t contraction_at(std::string_view s, size_t pos) {
  if (s[pos] != '\'' || pos + 1 >= s.size()) return 0;
  const char c1 = s[pos + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (pos + 2 >= s.size()) return 0;
  const char c2 = s[pos + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// Byte length of the regex match starting at pos (pos < s.size()); always > 0.
size_t match_at(std::string_view s, size_t pos) {
  if (size_t n = contraction_at(s, pos)) return n;

  // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space, then a run of one class.
  const Unit first = decode_at(s, pos);
  size_t run_start = pos;
  CharClass cls = first.cls;
  if (first.cp == ' ' && pos + 1 < s.size()) {
    const Unit next = decode_at(s, pos + 1);
    if (next.cls != CharClass::space) run_start = pos + 1, cls = next.cls;
  }
  if (cls != CharClass::space) {
    size_t end = run_start;
    while (end < s.size()) {
      const Unit u = decode_at(s, end);
      if (u.cls != cls) break;
      end += u.len;
    }
    return end - pos;
  }

  // '\s+(?!\S)': the whitespace run, less its last character when a non-space follows and that
  // leaves at least one; otherwise '\s+': the whole run.
  size_t end = pos, last = pos, count = 0;
  while (end < s.size()) {
    const Unit u = decode_at(s, end);
    if (u.cls != CharClass::space) break;
    last = end;
    end += u.len;
    ++count;
  }
  if (end < s.size() && count >= 2) return last - pos;
  return end - pos;
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  pieces.reserve(text.size() / 4 + 1);
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = match_at(text, pos);
    pieces.push_back(text.substr(pos, n));
    pos += n;
  }
  return pieces;
}

}  // namespace blu
