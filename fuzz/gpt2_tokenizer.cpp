// Fuzz target: GPT-2's vocabulary files (data/tokenizer): the input up to its first NUL byte is
// encoder.json, the rest vocab.bpe; what loads encodes and decodes a fixed text.
#include "blu/data/tokenizer.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const auto dir = blu::fuzz::scratch("gpt2");
  const auto [encoder, merges] = blu::fuzz::split_at_nul(blu::fuzz::as_text(data, size));
  blu::fuzz::write_bytes(dir / "encoder.json", encoder);
  blu::fuzz::write_bytes(dir / "vocab.bpe", merges);
  const blu::Tokenizer t = blu::Tokenizer::load(dir.string());
  const std::vector<int32_t> ids = t.encode("Hello world <|endoftext|> it's 123");
  for (int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) std::abort();
  (void)t.decode(ids);
})
