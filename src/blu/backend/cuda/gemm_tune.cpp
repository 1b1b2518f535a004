#include "blu/backend/cuda/gemm_tune.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "blu/core/error.h"

namespace blu::cuda {

namespace {

struct TuneState {
  std::mutex mu;
  bool read = false;  // the setting (from the environment, or set_gemm_tuning)
  GemmTuning setting;
  std::atomic<uint64_t> generation{0};  // bumped by set_gemm_tuning: plan caches made before are dropped
  GemmTuneStats stats;
  bool loaded = false;
  GemmTuneTable table;
};
TuneState& tune_state() {
  static TuneState s;
  return s;
}

GemmTuning tuning_from_env() {
  GemmTuning t;
  const char* on = std::getenv("BLU_GEMM_TUNE");
  const std::string v = on ? on : "";
  BLU_CHECK(v.empty() || v == "0" || v == "1" || v == "on" || v == "off",
            "BLU_GEMM_TUNE: expected 1, on, 0 or off, got '", v, "'");
  t.on = v == "1" || v == "on";
  const char* file = std::getenv("BLU_GEMM_TUNE_FILE");
  t.file = file && *file ? (std::string(file) == "none" ? "" : std::string(file)) : default_gemm_tune_file();
  const char* log = std::getenv("BLU_GEMM_TUNE_LOG");
  t.log = log && std::string(log) == "1";
  return t;
}

// The setting under the lock (read from the environment the first time).
GemmTuning& tuning_locked(TuneState& s) {
  if (!s.read) {
    s.setting = tuning_from_env();
    s.read = true;
  }
  return s.setting;
}

// The table file's lines, loaded on first use; warnings about its bad lines go to stderr once.
void load_table_locked(TuneState& s) {
  if (s.loaded) return;
  s.loaded = true;
  const std::string& file = tuning_locked(s).file;
  if (file.empty()) return;
  std::vector<std::string> warnings;
  s.table = load_gemm_tune_table(file, &warnings);
  for (const std::string& w : warnings) std::fprintf(stderr, "blu: gemm tuning: %s\n", w.c_str());
}

}  // namespace

void gemm_tune_count(int64_t GemmTuneStats::*field) {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++(s.stats.*field);
}

bool gemm_tune_find(const std::string& key, TunedGemm& out) {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  load_table_locked(s);
  auto it = s.table.find(key);
  if (it == s.table.end()) return false;
  out = it->second;
  return true;
}

void gemm_tune_store(const std::string& key, const TunedGemm& t) {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  load_table_locked(s);
  s.table[key] = t;
  const std::string& file = tuning_locked(s).file;
  if (file.empty()) return;
  try {
    save_gemm_tune_table(file, {{key, t}});
  } catch (const Error& e) {  // a cache: the run goes on, this process keeps its choice
    static bool warned = false;
    if (!warned) std::fprintf(stderr, "blu: gemm tuning: %s; choices are kept in this process only\n", e.what());
    warned = true;
  }
}

uint64_t gemm_tuning_generation() { return tune_state().generation.load(); }

GemmTuning gemm_tuning() {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  return tuning_locked(s);
}

void set_gemm_tuning(GemmTuning t) {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.read = true;
  s.setting = std::move(t);
  s.loaded = false;
  s.table.clear();
  ++s.generation;
}

GemmTuneStats gemm_tune_stats() {
  TuneState& s = tune_state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

}  // namespace blu::cuda
