// data/shard: token shards in llm.c's layout, so shards prepared for llm.c (FineWeb, TinyStories, ...)
// load unchanged and ours load in llm.c.
//   bytes [0, 1024):  256 little-endian int32: [0] magic 20240520, [1] version 1, [2] token count N,
//                     the rest zero
//   bytes [1024, 1024 + 2N):  N little-endian uint16 token ids
// Depends on core/error and POSIX (open, mmap, fsync, rename). Keep: write_shard never leaves a
// partial file under the final name (temporary file, fsync, rename); ShardReader never hands out
// tokens from a file whose header and size disagree.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>

namespace blu {

// The layout is little-endian and the reader maps the file straight into memory.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;
inline constexpr int64_t kShardMaxTokens = INT32_MAX;  // the count is an int32 in the header

// Reads and validates only the header and the file size (cheap: no mapping). Returns N.
int64_t read_shard_token_count(const std::filesystem::path& path);

// Writes a shard atomically: a temporary file beside `path`, fsync, then rename (and fsync of the
// folder). Refuses to replace an existing file unless `overwrite`.
void write_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens, bool overwrite = false);

// A read-only memory map of one shard, validated on open: the file holds a full header, the magic
// and version are llm.c's, the file size is exactly header + 2N bytes, and, when vocab_size > 0,
// every token id is below vocab_size. Move-only.
class ShardReader {
 public:
  explicit ShardReader(const std::filesystem::path& path, int64_t vocab_size = 0);
  ~ShardReader();
  ShardReader(ShardReader&& other) noexcept;
  ShardReader& operator=(ShardReader&& other) noexcept;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return num_tokens_; }
  std::span<const uint16_t> tokens() const { return {tokens_, static_cast<size_t>(num_tokens_)}; }
  uint16_t operator[](int64_t i) const { return tokens_[i]; }

 private:
  void release() noexcept;

  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t num_tokens_ = 0;
};

}  // namespace blu
