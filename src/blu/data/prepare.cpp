#include "blu/data/prepare.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "blu/core/error.h"
#include "blu/data/permute.h"
#include "blu/data/shard.h"

namespace blu {
namespace fs = std::filesystem;

bool is_fortune_file(const fs::path& path) {
  for (const auto& part : path.parent_path())
    if (part == "fortunes") return true;
  fs::path index = path;
  index += ".dat";
  std::error_code ec;
  return fs::is_regular_file(index, ec);
}

std::vector<std::string> split_fortunes(std::string_view text) {
  std::vector<std::string> docs;
  std::string cur;
  auto finish = [&] {
    if (cur.find_first_not_of(" \t\r\n\f\v") != std::string::npos) docs.push_back(cur);
    cur.clear();
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const size_t stop = end == std::string_view::npos ? text.size() : end + 1;
    std::string_view line = text.substr(pos, stop - pos);
    std::string_view body = line;
    if (!body.empty() && body.back() == '\n') body.remove_suffix(1);
    if (!body.empty() && body.back() == '\r') body.remove_suffix(1);
    if (body == "%")
      finish();
    else
      cur.append(line);
    pos = stop;
  }
  finish();
  return docs;
}

namespace {

std::string read_file(const fs::path& path) {
  if (path.extension() == ".gz") {  // gzip-compressed text, read whole
    gzFile gz = gzopen(path.c_str(), "rb");
    BLU_CHECK(gz != nullptr, "prepare: cannot open '", path.string(), "'");
    std::string s;
    char buf[1 << 16];
    int n = 0;
    while ((n = gzread(gz, buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
    int err = Z_OK;
    const std::string why = n < 0 ? gzerror(gz, &err) : "";
    gzclose(gz);
    BLU_CHECK(n == 0, "prepare: '", path.string(), "' is not readable gzip data (", why, ")");
    return s;
  }
  std::ifstream in(path, std::ios::binary);
  BLU_CHECK(in, "prepare: cannot open '", path.string(), "'");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  BLU_CHECK(!in.bad(), "prepare: cannot read '", path.string(), "'");
  return s;
}

bool is_blank(std::string_view s) { return s.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos; }

std::string shard_name(const std::string& name, const char* split, int64_t index) {
  char num[16];
  std::snprintf(num, sizeof num, "%06lld", static_cast<long long>(index));
  return name + "_" + split + "_" + num + ".bin";
}

// True for "<name>_val_NNNNNN.bin" and "<name>_train_NNNNNN.bin" (six or more digits).
bool is_shard_of(const std::string& file, const std::string& name) {
  for (const char* split : {"_val_", "_train_"}) {
    const std::string prefix = name + split;
    if (file.size() < prefix.size() + 6 + 4 || file.compare(0, prefix.size(), prefix) != 0) continue;
    if (file.compare(file.size() - 4, 4, ".bin") != 0) continue;
    const std::string digits = file.substr(prefix.size(), file.size() - prefix.size() - 4);
    if (std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return true;
  }
  return false;
}

std::vector<fs::path> existing_shards(const fs::path& dir, const std::string& name) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const auto& e : fs::directory_iterator(dir))
    if (is_shard_of(e.path().filename().string(), name)) found.push_back(e.path());
  std::sort(found.begin(), found.end());
  return found;
}

struct SourceFile {
  fs::path path;
  bool fortune = false;
  int64_t documents = 0;
};

std::vector<std::string> documents_of(const SourceFile& f, const std::string& text) {
  if (f.fortune) return split_fortunes(text);
  if (is_blank(text)) return {};
  return {text};
}

// Removes the staging folder unless the run got to the end.
struct StagingDir {
  fs::path path;
  ~StagingDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

}  // namespace

PrepareStats prepare(const std::vector<fs::path>& inputs, const fs::path& out_dir, const EncodeFn& encode,
                     int32_t eot, const PrepareOptions& opt) {
  BLU_CHECK(!inputs.empty(), "prepare: no input files or folders given");
  BLU_CHECK(encode, "prepare: no encode function given");
  BLU_CHECK(eot >= 0 && eot <= 0xFFFF, "prepare: the end-of-text token must fit uint16, got ", eot);
  BLU_CHECK(opt.shard_tokens >= 1 && opt.shard_tokens <= kShardMaxTokens, "prepare: --shard-tokens must be in [1, ",
            kShardMaxTokens, "], got ", opt.shard_tokens);
  BLU_CHECK(opt.val_fraction >= 0.0 && opt.val_fraction < 1.0, "prepare: --val-fraction must be in [0, 1), got ",
            opt.val_fraction);
  BLU_CHECK(!opt.name.empty() && opt.name.find('/') == std::string::npos,
            "prepare: the shard name must be a non-empty file name prefix, got '", opt.name, "'");

  PrepareStats stats;

  // 1. The files, in order, without binaries and second paths to the same file.
  std::vector<SourceFile> sources;
  std::set<fs::path> seen;
  auto consider = [&](const fs::path& p) {
    if (p.extension() == ".dat") {
      stats.skipped.push_back(p);
      return;
    }
    if (!seen.insert(fs::canonical(p)).second) {
      stats.skipped.push_back(p);
      return;
    }
    SourceFile f;
    f.path = p;
    f.fortune = opt.split == DocSplit::fortune || (opt.split == DocSplit::auto_detect && is_fortune_file(p));
    sources.push_back(f);
  };
  for (const auto& in : inputs) {
    BLU_CHECK(fs::exists(in), "prepare: input '", in.string(), "' does not exist");
    if (fs::is_directory(in)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::recursive_directory_iterator(in))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) consider(f);
    } else {
      BLU_CHECK(fs::is_regular_file(in), "prepare: input '", in.string(), "' is neither a file nor a folder");
      consider(in);
    }
  }

  // 2. Count documents (and drop files with NUL bytes) so that the validation split can be drawn.
  int64_t total_docs = 0;
  {
    std::vector<SourceFile> text_sources;
    for (auto& f : sources) {
      const std::string text = read_file(f.path);
      if (text.find('\0') != std::string::npos) {
        stats.skipped.push_back(f.path);
        continue;
      }
      f.documents = static_cast<int64_t>(documents_of(f, text).size());
      total_docs += f.documents;
      text_sources.push_back(f);
    }
    sources = std::move(text_sources);
  }
  BLU_CHECK(total_docs > 0, "prepare: the inputs hold no text documents (", stats.skipped.size(),
            " files skipped as binary or duplicate)");

  std::vector<bool> is_val;
  if (opt.val_fraction > 0) {
    BLU_CHECK(total_docs >= 2, "prepare: --val-fraction needs at least two documents, found ", total_docs);
    auto k = static_cast<int64_t>(opt.val_fraction * static_cast<double>(total_docs) + 0.5);
    k = std::clamp<int64_t>(k, 1, total_docs - 1);
    const std::vector<int64_t> perm = seeded_permutation(total_docs, mix_seed(opt.seed, 0x56414cull /* "VAL" */));
    is_val.assign(static_cast<size_t>(total_docs), false);
    for (int64_t i = 0; i < k; ++i) is_val[perm[i]] = true;
  }

  // 3. Refuse to mix with existing shards of this name.
  const std::vector<fs::path> old_shards = existing_shards(out_dir, opt.name);
  BLU_CHECK(opt.overwrite || old_shards.empty(), "prepare: '", out_dir.string(), "' already holds ",
            old_shards.size(), " shards named ", opt.name, "_*.bin (e.g. '", old_shards.empty() ? "" :
            old_shards.front().filename().string(), "'); pass --overwrite to replace them");
  fs::create_directories(out_dir);
  StagingDir staging{out_dir / ("." + opt.name + ".prepare." + std::to_string(::getpid()) + ".tmp")};
  fs::remove_all(staging.path);
  fs::create_directory(staging.path);

  // 4. Encode and cut into shards. Streams: 0 = val, 1 = train. Without val_fraction one buffer
  //    feeds both: its first shard is named val, the rest train.
  struct Stream {
    const char* split;
    std::vector<uint16_t> buf;
    int64_t shards = 0, documents = 0, tokens = 0;
  };
  Stream streams[2] = {{"val", {}}, {"train", {}}};
  std::vector<std::string> staged;  // file names, in writing order
  const bool first_shard_val = opt.val_fraction == 0;
  auto flush = [&](Stream& s) {
    if (s.buf.empty()) return;
    Stream& named = first_shard_val ? (streams[0].shards == 0 ? streams[0] : streams[1]) : s;
    const std::string file = shard_name(opt.name, named.split, named.shards);
    write_shard(staging.path / file, s.buf);
    staged.push_back(file);
    named.tokens += static_cast<int64_t>(s.buf.size());
    named.shards += 1;
    s.buf.clear();
  };
  auto push = [&](Stream& s, uint16_t t) {
    s.buf.push_back(t);
    if (static_cast<int64_t>(s.buf.size()) == opt.shard_tokens) flush(s);
  };
  for (Stream& s : streams) s.buf.reserve(static_cast<size_t>(std::min<int64_t>(opt.shard_tokens, 1 << 24)));

  int64_t doc_index = 0;
  std::vector<int64_t> doc_starts;  // where each document starts in the first, unflushed buffer
  for (const auto& f : sources) {
    const std::string text = read_file(f.path);
    const std::vector<std::string> docs = documents_of(f, text);
    BLU_CHECK(static_cast<int64_t>(docs.size()) == f.documents, "prepare: '", f.path.string(),
              "' changed while it was being read");
    stats.files.push_back(f.path);
    for (size_t d = 0; d < docs.size(); ++d, ++doc_index) {
      Stream& s = first_shard_val ? streams[0] : streams[is_val[doc_index] ? 0 : 1];
      // Which split the document is counted in: where its end-of-text token lands.
      Stream& counted = first_shard_val ? (streams[0].shards == 0 ? streams[0] : streams[1]) : s;
      counted.documents += 1;
      if (first_shard_val && streams[0].shards == 0) doc_starts.push_back(static_cast<int64_t>(streams[0].buf.size()));
      push(s, static_cast<uint16_t>(eot));
      const std::vector<int32_t> ids = encode(docs[d]);
      for (size_t i = 0; i < ids.size(); ++i) {
        BLU_CHECK(ids[i] >= 0 && ids[i] <= 0xFFFF, "prepare: '", f.path.string(), "', document ", d,
                  ": the encoder returned token id ", ids[i], " at position ", i, ", which does not fit uint16");
        push(s, static_cast<uint16_t>(ids[i]));
      }
    }
  }
  if (first_shard_val && streams[0].shards == 0) {
    // Everything fits in the first shard, which would leave nothing to train on: a small corpus is
    // split instead — its first documents, about a tenth of the tokens, for validation (cut inside
    // a document only when the first one after that tenth starts past the middle).
    std::vector<uint16_t>& buf = streams[0].buf;
    const auto n = static_cast<int64_t>(buf.size());
    BLU_CHECK(n >= 2, "prepare: ", n, " token(s) cannot be split into validation and training data");
    const int64_t tenth = std::max<int64_t>(1, n / 10);
    const auto next = std::lower_bound(doc_starts.begin(), doc_starts.end(), tenth);
    const int64_t cut = next != doc_starts.end() && *next <= n / 2 ? *next : tenth;
    const auto val_docs = static_cast<int64_t>(std::lower_bound(doc_starts.begin(), doc_starts.end(), cut) -
                                               doc_starts.begin());
    streams[1].buf.assign(buf.begin() + cut, buf.end());
    buf.resize(static_cast<size_t>(cut));
    streams[1].documents = streams[0].documents - val_docs;  // a document cut in two counts in validation
    streams[0].documents = val_docs;
  }
  for (Stream& s : streams) flush(s);

  // 5. Move the shards into place, then (with overwrite) remove old ones that were not replaced.
  std::set<std::string> fresh(staged.begin(), staged.end());
  if (!opt.overwrite)
    for (const auto& file : staged)
      BLU_CHECK(!fs::exists(out_dir / file), "prepare: '", (out_dir / file).string(),
                "' appeared while preparing; pass --overwrite to replace it");
  // Val shards first, then train, each in index order (the order of `staged` within each split).
  std::vector<std::string> ordered;
  for (const char* split : {"_val_", "_train_"})
    for (const auto& file : staged)
      if (file.find(split) == opt.name.size()) ordered.push_back(file);
  for (const auto& file : ordered) {
    fs::rename(staging.path / file, out_dir / file);
    stats.shard_paths.push_back(out_dir / file);
  }
  for (const auto& old : old_shards)
    if (!fresh.count(old.filename().string())) fs::remove(old);

  stats.val_documents = streams[0].documents;
  stats.val_tokens = streams[0].tokens;
  stats.val_shards = streams[0].shards;
  stats.train_documents = streams[1].documents;
  stats.train_tokens = streams[1].tokens;
  stats.train_shards = streams[1].shards;
  stats.documents = doc_index;
  stats.tokens = stats.val_tokens + stats.train_tokens;
  stats.shards = stats.val_shards + stats.train_shards;
  return stats;
}

}  // namespace blu
