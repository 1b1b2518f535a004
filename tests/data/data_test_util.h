// Helpers shared by the data tests: a temporary folder that removes itself, and raw file writers
// for building broken shards by hand.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <initializer_list>
#include <string>
#include <vector>

#include "blu/core/error.h"
#include "common/checks.h"  // expect_error, error_of

namespace blu::test {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("blu_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A shard built by hand: header ints as given (the rest zero), then the tokens, then `extra` bytes.
inline std::string raw_shard(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens,
                             size_t extra = 0) {
  std::array<int32_t, 256> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::string s(reinterpret_cast<const char*>(header.data()), header.size() * 4);
  s.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  s.append(extra, '\x7f');
  return s;
}

// Files in `dir` (names only, sorted), hidden ones included.
inline std::vector<std::string> list_dir(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace blu::test
