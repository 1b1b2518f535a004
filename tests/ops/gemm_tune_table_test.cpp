// The GEMM tuning table file (backend/gemm_tune_table.h): round trip, hostile lines skipped with a
// warning that names the file and line, another format not read, saves that merge and replace
// atomically. The timing itself is tested on the GPU (tests/cuda/gemm_nn_cuda_test.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "blu/backend/gemm_tune_table.h"
#include "blu/core/error.h"

namespace blu {
namespace {

namespace fs = std::filesystem;

TunedGemm tuned(uint64_t seed, double ms) {
  TunedGemm t;
  for (size_t i = 0; i < t.algo.size(); ++i) t.algo[i] = seed * 0x9e3779b97f4a7c15ull + i;
  t.ms = ms;
  return t;
}

TEST(GemmTuneTable, RoundTrip) {
  GemmTuneTable t = {{"NVIDIA H200 sm90 lt130000 M16384 N768", tuned(1, 0.0312)},
                     {"NVIDIA H200 sm90 lt130000 M16384 N2304", tuned(2, 1.5)}};
  t["x"].algo = {~0ull, 0, 1, 2, 3, 4, 5, 6};
  std::vector<std::string> warnings;
  const GemmTuneTable back = parse_gemm_tune_table(format_gemm_tune_table(t), "t.tsv", &warnings);
  EXPECT_TRUE(warnings.empty());
  ASSERT_EQ(back.size(), t.size());
  for (const auto& [key, g] : t) {
    ASSERT_TRUE(back.count(key)) << key;
    EXPECT_EQ(back.at(key).algo, g.algo) << key;
    EXPECT_DOUBLE_EQ(back.at(key).ms, g.ms) << key;
  }
  EXPECT_THROW(format_gemm_tune_table({{"a\tb", tuned(3, 1)}}), Error);
}

TEST(GemmTuneTable, HostileLinesAreSkippedByLine) {
  const std::string good = format_gemm_tune_table({{"good", tuned(4, 0.5)}});
  const std::string words = good.substr(good.find('\t') + 1, 8 * 17 - 1);
  const std::string text = good +                                  // line 2: kept
                           "no tabs at all\n" +                     // 3
                           "k\t" + words + "\n" +                   // 4: two fields
                           "k\t" + words + "\t1\textra\n" +         // 5: four fields
                           "\t" + words + "\t1\n" +                 // 6: empty key
                           "k\t" + words.substr(0, 100) + "\t1\n" + // 7: short algorithm
                           "k\t" + std::string(8 * 17 - 1, 'g') + "\t1\n" +  // 8: not hex
                           "k\t" + words + "\t-1\n" +               // 9: negative time
                           "k\t" + words + "\tnan\n" +              // 10: not a number
                           "k\t" + words + "\t1ms\n" +              // 11: trailing text
                           "\n" +                                   // 12: blank, ignored
                           "later\t" + words + "\t2\n";             // 13: kept
  std::vector<std::string> warnings;
  const GemmTuneTable t = parse_gemm_tune_table(text, "cache.tsv", &warnings);
  EXPECT_EQ(t.size(), 2u);
  EXPECT_TRUE(t.count("good") && t.count("later"));
  ASSERT_EQ(warnings.size(), 9u);
  for (size_t i = 0; i < warnings.size(); ++i)
    EXPECT_EQ(warnings[i].rfind("cache.tsv:" + std::to_string(i + 3) + ": ", 0), 0u) << warnings[i];
  EXPECT_NE(warnings[7].find("got 'nan'"), std::string::npos) << warnings[7];
  // Another format: nothing is read, one warning.
  warnings.clear();
  EXPECT_TRUE(parse_gemm_tune_table("# something else\n" + good.substr(good.find('\n') + 1), "o.tsv", &warnings).empty());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("o.tsv:1: expected the header"), std::string::npos) << warnings[0];
  // Binary garbage.
  warnings.clear();
  EXPECT_TRUE(parse_gemm_tune_table(std::string("\0\xff\n\t\t", 5), "b.tsv", &warnings).empty());
}

TEST(GemmTuneTable, SaveMergesWithTheFileAndReplacesItWhole) {
  const fs::path dir = fs::temp_directory_path() / ("blu_gemm_table_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string file = (dir / "sub" / "t.tsv").string();
  EXPECT_TRUE(load_gemm_tune_table(file, nullptr).empty());  // missing: empty
  save_gemm_tune_table(file, {{"a", tuned(5, 1)}});
  save_gemm_tune_table(file, {{"b", tuned(6, 2)}, {"a", tuned(7, 3)}});  // another process's lines, and a newer a
  const GemmTuneTable t = load_gemm_tune_table(file, nullptr);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t.at("a").algo, tuned(7, 3).algo);
  EXPECT_DOUBLE_EQ(t.at("b").ms, 2);
  for (const auto& e : fs::directory_iterator(dir / "sub"))
    EXPECT_TRUE(e.path().filename() == "t.tsv" || e.path().filename() == "t.tsv.lock") << "left behind: " << e.path();
  // Processes saving at once (threads here: the lock is per open file description) keep every line.
  {
    std::vector<std::thread> savers;
    for (int i = 0; i < 8; ++i)
      savers.emplace_back([&, i] { save_gemm_tune_table(file, {{"t" + std::to_string(i), tuned(uint64_t(i), i)}}); });
    for (std::thread& t : savers) t.join();
  }
  EXPECT_EQ(load_gemm_tune_table(file, nullptr).size(), 10u);
  // A file of another format is replaced by the next save (it is a cache).
  { std::ofstream(file) << "garbage\n"; }
  save_gemm_tune_table(file, {{"c", tuned(8, 4)}});
  EXPECT_EQ(load_gemm_tune_table(file, nullptr).size(), 1u);
  // A folder that cannot be made: an error naming the file.
  { std::ofstream(dir / "plain") << "x"; }
  try {
    save_gemm_tune_table((dir / "plain" / "t.tsv").string(), {{"d", tuned(9, 1)}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "plain" / "t.tsv").string()), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(GemmTuneTable, DefaultFileFollowsTheCacheVariables) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const std::string saved_xdg = xdg ? xdg : "";
  ::setenv("XDG_CACHE_HOME", "/tmp/xdg", 1);
  EXPECT_EQ(default_gemm_tune_file(), "/tmp/xdg/blutrain/gemm_tune.tsv");
  ::unsetenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (home && *home) EXPECT_EQ(default_gemm_tune_file(), std::string(home) + "/.cache/blutrain/gemm_tune.tsv");
  if (xdg) ::setenv("XDG_CACHE_HOME", saved_xdg.c_str(), 1);
}

}  // namespace
}  // namespace blu
