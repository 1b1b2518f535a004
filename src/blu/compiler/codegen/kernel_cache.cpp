// compiler/codegen/kernel_cache: see kernel_cache.h.
#include "blu/compiler/codegen/kernel_cache.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "blu/core/error.h"
#include "blu/io/json_file.h"

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

// Two independent 64-bit hashes as 32 hex digits: 128 bits, so distinct inputs do not meet in
// practice.
std::string hash128(const std::string& s) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", (unsigned long long)fnv1a(s),
                (unsigned long long)fnv1a(s, 0x9e3779b97f4a7c15ull));
  return buf;
}

// Ranks compiling the same kernel write the same entry at once: each through a temporary of its own.
void write_atomic(const fs::path& p, const std::string& bytes) { io::write_file_atomic(p, bytes, /*shared=*/true); }

// What <key>.sum holds: the artefact's byte count and hash.
std::string artefact_sum(const std::string& bytes) { return std::to_string(bytes.size()) + " " + hash128(bytes) + "\n"; }

}  // namespace

std::string kernel_cache_dir() {
  if (const char* d = std::getenv("BLU_KERNEL_CACHE"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/blutrain/kernels";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/tmp") + "/.cache/blutrain/kernels";
}

std::string kernel_cache_key(const std::string& region_text, const std::string& target, const std::string& toolchain) {
  // A meeting of two regions' hashes is caught by the stored text.
  return hash128(region_text + "\n#target " + target + "\n#toolchain " + toolchain);
}

std::optional<CacheEntry> kernel_cache_find(const std::string& key, const std::string& ext,
                                            const std::string& region_text) {
  const fs::path dir = kernel_cache_dir();
  const fs::path art = dir / (key + "." + ext);
  if (!fs::exists(art)) return std::nullopt;
  auto text = read_file(dir / (key + ".txt"));
  if (!text || *text != region_text) return std::nullopt;
  auto bytes = read_file(art);
  if (!bytes) return std::nullopt;
  // An entry with no sum file (an earlier version wrote it) is taken unchecked.
  if (const auto sum = read_file(dir / (key + ".sum")); sum && artefact_sum(*bytes) != *sum) {
    std::fprintf(stderr, "blu: kernel cache: %s does not match %s.sum (damaged on disk?): made again\n", art.c_str(),
                 key.c_str());
    return std::nullopt;
  }
  return CacheEntry{art.string(), std::move(*bytes)};
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
