#include "blu/backend/gemm_tune_table.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "blu/core/error.h"

namespace blu {

namespace {

constexpr std::string_view kHeader = "# blutrain gemm tuning v1";

bool parse_hex(std::string_view s, uint64_t& out) {
  if (s.size() != 16) return false;
  out = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    out = out << 4 | uint64_t(d);
  }
  return true;
}

}  // namespace

GemmTuneTable parse_gemm_tune_table(std::string_view text, const std::string& where,
                                    std::vector<std::string>* warnings) {
  GemmTuneTable table;
  auto warn = [&](size_t line, const std::string& what) {
    if (warnings) warnings->push_back(where + ":" + std::to_string(line) + ": " + what + "; line skipped");
  };
  size_t line_no = 0, at = 0;
  while (at < text.size()) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const std::string_view line = text.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (line_no == 1) {
      if (line != kHeader) {
        if (warnings)
          warnings->push_back(where + ":1: expected the header '" + std::string(kHeader) +
                              "', got another first line; the file is not read");
        return {};
      }
      continue;
    }
    if (line.empty()) continue;
    const size_t t1 = line.find('\t'), t2 = t1 == std::string_view::npos ? t1 : line.find('\t', t1 + 1);
    if (t2 == std::string_view::npos || line.find('\t', t2 + 1) != std::string_view::npos) {
      warn(line_no, "expected three tab-separated fields (key, algorithm, ms)");
      continue;
    }
    const std::string_view key = line.substr(0, t1), algo = line.substr(t1 + 1, t2 - t1 - 1),
                           ms = line.substr(t2 + 1);
    if (key.empty()) {
      warn(line_no, "empty key");
      continue;
    }
    TunedGemm g;
    bool ok = algo.size() == 8 * 17 - 1;
    for (size_t w = 0; ok && w < 8; ++w) {
      ok = parse_hex(algo.substr(w * 17, 16), g.algo[w]) && (w == 7 || algo[w * 17 + 16] == ' ');
    }
    if (!ok) {
      warn(line_no, "expected the algorithm as eight 16-digit lower-case hex words separated by spaces");
      continue;
    }
    const std::string ms_text(ms);
    char* ms_end = nullptr;
    errno = 0;
    g.ms = std::strtod(ms_text.c_str(), &ms_end);
    if (ms_text.empty() || errno != 0 || ms_end != ms_text.c_str() + ms_text.size() || !(g.ms >= 0)) {
      warn(line_no, "expected a time in ms (a number >= 0), got '" + ms_text + "'");
      continue;
    }
    table[std::string(key)] = g;
  }
  return table;
}

std::string format_gemm_tune_table(const GemmTuneTable& table) {
  std::string out(kHeader);
  out += '\n';
  char word[17];
  for (const auto& [key, g] : table) {
    BLU_CHECK(!key.empty() && key.find_first_of("\t\n") == std::string::npos,
              "gemm tuning table: a key holds a tab or a newline: '", key, "'");
    out += key;
    out += '\t';
    for (size_t w = 0; w < 8; ++w) {
      std::snprintf(word, sizeof word, "%016llx", static_cast<unsigned long long>(g.algo[w]));
      if (w) out += ' ';
      out += word;
    }
    std::ostringstream ms;
    ms << g.ms;
    out += '\t' + ms.str() + '\n';
  }
  return out;
}

GemmTuneTable load_gemm_tune_table(const std::string& path, std::vector<std::string>* warnings) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream text;
  text << in.rdbuf();
  return parse_gemm_tune_table(text.str(), path, warnings);
}

void save_gemm_tune_table(const std::string& path, const GemmTuneTable& add) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  BLU_CHECK(!ec, "gemm tuning table ", path, ": cannot create its folder: ", ec.message());
  // Read, merge and replace under an exclusive lock on a file beside it: two processes that save
  // at once (the ranks of one job) both keep their lines.
  const std::string lock_path = path + ".lock";
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  BLU_CHECK(lock >= 0, "gemm tuning table ", path, ": cannot open ", lock_path, ": ", std::strerror(errno));
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // closing releases the lock
  } unlock{lock};
  while (::flock(lock, LOCK_EX) != 0)
    BLU_CHECK(errno == EINTR, "gemm tuning table ", path, ": cannot lock ", lock_path, ": ", std::strerror(errno));
  GemmTuneTable table = load_gemm_tune_table(path, nullptr);
  for (const auto& [key, g] : add) table[key] = g;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    BLU_CHECK(out.good(), "gemm tuning table ", path, ": cannot write ", tmp, ": ", std::strerror(errno));
    out << format_gemm_tune_table(table);
    out.flush();
    BLU_CHECK(out.good(), "gemm tuning table ", path, ": writing ", tmp, " failed: ", std::strerror(errno));
  }
  fs::rename(tmp, p, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    BLU_CHECK(false, "gemm tuning table ", path, ": cannot rename ", tmp, " over it: ", ec.message());
  }
}

std::string default_gemm_tune_file() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/blutrain/gemm_tune.tsv";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/blutrain/gemm_tune.tsv";
  return "";
}

}  // namespace blu
