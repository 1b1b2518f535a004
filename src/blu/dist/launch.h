// dist/launch: `blutrain launch -n N -- cmd...` as a library function — starts N local copies of
// a command as ranks 0..N-1 of one job (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT set, as torchrun sets them), forwards each one's stdout and stderr line
// by line with a "[rank k] " prefix, and when one rank fails (non-zero exit or a signal) stops
// the others: SIGTERM, then SIGKILL after a grace period.
// Depends on core/error, POSIX (fork/exec, pipes, poll). Keep: the launcher never returns while a
// child it started still runs; a whole line from one rank is never interleaved with another's.
#pragma once
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace blu::dist {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> command;  // argv; command[0] is looked up in PATH
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port on this machine
  std::chrono::milliseconds grace{5000};  // SIGTERM → SIGKILL
  std::vector<std::pair<std::string, std::string>> env;  // extra variables for every rank
};

// Runs the job; returns 0 when every rank exited 0, else the first failed rank's exit status
// (128 + signal when killed by one), after printing which rank failed to `err`. Rank output goes
// to `out` (stdout lines) and `err` (stderr lines).
int launch(const LaunchOptions& options, std::FILE* out = stdout, std::FILE* err = stderr);

// A TCP port that was free on this machine a moment ago.
int free_port();

}  // namespace blu::dist
