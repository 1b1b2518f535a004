// The test binaries' main. A crash (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) prints the test that was
// running and the stack's return addresses (core/crash.h) before the process dies, so a crash on
// the GPU machine, which has no debugger, can be located here with `addr2line -f -C -e BINARY OFFSET`
// on the unstripped binary.
#include <gtest/gtest.h>

#include <cstring>

#include "blu/core/crash.h"

namespace {

void on_crash(int sig) {
  char test[256] = "";
  if (const auto* t = ::testing::UnitTest::GetInstance()->current_test_info()) {
    std::strncat(test, t->test_suite_name(), sizeof test - 1);
    std::strncat(test, ".", sizeof test - std::strlen(test) - 1);
    std::strncat(test, t->name(), sizeof test - std::strlen(test) - 1);
  }
  blu::report_crash(sig, test);
}

}  // namespace

int main(int argc, char** argv) {
  blu::on_crash_signals(on_crash);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
