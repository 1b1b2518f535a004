#include "blu/data/text_tokenizer.h"

#include <filesystem>

#include "blu/core/error.h"
#include "blu/data/byte_tokenizer.h"
#include "blu/data/hf_tokenizer.h"
#include "blu/data/tokenizer.h"
#include "blu/io/json_file.h"

namespace blu {

namespace fs = std::filesystem;

std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (spec == "gpt2") return std::make_unique<Tokenizer>(Tokenizer::load(default_vocab_dir()));
  const std::string& path = spec;
  const fs::path p(path);
  if (fs::is_regular_file(p)) return std::make_unique<HfTokenizer>(HfTokenizer::load(path));
  BLU_CHECK(fs::is_directory(p), "tokenizer: expected byte, gpt2, a tokenizer.json file or a folder holding one (or ",
            "GPT-2's encoder.json and vocab.bpe), got '", path, "', which does not exist");
  if (fs::exists(p / "tokenizer.json")) return std::make_unique<HfTokenizer>(HfTokenizer::load((p / "tokenizer.json").string()));
  if (fs::exists(p / "encoder.json") || fs::exists(p / "vocab.bpe"))
    return std::make_unique<Tokenizer>(Tokenizer::load(path));
  BLU_CHECK(false, "tokenizer: expected tokenizer.json (a Hugging Face model folder) or encoder.json and vocab.bpe ",
            "(GPT-2) in '", path, "', found neither");
  return nullptr;
}

void record_shards_tokenizer(const std::string& shard_dir, const std::string& spec, const TextTokenizer& tok,
                             int32_t separator) {
  const fs::path dir(shard_dir);
  std::string recorded = spec;
  if (spec != "byte" && spec != "gpt2") {
    const fs::path src(spec);
    const fs::path file = fs::is_regular_file(src) ? src : src / "tokenizer.json";
    if (fs::is_regular_file(file)) {  // a Hugging Face tokenizer: copy it in
      const fs::path copy_dir = dir / "tokenizer";
      fs::create_directories(copy_dir);
      fs::copy_file(file, copy_dir / "tokenizer.json", fs::copy_options::overwrite_existing);
      const fs::path config = file.parent_path() / "tokenizer_config.json";
      if (fs::is_regular_file(config))
        fs::copy_file(config, copy_dir / "tokenizer_config.json", fs::copy_options::overwrite_existing);
      else
        fs::remove(copy_dir / "tokenizer_config.json");
      recorded = "tokenizer/tokenizer.json";
    } else {  // GPT-2's encoder.json and vocab.bpe in another folder: recorded by path
      recorded = fs::absolute(src).lexically_normal().string();
    }
  }
  io::write_json_file(dir / kShardsRecord,
                      {{"tokenizer", recorded}, {"vocab_size", tok.vocab_size()}, {"separator", separator}});
}

std::string shards_tokenizer(const std::string& shard_dir) {
  const fs::path record = fs::path(shard_dir) / kShardsRecord;
  if (!fs::exists(record)) return "gpt2";
  const nlohmann::json j = io::read_json_file(record);
  BLU_CHECK(j.is_object() && j.contains("tokenizer") && j["tokenizer"].is_string(), record.string(),
            ": expected an object with a \"tokenizer\" string (byte, gpt2 or a path), got ", j.dump());
  const std::string t = j["tokenizer"].get<std::string>();
  if (t == "byte" || t == "gpt2") return t;
  const fs::path p(t);
  return (p.is_absolute() ? p : fs::path(shard_dir) / p).string();
}

std::string shard_dir_of_pattern(const std::string& pattern) {
  const fs::path parent = fs::path(pattern).parent_path();
  return parent.empty() ? "." : parent.string();
}

}  // namespace blu
