// core/crash: what a process prints when it crashes (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) — the
// signal, a caller's context (the test that was running) and the stack's return addresses
// (binary + offset) — so a crash on a machine without a debugger (the GPU machine) is located
// here with `addr2line -f -C -e BINARY OFFSET` on the unstripped binary. Used by blutrain's main
// and the test binaries' main.
// Depends on nothing but libc. Keep: the handler path is async-signal-safe apart from
// backtrace(), and ends in the signal's default action (the exit status stays the signal's).
#pragma once

namespace blu {

// Prints "*** signal NAME[ in CONTEXT]; stack:" and the frames to stderr, then re-raises `sig`
// with its default action. For signal handlers; `context` may be null.
[[noreturn]] void report_crash(int sig, const char* context);
// Installs `handler` for SIGSEGV, SIGBUS, SIGFPE and SIGABRT.
void on_crash_signals(void (*handler)(int));

}  // namespace blu
