// fuzz/fuzz_util.h: what the libFuzzer targets of fuzz/ share — a private temporary folder, the
// only place a target writes (its parsers read files, so an input goes into a file there first),
// and the rule for what counts as a clean refusal.
// Depends on the standard library and core/error.h.
// Keep: a target writes only under scratch_dir(); a parser refusing an input throws blu::Error,
// so the targets catch that and nothing else — any other exception escapes and libFuzzer reports
// it as a crash (a parser of outside input must say what is wrong, naming the file).
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "blu/core/error.h"

namespace blu::fuzz {

// BASE/blu-fuzz-XXXXXX, made once per process and removed at exit. BASE is $BLU_FUZZ_TMPDIR if
// set, else /dev/shm where it is a writable folder (the targets write every input to a file: in
// memory, shard runs 3.9x and checkpoint 2.1x as many inputs a second as on this machine's disk),
// else $TMPDIR, else /tmp.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const char* forced = std::getenv("BLU_FUZZ_TMPDIR");
    const char* tmp = std::getenv("TMPDIR");
    std::string base = forced && *forced                       ? forced
                       : ::access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm"
                       : tmp && *tmp                            ? tmp
                                                                : "/tmp";
    std::string templ = base + "/blu-fuzz-XXXXXX";
    if (!::mkdtemp(templ.data())) std::abort();
    std::atexit([] { std::error_code ec; std::filesystem::remove_all(scratch_dir(), ec); });
    return std::filesystem::path(templ);
  }();
  return dir;
}

// scratch_dir()/sub, created if missing.
inline std::filesystem::path scratch(const std::string& sub) {
  const std::filesystem::path p = scratch_dir() / sub;
  std::filesystem::create_directories(p);
  return p;
}

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  if (!f) std::abort();  // the scratch folder is ours: a failed write is the harness's fault
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Splits at the first NUL byte: the parts of a two-file input (the second empty when none).
inline std::pair<std::string_view, std::string_view> split_at_nul(std::string_view in) {
  const size_t at = in.find('\0');
  if (at == std::string_view::npos) return {in, {}};
  return {in.substr(0, at), in.substr(at + 1)};
}

}  // namespace blu::fuzz

// Runs `body` on one input; a blu::Error is a clean refusal.
#define BLU_FUZZ_TARGET(...)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {    \
    try {                                                                      \
      __VA_ARGS__                                                              \
    } catch (const blu::Error&) {                                              \
    }                                                                          \
    return 0;                                                                  \
  }
