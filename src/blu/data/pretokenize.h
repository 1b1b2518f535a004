// data/pretokenize: pre-tokenisation, the split of text into pieces that BPE then encodes one by
// one. Each supported pattern is a regex written out by hand as a matcher (std::regex has no \p
// classes): \p{L} and \p{N} come from the generated tables in unicode_tables.cpp, \s is one of two
// whitespace sets (see Whitespace). The patterns, recognised by their exact regex string:
//   gpt2    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   llama3  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   qwen2   llama3's with \p{N} in place of \p{N}{1,3}
// plus Hugging Face's Digits pre-tokenizer (each number character, or each run of them, apart).
// Depends on the standard library and data/unicode_tables.h.
// Keep: the pieces are views into the input, in order, non-empty, and cover it exactly. Invalid
// UTF-8 never throws: each byte that does not start a well-formed sequence is a one-byte symbol
// (neither whitespace, letter nor number).
#pragma once
#include <optional>
#include <string_view>
#include <vector>

namespace blu {

enum class SplitPattern { gpt2, llama3, qwen2 };

// What \s means. javascript: ECMAScript's WhiteSpace and LineTerminator (U+FEFF in, U+0085 out), as
// in the npm gpt-3-encoder that GPT-2's Tokenizer follows. unicode: the Unicode White_Space
// property (U+0085 in, U+FEFF out), which is Oniguruma's \s and so Hugging Face tokenizers' \s.
enum class Whitespace { javascript, unicode };

// GPT-2's pattern with JavaScript's \s: the split of blu::Tokenizer (data/tokenizer.h).
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// The pieces of `pattern` (every regex match; the patterns leave no gaps) appended to `out`.
void regex_pretokenize(std::string_view text, SplitPattern pattern, Whitespace ws,
                       std::vector<std::string_view>& out);

// Hugging Face's Digits pre-tokenizer, appended to `out`: every number character (\p{N}) is a
// piece of its own when `individual`, else every run of them is; the text between stays whole.
void split_digits(std::string_view text, bool individual, std::vector<std::string_view>& out);

// The byte length of the run of Unicode White_Space that starts `text`, and the offset where the
// run that ends `text` starts (text.size() if it ends in none): the strip of added tokens' lstrip
// and rstrip.
size_t leading_whitespace(std::string_view text);
size_t trailing_whitespace_start(std::string_view text);

// The pattern whose regex is exactly `regex` (as tokenizer.json spells it), if any.
std::optional<SplitPattern> split_pattern_from_regex(std::string_view regex);
std::string_view split_pattern_regex(SplitPattern pattern);

}  // namespace blu
