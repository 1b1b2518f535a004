#include "blu/data/text_tokenizer.h"

#include <filesystem>

#include "blu/core/error.h"
#include "blu/data/hf_tokenizer.h"
#include "blu/data/tokenizer.h"

namespace blu {

std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (fs::is_regular_file(p)) return std::make_unique<HfTokenizer>(HfTokenizer::load(path));
  BLU_CHECK(fs::is_directory(p), "tokenizer: expected a tokenizer.json file or a folder holding one (or GPT-2's ",
            "encoder.json and vocab.bpe), got '", path, "', which does not exist");
  if (fs::exists(p / "tokenizer.json")) return std::make_unique<HfTokenizer>(HfTokenizer::load((p / "tokenizer.json").string()));
  if (fs::exists(p / "encoder.json") || fs::exists(p / "vocab.bpe"))
    return std::make_unique<Tokenizer>(Tokenizer::load(path));
  BLU_CHECK(false, "tokenizer: expected tokenizer.json (a Hugging Face model folder) or encoder.json and vocab.bpe ",
            "(GPT-2) in '", path, "', found neither");
  return nullptr;
}

}  // namespace blu
