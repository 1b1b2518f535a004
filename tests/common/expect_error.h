// tests/common/expect_error: asserts that f() throws blu::Error whose message contains every
// given part (the user-facing errors must name the problem, not just fail).
#pragma once
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "blu/core/error.h"

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

}  // namespace blu::test
