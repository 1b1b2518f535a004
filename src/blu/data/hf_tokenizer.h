// data/hf_tokenizer: a byte-level BPE tokenizer read from a Hugging Face tokenizer.json, as Llama 3,
// SmolLM, GPT-2 and Qwen-style models ship it. encode(): split out the added tokens written in the
// text (leftmost-longest, those with normalized=false first, as the Rust library does), then
// pre-tokenise each stretch between them (the pre_tokenizer's steps: Split with a known regex,
// Digits, then ByteLevel), then BPE each piece's bytes (data/bpe.h), taking a piece that is itself a
// vocabulary token whole when the model sets ignore_merges.
// The supported subset of tokenizer.json, and the errors for everything outside it, are listed in
// docs/tokenizer.md; every error names the file, the field, what was expected and what was found.
// Depends on the standard library, nlohmann-json, core/error.h, data/bpe.h, data/pretokenize.h.
// Keep: encode gives the ids the Rust `tokenizers` library gives with add_special_tokens=false
// (checked against the npm port @huggingface/tokenizers in tests/data/hf_tokenizer_test.cpp);
// decode(encode(s)) == s for every byte string s unless a ByteLevel step sets add_prefix_space;
// encode is safe to call from several threads at once.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "blu/data/bpe.h"
#include "blu/data/pretokenize.h"
#include "blu/data/text_tokenizer.h"

namespace blu {

class HfTokenizer final : public TextTokenizer {
 public:
  // Reads a tokenizer.json file. bos_id()/eos_id() come from "bos_token"/"eos_token" of a
  // tokenizer_config.json in the same folder when there is one; otherwise bos_id() is the special
  // token that the post_processor's TemplateProcessing puts first, if any, and eos_id() is unset.
  static HfTokenizer load(const std::string& path);
  // The same from tokenizer.json's text; `name` stands for the file in error messages.
  static HfTokenizer from_json(std::string_view json_text, const std::string& name = "tokenizer.json");

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  std::string decode_token(int32_t id) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(token_bytes_.size()); }

  // An added token (added_tokens in tokenizer.json) by its content.
  std::optional<int32_t> special_token_id(std::string_view content) const override;
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  // Sets bos/eos by an added token's content (as tokenizer_config.json names them); throws if
  // there is no such token.
  void set_bos(std::string_view content);
  void set_eos(std::string_view content);

  // The pre-tokenisation pieces of `text` as raw bytes, in order: what BPE sees of the stretches
  // between the added tokens (which are left out).
  std::vector<std::string> pretokenize(std::string_view text) const;

  HfTokenizer(HfTokenizer&&) noexcept;
  HfTokenizer& operator=(HfTokenizer&&) noexcept;
  ~HfTokenizer();

 private:
  HfTokenizer();

  struct Step {  // one pre-tokenizer step
    enum class Kind { split, digits } kind;
    SplitPattern pattern = SplitPattern::gpt2;  // split
    bool individual_digits = false;             // digits
  };
  struct AddedToken {
    std::string content;
    int32_t id;
    bool lstrip, rstrip;
  };
  // Added tokens matched in one pass: by first byte, longest first.
  struct AddedSet {
    std::vector<AddedToken> tokens;
    std::array<std::vector<uint32_t>, 256> by_first_byte;
    void index();
  };

  // Calls text(stretch) / token(id) for the stretches and tokens of `text`, in order.
  template <typename OnText, typename OnToken>
  static void split_added(std::string_view text, const AddedSet& set, OnText&& on_text, OnToken&& on_token);
  // split_added with the normalized=false tokens, then with the normalized=true ones.
  template <typename OnText, typename OnToken>
  void for_each_stretch(std::string_view text, OnText&& on_text, OnToken&& on_token) const;
  template <typename OnPiece>
  void for_each_piece(std::string_view text, OnPiece&& on_piece) const;
  void encode_stretch(std::string_view text, std::vector<int32_t>& out) const;

  std::vector<Step> steps_;          // then ByteLevel, always last
  bool byte_level_regex_ = true;     // ByteLevel's use_regex: GPT-2's pattern (Unicode \s)
  bool add_prefix_space_ = false;    // ByteLevel's add_prefix_space
  bool ignore_merges_ = false;
  std::vector<std::string> token_bytes_;  // id -> bytes; empty for ids no token has
  std::vector<uint8_t> assigned_;         // id -> has a token
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_by_bytes_;  // model.vocab
  AddedSet raw_added_, normalized_added_;  // normalized=false / true
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> added_by_content_;
  BytePairEncoder bpe_;
  std::optional<int32_t> bos_, eos_;
};

}  // namespace blu
