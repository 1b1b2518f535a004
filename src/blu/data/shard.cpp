#include "blu/data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "blu/core/error.h"

namespace blu {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Owns a file descriptor for the duration of one function.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Checks the header and the file size against each other. `header` holds the first 256 ints.
int64_t validate_header(const std::filesystem::path& path, const int32_t* header, int64_t file_bytes) {
  BLU_CHECK(header[0] == kShardMagic, "shard '", path.string(), "': bad magic number: expected ", kShardMagic,
            ", got ", header[0], " (not a token shard in llm.c's layout)");
  BLU_CHECK(header[1] == kShardVersion, "shard '", path.string(), "': unsupported version: expected ",
            kShardVersion, " (uint16 tokens), got ", header[1]);
  const int64_t n = header[2];
  BLU_CHECK(n >= 0, "shard '", path.string(), "': negative token count ", n, " in the header");
  const int64_t expected = kShardHeaderBytes + 2 * n;
  BLU_CHECK(file_bytes >= expected, "shard '", path.string(), "': truncated: the header says ", n,
            " tokens, so expected ", expected, " bytes, got ", file_bytes, " (", expected - file_bytes,
            " bytes missing)");
  BLU_CHECK(file_bytes <= expected, "shard '", path.string(), "': trailing bytes: the header says ", n,
            " tokens, so expected ", expected, " bytes, got ", file_bytes, " (", file_bytes - expected,
            " bytes too many)");
  return n;
}

// Opens `path` and reads its header; returns the file size through `file_bytes`.
void open_and_read_header(const std::filesystem::path& path, Fd& fd, std::array<int32_t, kShardHeaderInts>& header,
                          int64_t& file_bytes) {
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BLU_CHECK(fd.fd >= 0, "shard '", path.string(), "': cannot open: ", errno_text());
  struct stat st {};
  BLU_CHECK(::fstat(fd.fd, &st) == 0, "shard '", path.string(), "': cannot stat: ", errno_text());
  BLU_CHECK(S_ISREG(st.st_mode), "shard '", path.string(), "': not a regular file");
  file_bytes = st.st_size;
  BLU_CHECK(file_bytes >= kShardHeaderBytes, "shard '", path.string(), "': file is ", file_bytes,
            " bytes, shorter than the ", kShardHeaderBytes, "-byte header");
  ssize_t got = ::pread(fd.fd, header.data(), kShardHeaderBytes, 0);
  BLU_CHECK(got == kShardHeaderBytes, "shard '", path.string(), "': cannot read the header: ",
            got < 0 ? errno_text() : std::string("short read"));
}

void write_all(int fd, const void* data, size_t bytes, const std::filesystem::path& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    BLU_CHECK(n > 0, "write_shard: cannot write '", path.string(), "': ", errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // durability of the rename is best effort; the data itself is already synced
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

int64_t read_shard_token_count(const std::filesystem::path& path) {
  Fd fd;
  std::array<int32_t, kShardHeaderInts> header{};
  int64_t file_bytes = 0;
  open_and_read_header(path, fd, header, file_bytes);
  return validate_header(path, header.data(), file_bytes);
}

void write_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens, bool overwrite) {
  BLU_CHECK(static_cast<int64_t>(tokens.size()) <= kShardMaxTokens, "write_shard: '", path.string(), "': ",
            tokens.size(), " tokens do not fit one shard (at most ", kShardMaxTokens, ")");
  BLU_CHECK(overwrite || !std::filesystem::exists(path), "write_shard: '", path.string(),
            "' already exists; pass overwrite=true to replace it");

  std::array<int32_t, kShardHeaderInts> header{};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());

  // The temporary sits in the same folder so that the rename is atomic.
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path dir = path.parent_path();
  const std::filesystem::path tmp =
      dir / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()) + "." +
             std::to_string(counter.fetch_add(1)));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  BLU_CHECK(fd >= 0, "write_shard: cannot create '", tmp.string(), "': ", errno_text());
  try {
    write_all(fd, header.data(), kShardHeaderBytes, tmp);
    write_all(fd, tokens.data(), tokens.size_bytes(), tmp);
    BLU_CHECK(::fsync(fd) == 0, "write_shard: fsync of '", tmp.string(), "' failed: ", errno_text());
    int rc = ::close(fd);
    fd = -1;
    BLU_CHECK(rc == 0, "write_shard: close of '", tmp.string(), "' failed: ", errno_text());
    if (overwrite) {
      BLU_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "write_shard: cannot rename '", tmp.string(), "' to '",
                path.string(), "': ", errno_text());
    } else {
      // link() fails if the target exists, so a file that appeared meanwhile is never replaced.
      if (::link(tmp.c_str(), path.c_str()) != 0) {
        BLU_CHECK(errno != EEXIST, "write_shard: '", path.string(),
                  "' already exists; pass overwrite=true to replace it");
        // No hard links on this file system: fall back to check-then-rename.
        BLU_CHECK(!std::filesystem::exists(path), "write_shard: '", path.string(),
                  "' already exists; pass overwrite=true to replace it");
        BLU_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "write_shard: cannot rename '", tmp.string(),
                  "' to '", path.string(), "': ", errno_text());
      } else {
        ::unlink(tmp.c_str());
      }
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir);
}

ShardReader::ShardReader(const std::filesystem::path& path, int64_t vocab_size) : path_(path) {
  Fd fd;
  std::array<int32_t, kShardHeaderInts> header{};
  int64_t file_bytes = 0;
  open_and_read_header(path, fd, header, file_bytes);
  num_tokens_ = validate_header(path, header.data(), file_bytes);

  map_bytes_ = static_cast<size_t>(file_bytes);
  void* m = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  BLU_CHECK(m != MAP_FAILED, "shard '", path.string(), "': cannot map ", map_bytes_, " bytes: ", errno_text());
  map_ = m;
  tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map_) + kShardHeaderBytes);
  // The mapping keeps the file alive; the descriptor closes when `fd` goes out of scope.

  if (vocab_size > 0) {
    for (int64_t i = 0; i < num_tokens_; ++i) {
      if (tokens_[i] >= vocab_size) [[unlikely]] {
        const int64_t id = tokens_[i];
        release();
        BLU_CHECK(false, "shard '", path.string(), "': token at position ", i, " is ", id,
                  ", not below vocab_size ", vocab_size);
      }
    }
  }
}

ShardReader::~ShardReader() { release(); }

void ShardReader::release() noexcept {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  num_tokens_ = 0;
}

ShardReader::ShardReader(ShardReader&& other) noexcept
    : path_(std::move(other.path_)),
      map_(other.map_),
      map_bytes_(other.map_bytes_),
      tokens_(other.tokens_),
      num_tokens_(other.num_tokens_) {
  other.map_ = nullptr;
  other.map_bytes_ = 0;
  other.tokens_ = nullptr;
  other.num_tokens_ = 0;
}

ShardReader& ShardReader::operator=(ShardReader&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = other.map_;
    map_bytes_ = other.map_bytes_;
    tokens_ = other.tokens_;
    num_tokens_ = other.num_tokens_;
    other.map_ = nullptr;
    other.map_bytes_ = 0;
    other.tokens_ = nullptr;
    other.num_tokens_ = 0;
  }
  return *this;
}

}  // namespace blu
