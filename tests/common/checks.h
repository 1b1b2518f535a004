// tests/common/checks: helpers every test layer uses — expect_error asserts that f() throws
// blu::Error whose message contains every given part (the user-facing errors must name the
// problem, not just fail); error_of returns that message ("(no error)" when nothing is thrown);
// bitwise_equal compares two tensors' shape, dtype and bytes; metric_losses reads a run's
// step → loss from its metrics.jsonl.
#pragma once
#include <gtest/gtest.h>

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

}  // namespace blu::test
