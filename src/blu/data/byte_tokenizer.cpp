#include "blu/data/byte_tokenizer.h"

#include "blu/core/error.h"

namespace blu {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t hit = text.find(kEndOfText, pos);
    const size_t stop = hit == std::string_view::npos ? text.size() : hit;
    for (size_t i = pos; i < stop; ++i) ids.push_back(static_cast<unsigned char>(text[i]));
    if (hit == std::string_view::npos) break;
    ids.push_back(kEot);
    pos = hit + kEndOfText.size();
  }
  return ids;
}

std::string ByteTokenizer::decode_token(int32_t id) const {
  BLU_CHECK(id >= 0 && id <= kEot, "byte tokenizer: expected an id in [0, 257), got ", id);
  return id == kEot ? std::string(kEndOfText) : std::string(1, static_cast<char>(id));
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (const int32_t id : ids) {
    BLU_CHECK(id >= 0 && id <= kEot, "byte tokenizer: expected ids in [0, 257), got ", id);
    if (id == kEot)
      out += kEndOfText;
    else
      out += static_cast<char>(id);
  }
  return out;
}

}  // namespace blu
