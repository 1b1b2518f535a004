// io/checksum: the checksums of checkpoint files — xxHash's XXH3 64-bit hash (Debian's
// libxxhash-dev), written as "xxh3-64:<16 lowercase hex digits>".
// Depends on xxHash, core/error. Keep: the same bytes give the same string on every machine (XXH3
// is defined on bytes, independent of endianness); a read error is an error naming the file, never
// a checksum of what was read so far.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace blu::io {

// Incremental XXH3-64 over byte pieces, from seed 0.
class Checksum {
 public:
  Checksum();
  ~Checksum();
  Checksum(const Checksum&) = delete;
  Checksum& operator=(const Checksum&) = delete;
  void update(std::span<const std::byte> bytes);
  void update(std::string_view text);
  std::string hex() const;  // "xxh3-64:…" of everything given so far

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct FileDigest {
  uint64_t bytes = 0;
  std::string checksum;  // Checksum::hex() of the whole file
};
// Size and checksum of a whole file; BLU_CHECK naming the file when it cannot be read.
FileDigest digest_file(const std::filesystem::path& path);

}  // namespace blu::io
