// Fuzz target: the byte tokenizer (data/byte_tokenizer) on the input as text and as ids, and the
// tokenizer record a shard folder carries (data/text_tokenizer's shards_tokenizer) holding it.
#include "blu/data/byte_tokenizer.h"
#include "blu/data/text_tokenizer.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const std::string_view text = blu::fuzz::as_text(data, size);
  const blu::ByteTokenizer t;
  const std::vector<int32_t> ids = t.encode(text);
  if (t.decode(ids) != text) std::abort();  // the round trip of data/byte_tokenizer.h's Keep
  std::vector<int32_t> raw(size / 4);
  if (!raw.empty()) std::memcpy(raw.data(), data, raw.size() * 4);
  try {
    (void)t.decode(raw);
  } catch (const blu::Error&) {
  }
  const auto dir = blu::fuzz::scratch("record");
  blu::fuzz::write_bytes(dir / blu::kShardsRecord, text);
  (void)blu::shards_tokenizer(dir.string());
})
