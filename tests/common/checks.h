// tests/common/checks: helpers every test layer uses — expect_error asserts that f() throws
// blu::Error whose message contains every given part (the user-facing errors must name the
// problem, not just fail); error_of returns that message ("(no error)" when nothing is thrown);
// bitwise_equal compares two tensors' shape, dtype and bytes; metric_losses reads a run's
// step → loss from its metrics.jsonl, metric_peak_bytes its steps' device peak, and
// planned_peak_bytes the memory plan's predicted peak from the trainer's log.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "blu/core/error.h"
#include "blu/core/tensor.h"
#include "blu/ops/view.h"

namespace blu::test {

template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected blu::Error";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
  }
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = contiguous(a), cb = contiguous(b);
  return std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) == 0;
}

// step → loss of every "step" event in run/metrics.jsonl (lines that are not JSON are skipped).
inline std::map<int64_t, double> metric_losses(const std::filesystem::path& run) {
  std::map<int64_t, double> out;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == "step") out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

// The largest mem_bytes of the "step" events in run/metrics.jsonl (the device pool's peak of the
// training steps); 0 when there is none.
inline double metric_peak_bytes(const std::filesystem::path& run) {
  double peak = 0;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == "step") peak = std::max(peak, j["mem_bytes"].get<double>());
  }
  return peak;
}

// The memory plan's predicted device peak in bytes, from the trainer's log ("device: 38.26 MiB
// predicted peak = ..."); -1 when the log has none (KiB and MiB are the units it prints here).
inline double planned_peak_bytes(const std::string& log) {
  const size_t at = log.find(" predicted peak");
  if (at == std::string::npos || at < 3) return -1;
  const size_t from = log.rfind("device: ", at);
  if (from == std::string::npos) return -1;
  const std::string unit = log.substr(at - 3, 3);
  if (unit != "MiB" && unit != "KiB") return -1;
  return std::stod(log.substr(from + 8, at - 3 - from - 8)) * (unit == "MiB" ? 1048576.0 : 1024.0);
}

}  // namespace blu::test
