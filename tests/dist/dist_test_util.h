// Multi-process test support: a test re-runs this test binary as N ranks under dist::launch with
// --gtest_filter=DistWorker.Run and BLU_DIST_SCENARIO naming what the workers do (worker_test.cpp);
// the workers report through files in a temporary directory and their exit status.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "blu/dist/launch.h"

namespace blu::dist::test {

inline std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }
// The blutrain app of this build (tests/../blutrain), which the CLI tests run.
inline std::filesystem::path blutrain() {
  return std::filesystem::path(self_exe()).parent_path().parent_path() / "blutrain";
}

struct LaunchResult {
  int status = 0;
  std::string out, err;
  double seconds = 0;
};

inline std::string slurp(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

inline LaunchResult run_command(int n, std::vector<std::string> command,
                                std::vector<std::pair<std::string, std::string>> env = {}, int max_restarts = 0) {
  LaunchOptions o;
  o.nproc = n;
  o.max_restarts = max_restarts;
  o.command = std::move(command);
  o.env = std::move(env);
  o.grace = std::chrono::milliseconds(2000);
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  const auto t0 = std::chrono::steady_clock::now();
  LaunchResult r;
  r.status = launch(o, out, err);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// Runs `n` workers of `scenario`; extra variables go to every rank.
inline LaunchResult run_workers(const std::string& scenario, int n,
                                std::vector<std::pair<std::string, std::string>> env = {}) {
  env.emplace_back("BLU_DIST_SCENARIO", scenario);
  env.emplace_back("OMP_NUM_THREADS", "1");  // ranks share two cores
  return run_command(n, {self_exe(), "--gtest_filter=DistWorker.Run", "--gtest_brief=1"}, env);
}

// A fresh directory under the system temp dir, removed by the destructor.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/blu_dist_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

}  // namespace blu::dist::test
