// The test binaries' main. A crash (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) prints the test that was
// running and the stack's return addresses (binary + offset) before the process dies, so a crash on
// the GPU machine, which has no debugger, can be located here with `addr2line -f -C -e BINARY OFFSET`
// on the unstripped binary.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

namespace {

void on_crash(int sig) {
  char line[512] = "\n*** signal ";
  std::strncat(line, strsignal(sig), sizeof line - std::strlen(line) - 1);
  if (const auto* t = ::testing::UnitTest::GetInstance()->current_test_info()) {
    std::strncat(line, " in ", sizeof line - std::strlen(line) - 1);
    std::strncat(line, t->test_suite_name(), sizeof line - std::strlen(line) - 1);
    std::strncat(line, ".", sizeof line - std::strlen(line) - 1);
    std::strncat(line, t->name(), sizeof line - std::strlen(line) - 1);
  }
  std::strncat(line, "; stack:\n", sizeof line - std::strlen(line) - 1);
  (void)!::write(STDERR_FILENO, line, std::strlen(line));
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) std::signal(sig, on_crash);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
