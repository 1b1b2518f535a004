#include "blu/data/bpe.h"

#include <limits>
#include <mutex>

namespace blu {
namespace {

struct ByteAlphabet {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // code point -> byte, -1 if not in the alphabet
  ByteAlphabet() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_cp[b] = printable ? char32_t(b) : next++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

}  // namespace

char32_t byte_to_code_point(unsigned char byte) { return byte_alphabet().to_cp[byte]; }

bool spelling_to_bytes(std::string_view spelling, std::string& bytes) {
  const auto& alphabet = byte_alphabet();
  bytes.clear();
  for (size_t i = 0; i < spelling.size();) {
    const auto b0 = static_cast<unsigned char>(spelling[i]);
    char32_t cp;
    if (b0 < 0x80) {
      cp = b0, i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < spelling.size() &&
               (static_cast<unsigned char>(spelling[i + 1]) & 0xC0) == 0x80) {  // the alphabet ends at U+0143
      cp = char32_t(b0 & 0x1F) << 6 | (static_cast<unsigned char>(spelling[i + 1]) & 0x3F), i += 2;
    } else {
      return false;
    }
    if (cp >= alphabet.to_byte.size() || alphabet.to_byte[cp] < 0) return false;
    bytes.push_back(static_cast<char>(alphabet.to_byte[cp]));
  }
  return true;
}

struct BytePairEncoder::PieceCache {
  // Pieces repeat a lot in natural text ("the", " of", ...), so most of BPE's work is a lookup.
  // The cache is cleared when it grows past kMaxEntries to bound memory on unbounded input.
  static constexpr size_t kMaxEntries = size_t(1) << 20;
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};

BytePairEncoder::BytePairEncoder() : cache_(std::make_unique<PieceCache>()) { byte_token_.fill(-1); }
BytePairEncoder::BytePairEncoder(BytePairEncoder&&) noexcept = default;
BytePairEncoder& BytePairEncoder::operator=(BytePairEncoder&&) noexcept = default;
BytePairEncoder::~BytePairEncoder() = default;

bool BytePairEncoder::add_merge(int32_t left, int32_t right, int32_t merged) {
  const auto rank = static_cast<uint32_t>(merges_.size());
  return merges_.emplace(pair_key(left, right), Merge{rank, merged}).second;
}

// GPT-2's bpe(): repeatedly take the adjacent pair of lowest rank and merge every occurrence of it,
// left to right without overlap, until no adjacent pair has a rank. ranks[k] caches the rank of
// (word[k], word[k+1]) so that a round recomputes only the pairs next to a merge.
void BytePairEncoder::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  auto rank_of = [&](int32_t l, int32_t r) {
    auto it = merges_.find(pair_key(l, r));
    return it == merges_.end() ? kNone : it->second.rank;
  };
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) word[i] = byte_token_[static_cast<unsigned char>(piece[i])];
  std::vector<uint32_t> ranks(word.size() > 1 ? word.size() - 1 : 0);
  for (size_t k = 0; k + 1 < word.size(); ++k) ranks[k] = rank_of(word[k], word[k + 1]);

  std::vector<int32_t> new_word;
  std::vector<uint32_t> new_ranks;
  std::vector<uint8_t> merged;  // new_word[w] is a fresh merge
  std::vector<size_t> origin;   // new_word[w] came from word[origin[w]]
  while (word.size() > 1) {
    size_t best = 0;
    for (size_t k = 1; k < ranks.size(); ++k)
      if (ranks[k] < ranks[best]) best = k;
    if (ranks[best] == kNone) break;
    const int32_t left = word[best], right = word[best + 1];
    const int32_t fused = merges_.at(pair_key(left, right)).merged;

    new_word.clear(), merged.clear(), origin.clear();
    for (size_t i = 0; i < word.size();) {
      origin.push_back(i);
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        new_word.push_back(fused), merged.push_back(1), i += 2;
      } else {
        new_word.push_back(word[i]), merged.push_back(0), i += 1;
      }
    }
    new_ranks.assign(new_word.size() - 1, kNone);
    for (size_t w = 0; w + 1 < new_word.size(); ++w)
      new_ranks[w] = (merged[w] || merged[w + 1]) ? rank_of(new_word[w], new_word[w + 1]) : ranks[origin[w]];
    word.swap(new_word);
    ranks.swap(new_ranks);
  }
  out.insert(out.end(), word.begin(), word.end());
}

void BytePairEncoder::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() > kMaxCachedPieceBytes) {
    bpe(piece, out);
    return;
  }
  {
    std::lock_guard lock(cache_->mutex);
    if (auto it = cache_->map.find(piece); it != cache_->map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  bpe(piece, out);
  std::vector<int32_t> ids(out.begin() + start, out.end());
  std::lock_guard lock(cache_->mutex);
  if (cache_->map.size() >= PieceCache::kMaxEntries) cache_->map.clear();
  cache_->map.emplace(std::string(piece), std::move(ids));
}

}  // namespace blu
