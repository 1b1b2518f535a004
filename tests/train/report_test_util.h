// Helpers of the run report's tests: a run folder written by hand (metrics.jsonl, run.json), the
// built `blutrain` binary run as a process, and an independent count of what a run's JSONL holds.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace blu::test {

// $BLU_BLUTRAIN_BIN when set, else ../blutrain next to the test binary's folder.
inline std::filesystem::path report_blutrain_path() {
  if (const char* env = std::getenv("BLU_BLUTRAIN_BIN"); env && *env) return env;
  return std::filesystem::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain";
}

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct ProcResult {
  int status = -1;
  std::string output;  // stdout and stderr together
};

// Runs `argv` (quoted) through the shell; stdout only when `merge_stderr` is false.
inline ProcResult run_process(const std::vector<std::string>& argv, bool merge_stderr = true) {
  std::string cmd;
  for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + shell_quote(a);
  cmd += merge_stderr ? " 2>&1" : " 2>/dev/null";
  ProcResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

inline ProcResult run_blutrain(std::vector<std::string> args) {
  args.insert(args.begin(), report_blutrain_path().string());
  return run_process(args);
}

// A run folder as `blutrain train` leaves it: `steps` step events (every step logged, lr falling,
// `mfu` only when asked), an eval every 4 steps with a bigram baseline, a sample every 5, a summary.
inline void write_fake_run(const std::filesystem::path& dir, int steps, double lr0, bool with_mfu = false) {
  std::filesystem::create_directories(dir);
  std::ofstream m(dir / "metrics.jsonl", std::ios::trunc);
  for (int s = 1; s <= steps; ++s) {
    nlohmann::json e = {{"event", "step"},  {"step", s},          {"loss", 5.0 / s + lr0},
                        {"lr", lr0 / s},    {"norm", 1.0 + 0.1 * s}, {"ms", 10.0 + s},
                        {"tok_per_s", 1000.0 * s}, {"mem_bytes", int64_t(s) << 20}};
    if (with_mfu) e["mfu"] = 0.01 * s;
    m << e.dump() << '\n';
    if (s % 4 == 0)
      m << nlohmann::json({{"event", "eval"}, {"step", s}, {"val_loss", 6.0 / s}, {"bigram_loss", 2.5}}).dump() << '\n';
    if (s % 5 == 0)
      m << nlohmann::json({{"event", "sample"}, {"step", s}, {"text", "sample at " + std::to_string(s)}}).dump() << '\n';
  }
  m << nlohmann::json({{"event", "summary"}, {"step", steps}, {"train_loss", 1.0}, {"val_loss", 1.5},
                       {"tokens", 1000}, {"seconds", 2.0}, {"tok_per_s", 500.0}, {"peak_mem_bytes", 1 << 20}})
           .dump()
    << '\n';
  std::ofstream(dir / "run.json", std::ios::trunc)
      << nlohmann::json({{"options", {{"lr", lr0}, {"steps", steps}}}, {"model_config", {{"n_layer", 2}}}}).dump(2);
}

// What the report must plot for a run, counted straight from its metrics.jsonl: plot id → series
// part ("" for a plot's only series) → the number of distinct steps with a finite number.
inline std::map<std::string, std::map<std::string, size_t>> expected_points(const std::filesystem::path& metrics) {
  struct Spec {
    const char *event, *key, *plot, *part;
  };
  const Spec specs[] = {{"step", "loss", "loss", "train"},       {"eval", "val_loss", "loss", "val"},
                        {"eval", "bigram_loss", "loss", "bigram_baseline"}, {"step", "lr", "lr", ""},
                        {"step", "norm", "grad_norm", ""},       {"step", "tok_per_s", "tok_per_s", ""},
                        {"step", "mfu", "mfu", ""},              {"step", "mem_bytes", "memory", ""}};
  std::map<std::string, std::map<std::string, std::vector<int64_t>>> steps;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object()) continue;
    for (const Spec& s : specs)
      if (j.value("event", "") == s.event && j.contains(s.key) && j[s.key].is_number() &&
          std::isfinite(j[s.key].get<double>()))
        steps[s.plot][s.part].push_back(j["step"].get<int64_t>());
  }
  std::map<std::string, std::map<std::string, size_t>> out;
  for (auto& [plot, parts] : steps)
    for (auto& [part, v] : parts) {
      std::sort(v.begin(), v.end());
      out[plot][part] = size_t(std::unique(v.begin(), v.end()) - v.begin());
    }
  return out;
}

}  // namespace blu::test
