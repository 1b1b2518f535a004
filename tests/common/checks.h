// tests/common/checks: helpers every test layer uses — expect_error asserts that f() throws
// blu::Error whose message contains every given part (the user-facing errors must name the
// problem, not just fail); error_of returns that message ("(no error)" when nothing is thrown);
// bitwise_equal compares two tensors' shape, dtype and bytes.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
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

}  // namespace blu::test
