// dist/launch: `blutrain launch -n N -- cmd...` as a library function — starts N local copies of
// a command as ranks 0..N-1 of one job (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT set, as torchrun sets them; and BLU_STORE_SECRET, BLU_JOB_ID: the
// store's secret and namespace, dist/tcp_store.h — the launcher's own when set, else fresh random
// ones per start), forwards each one's stdout and stderr line
// by line with a "[rank k] " prefix, and when one rank fails (non-zero exit or a signal) stops
// the others: SIGTERM, then SIGKILL after a grace period. With max_restarts > 0 a failed job is
// started again, every rank anew (BLU_RESTART_COUNT = 1, 2, ... tells them; 0 the first time), up
// to max_restarts times — the command is expected to pick up its own checkpoint (`blutrain train
// --auto-resume`). A stop asked for by SIGINT/SIGTERM to the launcher is never restarted: the
// first signal is passed on to every rank as SIGTERM (`blutrain train` then finishes its step and
// checkpoints within the grace period), a second one kills the ranks at once. When every rank
// exits with kExitStoppedResumable the job stopped cleanly and launch returns that status too.
// After a failed job, the ranks' flight-recorder dumps (dist/flight_recorder.h; each rank names
// its file on stderr) are summarised: each rank's last completed collective and where the dumps are.
// Depends on core/error, POSIX (fork/exec, pipes, poll). Keep: the launcher never returns while a
// child it started still runs; a whole line from one rank is never interleaved with another's.
#pragma once
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace blu::dist {

// The exit status of a command that stopped on a signal after saving what it needs to continue
// (`blutrain train` after SIGTERM/SIGINT; sysexits' EX_TEMPFAIL).
inline constexpr int kExitStoppedResumable = 75;

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> command;  // argv; command[0] is looked up in PATH
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port, held listening and handed to rank 0's store (BLU_STORE_LISTEN_FD)
  std::chrono::milliseconds grace{5000};  // SIGTERM → SIGKILL
  std::vector<std::pair<std::string, std::string>> env;  // extra variables for every rank
  int max_restarts = 0;  // starts of the whole job after a failure (a fresh port each time when master_port is 0)
};

// Runs the job; returns 0 when every rank of an attempt exited 0, else the last attempt's first failed
// rank's exit status (128 + signal when killed by one), after printing which rank failed to `err`. Rank output goes
// to `out` (stdout lines) and `err` (stderr lines).
int launch(const LaunchOptions& options, std::FILE* out = stdout, std::FILE* err = stderr);

// A TCP port that was free on this machine a moment ago.
int free_port();

}  // namespace blu::dist
