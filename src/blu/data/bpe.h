// data/bpe: the byte-level BPE core that GPT-2's Tokenizer (data/tokenizer.h) and the Hugging Face
// tokenizer.json tokenizer (data/hf_tokenizer.h) share: the byte alphabet their vocabulary files
// spell tokens in, and the merge loop over one pre-tokenised piece, with a cache of pieces.
// Depends on the standard library.
// Keep: encode_piece gives GPT-2's bpe() result (lowest-rank pair first, every occurrence left to
// right), whatever the piece's bytes; it is safe to call from several threads at once (the cache
// is guarded by a mutex).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace blu {

// GPT-2's bytes_to_unicode: vocabulary files spell each byte as one printable code point.
// Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in order, to U+0100...
char32_t byte_to_code_point(unsigned char byte);
// Turns a spelling (UTF-8 of alphabet code points) back into raw bytes. Returns false, leaving
// `bytes` unspecified, if the spelling holds anything outside the alphabet.
bool spelling_to_bytes(std::string_view spelling, std::string& bytes);

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

class BytePairEncoder {
 public:
  BytePairEncoder();
  BytePairEncoder(BytePairEncoder&&) noexcept;
  BytePairEncoder& operator=(BytePairEncoder&&) noexcept;
  ~BytePairEncoder();

  // Setup: the token of each single byte, then the merges in rank order (first = merged first).
  void set_byte_token(unsigned char byte, int32_t id) { byte_token_[byte] = id; }
  // Returns false if the pair (left, right) already has a merge.
  bool add_merge(int32_t left, int32_t right, int32_t merged);
  size_t merge_count() const { return merges_.size(); }

  // Appends the ids of one piece of raw bytes (cached for pieces up to kMaxCachedPieceBytes).
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  static constexpr size_t kMaxCachedPieceBytes = 256;  // longer pieces rarely repeat

 private:
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;  // uncached

  struct Merge {
    uint32_t rank;   // order of addition: lower merges first
    int32_t merged;  // id of the concatenation
  };
  static uint64_t pair_key(int32_t left, int32_t right) {
    return uint64_t(uint32_t(left)) << 32 | uint32_t(right);
  }

  std::array<int32_t, 256> byte_token_{};
  std::unordered_map<uint64_t, Merge> merges_;  // pair_key(left, right) -> merge
  struct PieceCache;
  std::unique_ptr<PieceCache> cache_;  // piece bytes -> ids
};

}  // namespace blu
