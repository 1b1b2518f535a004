// `blutrain prepare`: text files and folders → token shards (bytes, GPT-2's tokenizer or a tokenizer.json)
// (data/prepare.h does the work), and the tokenizer's record beside them (<out>/shards.json).
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/error.h"
#include "blu/data/prepare.h"
#include "blu/data/text_tokenizer.h"
#include "blu/data/tokenizer.h"
#include "blu/train/metrics.h"
#include "commands.h"

namespace blu::cli {

namespace {

struct PrepareArgs {
  std::vector<std::string> inputs;
  std::string out, name = "data", vocab_dir, split = "auto";
  double val_fraction = 0.0;
  int64_t shard_tokens = 100'000'000;
  uint64_t seed = 0;
  bool overwrite = false;
};

// Shards of another prefix in `out` that were written with another tokenizer than `spec` would be
// read together by train (<dir>/*_train_*.bin) under one record: refused.
void refuse_mixed_tokenizers(const std::string& out, const std::string& name, const std::string& spec) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(out, ec)) return;
  const std::string old = shards_tokenizer(out);
  const std::string now = (spec == "byte" || spec == "gpt2") ? spec : "";
  if (!now.empty() && old == now) return;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string f = e.path().filename().string();
    const bool shard = f.ends_with(".bin") && (f.find("_train_") != std::string::npos || f.find("_val_") != std::string::npos);
    if (!shard || f.starts_with(name + "_")) continue;
    BLU_CHECK(false, "prepare: --out ", out, " holds shards of another prefix ('", f, "') written with tokenizer ", old,
              "; --tokenizer ", spec, " would mix two tokenizers in one folder: choose another --out");
  }
}

int run_prepare(const PrepareArgs& a) {
  // byte, GPT-2's files (.deps, the default), or a tokenizer.json / Hugging Face model folder.
  const std::string vocab_dir = a.vocab_dir.empty() ? "gpt2" : a.vocab_dir;
  refuse_mixed_tokenizers(a.out, a.name, vocab_dir);
  const std::unique_ptr<TextTokenizer> tok = load_tokenizer(vocab_dir);
  // Token shards hold uint16 ids (llm.c's format).
  BLU_CHECK(tok->vocab_size() <= 65536, "--tokenizer ", vocab_dir, ": ", tok->vocab_size(),
            " ids do not fit the token shards' uint16 (at most 65536; Llama 3's 128256 need another shard format)");
  // Documents are separated by the beginning-of-text token, else the end-of-text one (GPT-2's
  // <|endoftext|> is both).
  const std::optional<int32_t> sep = tok->bos_id() ? tok->bos_id() : tok->eos_id();
  BLU_CHECK(sep.has_value(), "--tokenizer ", vocab_dir,
            ": the tokenizer names neither a beginning- nor an end-of-text token to separate documents with "
            "(add a tokenizer_config.json with bos_token or eos_token)");
  PrepareOptions o;
  o.name = a.name;
  o.shard_tokens = a.shard_tokens;
  o.val_fraction = a.val_fraction;
  o.seed = a.seed;
  o.overwrite = a.overwrite;
  o.split = a.split == "fortune" ? DocSplit::fortune : a.split == "file" ? DocSplit::whole_file : DocSplit::auto_detect;
  std::vector<std::filesystem::path> inputs(a.inputs.begin(), a.inputs.end());
  const EncodeFn encode = [&tok](std::string_view text) { return tok->encode(text); };
  const PrepareStats s = prepare(inputs, a.out, encode, *sep, o);
  record_shards_tokenizer(a.out, vocab_dir, *tok, *sep);
  std::cout << "read " << s.files.size() << " file(s)";
  if (!s.skipped.empty()) std::cout << " (skipped " << s.skipped.size() << ": binary or duplicate links)";
  std::cout << "\n"
            << "documents: " << train::format_count(s.documents) << " (val " << train::format_count(s.val_documents)
            << ", train " << train::format_count(s.train_documents) << ")\n"
            << "tokens:    " << train::format_count(s.tokens) << " (val " << train::format_count(s.val_tokens)
            << ", train " << train::format_count(s.train_tokens) << ")\n"
            << "shards:    " << s.shards << " (val " << s.val_shards << ", train " << s.train_shards << ") in " << a.out
            << "\n"
            << "tokenizer: " << vocab_dir << " (" << tok->vocab_size() << " ids), recorded in "
            << (std::filesystem::path(a.out) / kShardsRecord).string() << "\n";
  for (const auto& p : s.shard_paths) std::cout << "  " << p.string() << "\n";
  return 0;
}

}  // namespace

Command add_prepare(CLI::App& root) {
  auto a = std::make_shared<PrepareArgs>();
  CLI::App* app = root.add_subcommand("prepare", "Tokenize text files/folders into token shards");
  app->add_option("-i,--input", a->inputs, "Text file or folder (repeatable; folders are walked)")->required();
  app->add_option("-o,--out", a->out, "Output folder for the shards")->required();
  app->add_option("--name", a->name, "Shard file prefix: <out>/<name>_{val,train}_NNNNNN.bin")->capture_default_str();
  app->add_option("--val-fraction", a->val_fraction,
                  "Fraction of documents set aside for validation; 0 = the first shard is validation (llm.c)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app->add_option("--shard-tokens", a->shard_tokens, "Tokens per shard at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--seed", a->seed, "Seed for picking validation documents")->capture_default_str();
  app->add_option("--split", a->split, "Documents: auto (fortune entries for fortune files), file, fortune")
      ->check(CLI::IsMember({"auto", "file", "fortune"}))
      ->capture_default_str();
  app->add_option("--tokenizer,--vocab-dir", a->vocab_dir,
                  "byte (256 bytes + <|endoftext|>), gpt2 (GPT-2's, in .deps: the default), a tokenizer.json, a "
                  "Hugging Face model folder holding one, or a folder with GPT-2's encoder.json and vocab.bpe; "
                  "recorded in <out>/shards.json for train, eval and sample");
  app->add_flag("--overwrite", a->overwrite, "Replace existing shards with the same prefix");
  return {app, [a] { return run_prepare(*a); }};
}

}  // namespace blu::cli
