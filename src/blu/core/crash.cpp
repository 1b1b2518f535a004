#include "blu/core/crash.h"

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <initializer_list>
#include <cstdlib>
#include <cstring>

namespace blu {

void report_crash(int sig, const char* context) {
  char line[512] = "\n*** signal ";
  std::strncat(line, strsignal(sig), sizeof line - std::strlen(line) - 1);
  if (context && *context) {
    std::strncat(line, " in ", sizeof line - std::strlen(line) - 1);
    std::strncat(line, context, sizeof line - std::strlen(line) - 1);
  }
  std::strncat(line, "; stack:\n", sizeof line - std::strlen(line) - 1);
  (void)!::write(STDERR_FILENO, line, std::strlen(line));
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
  std::_Exit(128 + sig);  // not reached: the default action of these signals ends the process
}

void on_crash_signals(void (*handler)(int)) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) std::signal(sig, handler);
}

}  // namespace blu
