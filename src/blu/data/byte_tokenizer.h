// data/byte_tokenizer: the byte-level tokenizer: id b (0..255) is the byte b, id 256 is
// <|endoftext|>, the documents' separator. No merges, no files: every corpus encodes, and a
// small model learns spelling, words and line shape from the bytes themselves (the demo preset,
// docs/tokenizer.md).
// It implements TextTokenizer (data/text_tokenizer.h); `load_tokenizer("byte")` makes one.
// Depends on the standard library and core/error.h.
// Keep: decode(encode(s)) == s for every byte string s (invalid UTF-8 and NUL bytes included);
// encode is one id per byte except where the text spells "<|endoftext|>", which becomes 256.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blu/data/text_tokenizer.h"

namespace blu {

class ByteTokenizer final : public TextTokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";
  static constexpr int32_t kEot = 256;

  std::vector<int32_t> encode(std::string_view text) const override;
  // Ids outside [0, 257) throw naming the id.
  std::string decode(std::span<const int32_t> ids) const override;
  std::string decode_token(int32_t id) const override;
  int32_t vocab_size() const override { return 257; }

  std::optional<int32_t> special_token_id(std::string_view content) const override {
    return content == kEndOfText ? std::optional<int32_t>(kEot) : std::nullopt;
  }
  // <|endoftext|> is both, as in GPT-2.
  std::optional<int32_t> bos_id() const override { return kEot; }
  std::optional<int32_t> eos_id() const override { return kEot; }
};

}  // namespace blu
