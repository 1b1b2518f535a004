// data/prepare: turns text files into token shards (what `blutrain prepare` runs), in the manner of
// llm.c's FineWeb script: every document is encoded and preceded by the end-of-text token, the token
// stream is cut into shards of at most shard_tokens, and part of it is set aside for validation.
//   Inputs: files and folders (folders are walked recursively, files taken in sorted path order).
//   Skipped: *.dat files (strfile indexes), files holding a NUL byte, and second paths to a file
//   already taken (Debian's fortunes ship `name.u8 -> name` links).
//   Documents: a whole file, or, for fortune files, each entry between lines holding only '%'.
//   Output: <out>/<name>_val_000000.bin ..., <out>/<name>_train_000000.bin ...
// Depends on data/shard and data/permute; the tokenizer comes in as a callback.
// Keep: the output is a pure function of (inputs, options, encode); a failed run leaves no shard
// behind (shards are staged in a hidden folder and renamed into place only when all are written);
// existing shards with the same prefix are never replaced unless `overwrite`.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace blu {

using EncodeFn = std::function<std::vector<int32_t>(std::string_view)>;

enum class DocSplit {
  auto_detect,  // fortune entries for fortune files (see is_fortune_file), else whole files
  whole_file,   // every file is one document
  fortune,      // every file is split at lines holding only '%'
};

struct PrepareOptions {
  std::string name = "data";              // shard file prefix
  int64_t shard_tokens = 100'000'000;     // llm.c's FineWeb shard size
  double val_fraction = 0.0;              // 0: the first shard is validation (llm.c); in (0, 1): this
                                          // fraction of the documents, picked by `seed`
  uint64_t seed = 0;
  bool overwrite = false;                 // replace (and remove stale) shards with the same prefix
  DocSplit split = DocSplit::auto_detect;
};

struct PrepareStats {
  int64_t documents = 0, tokens = 0, shards = 0;
  int64_t val_documents = 0, val_tokens = 0, val_shards = 0;
  int64_t train_documents = 0, train_tokens = 0, train_shards = 0;
  std::vector<std::filesystem::path> files;          // files read, in order
  std::vector<std::filesystem::path> skipped;        // files passed over (binary, duplicate links)
  std::vector<std::filesystem::path> shard_paths;    // shards written (val first, then train)
};

// A file in a folder named `fortunes` (at any depth) or with a strfile index `<file>.dat` beside it.
bool is_fortune_file(const std::filesystem::path& path);

// The documents of a fortune file: the entries between lines holding only '%' (a trailing '\r' is
// allowed), each with its own line ends; entries of only whitespace are dropped.
std::vector<std::string> split_fortunes(std::string_view text);

PrepareStats prepare(const std::vector<std::filesystem::path>& inputs, const std::filesystem::path& out_dir,
                     const EncodeFn& encode, int32_t eot, const PrepareOptions& options = {});

}  // namespace blu
