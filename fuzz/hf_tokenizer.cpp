// Fuzz target: a Hugging Face tokenizer.json (data/hf_tokenizer) — the supported subset and the
// errors for everything else — then encode/decode of a fixed text with what loaded.
#include "blu/data/hf_tokenizer.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const blu::HfTokenizer t = blu::HfTokenizer::from_json(blu::fuzz::as_text(data, size), "<fuzz>");
  const std::vector<int32_t> ids = t.encode("Hello world 123 <|endoftext|> \xc3\xa9t\xc3\xa9  \n\tx");
  for (int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) std::abort();
  (void)t.decode(ids);
  (void)t.pretokenize("it's 2024!");
})
