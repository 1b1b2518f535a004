// data/pretokenize: GPT-2's pre-tokenisation, the split of text into pieces that BPE then encodes
// one by one. It is the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// written out by hand (std::regex has no \p classes), with the semantics of the JavaScript
// reference (npm gpt-3-encoder, flag /u): \s is JavaScript's whitespace set, \p{L} and \p{N} come
// from the generated tables in unicode_tables.cpp.
// Depends on the standard library and data/unicode_tables.h.
// Keep: the pieces are views into the input, in order, non-empty, and cover it exactly. Invalid
// UTF-8 never throws: each byte that does not start a well-formed sequence is a one-byte symbol
// (neither whitespace, letter nor number).
#pragma once
#include <string_view>
#include <vector>

namespace blu {

std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace blu
