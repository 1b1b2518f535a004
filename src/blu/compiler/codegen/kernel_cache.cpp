// compiler/codegen/kernel_cache: see kernel_cache.h.
#include "blu/compiler/codegen/kernel_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "blu/core/error.h"

namespace blu::compiler {
namespace fs = std::filesystem;

namespace {

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::optional<std::string> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) return std::nullopt;
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// Written to a temporary of this process's own (ranks compiling the same kernel write the same
// entry at once), flushed to the disk, then renamed over `p`.
void write_atomic(const fs::path& p, const std::string& bytes) {
  const fs::path tmp = p.string() + ".tmp" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  BLU_CHECK(fd >= 0, "kernel cache: cannot create ", tmp.string(), ": ", std::strerror(errno));
  size_t done = 0;
  int err = 0;
  while (done < bytes.size() && !err) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) err = n < 0 ? errno : EIO;
    else done += size_t(n);
  }
  if (!err && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && !err) err = errno;
  if (!err && ::rename(tmp.c_str(), p.c_str()) != 0) err = errno;
  if (err) {
    ::unlink(tmp.c_str());
    BLU_CHECK(false, "kernel cache: cannot write ", p.string(), ": ", std::strerror(err));
  }
}

// What <key>.sum holds: the artefact's byte count and two 64-bit hashes of its bytes.
std::string artefact_sum(const std::string& bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%zu %016llx%016llx\n", bytes.size(), (unsigned long long)fnv1a(bytes),
                (unsigned long long)fnv1a(bytes, 0x9e3779b97f4a7c15ull));
  return buf;
}

}  // namespace

std::string kernel_cache_dir() {
  if (const char* d = std::getenv("BLU_KERNEL_CACHE"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/blutrain/kernels";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/tmp") + "/.cache/blutrain/kernels";
}

std::string kernel_cache_key(const std::string& region_text, const std::string& target, const std::string& toolchain) {
  // Two independent 64-bit hashes: 128 bits, so distinct regions do not meet in practice (and a
  // meeting is caught by the stored text).
  const std::string all = region_text + "\n#target " + target + "\n#toolchain " + toolchain;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)fnv1a(all),
                (unsigned long long)fnv1a(all, 0x9e3779b97f4a7c15ull));
  return buf;
}

std::optional<std::string> kernel_cache_find(const std::string& key, const std::string& ext,
                                             const std::string& region_text) {
  const fs::path dir = kernel_cache_dir();
  const fs::path art = dir / (key + "." + ext);
  if (!fs::exists(art)) return std::nullopt;
  auto text = read_file(dir / (key + ".txt"));
  if (!text || *text != region_text) return std::nullopt;
  // An entry with no sum file (an earlier version wrote it) is taken unchecked.
  if (const auto sum = read_file(dir / (key + ".sum"))) {
    const auto bytes = read_file(art);
    if (!bytes || artefact_sum(*bytes) != *sum) {
      std::fprintf(stderr, "blu: kernel cache: %s does not match %s.sum (damaged on disk?): made again\n",
                   art.c_str(), key.c_str());
      return std::nullopt;
    }
  }
  return art.string();
}

std::string kernel_cache_store(const std::string& key, const std::string& ext, const std::string& bytes,
                               const std::string& region_text) {
  const fs::path dir = kernel_cache_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  BLU_CHECK(!ec, "kernel cache: cannot create ", dir.string(), ": ", ec.message());
  const fs::path art = dir / (key + "." + ext);
  write_atomic(art, bytes);
  write_atomic(dir / (key + ".sum"), artefact_sum(bytes));
  write_atomic(dir / (key + ".txt"), region_text);  // last: the entry counts once its text is there
  return art.string();
}

}  // namespace blu::compiler
