// dist/launch: fork/exec of the ranks, a poll loop over their output pipes, failure handling.
#include "blu/dist/launch.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "blu/core/error.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/tcp_store.h"

namespace blu::dist {

namespace {

std::atomic<int> g_signal{0}, g_signal_count{0};
void on_signal(int sig) {
  g_signal = sig;
  ++g_signal_count;
}

struct Stream {
  int fd = -1;
  std::string pending;  // a partial line
  std::FILE* sink = nullptr;
  std::string flight_dump;  // the path in the last flight-recorder line (dist/flight_recorder.h)
};

// Notes the dump path of a flight-recorder line ("flight recorder: rank R (...): ...; dump: PATH").
void note_flight_dump(Stream& s, std::string_view line) {
  if (!line.starts_with("flight recorder: rank ")) return;
  const size_t at = line.rfind(kDumpLineMarker);
  if (at != std::string_view::npos) s.flight_dump = std::string(line.substr(at + std::strlen(kDumpLineMarker)));
}

struct Child {
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // exit code, or 128 + signal
  Stream streams[2];
};

// Writes every complete line of `data` (plus, at eof, the rest) with the rank prefix.
void forward(Stream& s, int rank, const char* data, size_t n, bool eof) {
  s.pending.append(data, n);
  size_t start = 0;
  for (;;) {
    const size_t nl = s.pending.find('\n', start);
    if (nl == std::string::npos) break;
    std::fprintf(s.sink, "[rank %d] %.*s\n", rank, int(nl - start), s.pending.data() + start);
    note_flight_dump(s, std::string_view(s.pending).substr(start, nl - start));
    start = nl + 1;
  }
  s.pending.erase(0, start);
  if (eof && !s.pending.empty()) {
    std::fprintf(s.sink, "[rank %d] %s\n", rank, s.pending.c_str());
    note_flight_dump(s, s.pending);
    s.pending.clear();
  }
  std::fflush(s.sink);
}

int decode_status(int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0); }

std::string describe(int st) {
  if (WIFEXITED(st)) return "exit status " + std::to_string(WEXITSTATUS(st));
  if (WIFSIGNALED(st)) return std::string("signal ") + std::to_string(WTERMSIG(st)) + " (" + strsignal(WTERMSIG(st)) + ")";
  return "status " + std::to_string(st);
}

// After a failed job: each rank's last completed collective, from the dumps its stderr named.
void print_flight_summary(const std::vector<Child>& children, std::FILE* err) {
  std::string lines, dir;
  for (size_t r = 0; r < children.size(); ++r) {
    const std::string& path = children[r].streams[1].flight_dump;
    std::string what;
    if (path.empty()) {
      what = "no flight-recorder dump";
    } else {
      try {
        what = summarize_dump(path);
      } catch (const std::exception& e) {
        what = e.what();
      }
      const std::string d = std::filesystem::path(path).parent_path().string();
      dir = dir.empty() || dir == d ? d : "(several folders: see each rank's line above)";
    }
    lines += "  rank " + std::to_string(r) + ": " + what + "\n";
  }
  if (dir.empty()) return;  // no rank recorded anything (no collectives, or no run folder)
  std::fprintf(err, "blutrain launch: flight recorder, each rank's last completed collective:\n%s  dumps: %s\n",
               lines.c_str(), dir.c_str());
  std::fflush(err);
}

}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  BLU_CHECK(fd >= 0, "free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  BLU_CHECK(ok, "free_port: could not bind a port: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

namespace {

// A socket bound to a free port of `addr` and listening, close-on-exec; -1 with `why` set when
// that fails. The launcher holds it so that no other process can take the port before rank 0
// serves the store on it (Note [Launcher's socket], tcp_store.cpp).
int listening_socket(const std::string& addr, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &res); rc != 0 || !res) {
    why = "cannot resolve MASTER_ADDR '" + addr + "': " + ::gai_strerror(rc);
    return -1;
  }
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  a.sin_port = 0;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 128) != 0) {
    why = "cannot listen on MASTER_ADDR '" + addr + "': " + std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

int bound_port(int fd) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  BLU_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0, "launch: getsockname failed: ",
            std::strerror(errno));
  return ntohs(a.sin_port);
}

// One start of the job (every rank); the result of launch(). `stopped` tells whether the launcher
// itself was asked to stop (SIGINT/SIGTERM).
int run_once(const LaunchOptions& o, int restart, std::FILE* out, std::FILE* err, bool& stopped) {
  // A port given is bound by rank 0 itself; a port picked here is held, listening, until rank 0
  // has inherited the socket (Note [Launcher's socket], tcp_store.cpp).
  std::string why;
  const int store_fd = o.master_port > 0 ? -1 : listening_socket(o.master_addr, why);
  BLU_CHECK(o.master_port > 0 || store_fd >= 0, "launch: ", why);
  const int port = o.master_port > 0 ? o.master_port : bound_port(store_fd);
  // The store's secret and namespace (Note [Store security], tcp_store.cpp): the launcher's own
  // BLU_STORE_SECRET / BLU_JOB_ID when set (or given in o.env), else fresh ones for this start.
  const char* given_secret = std::getenv("BLU_STORE_SECRET");
  const std::string secret = given_secret && *given_secret ? given_secret : generate_store_secret();
  const char* given_job = std::getenv("BLU_JOB_ID");
  const std::string job = given_job && *given_job ? given_job : "launch-" + generate_store_secret().substr(0, 16);

  struct sigaction sa{}, old_int{}, old_term{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  g_signal = 0;
  g_signal_count = 0;
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);

  std::vector<Child> children(size_t(o.nproc));
  std::fflush(out);
  std::fflush(err);
  for (int r = 0; r < o.nproc; ++r) {
    int pipes[2][2];
    BLU_CHECK(::pipe2(pipes[0], O_CLOEXEC) == 0 && ::pipe2(pipes[1], O_CLOEXEC) == 0, "launch: pipe failed: ",
              std::strerror(errno));
    const pid_t pid = ::fork();
    BLU_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);  // its own process group: stopping a rank stops what it started too
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::dup2(pipes[0][1], 1);
      ::dup2(pipes[1][1], 2);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("BLU_RESTART_COUNT", std::to_string(restart).c_str(), 1);
      ::setenv("BLU_STORE_SECRET", secret.c_str(), 1);
      ::setenv("BLU_JOB_ID", job.c_str(), 1);
      for (const auto& [k, v] : o.env) ::setenv(k.c_str(), v.c_str(), 1);
      if (store_fd >= 0 && r == 0) {
        ::fcntl(store_fd, F_SETFD, 0);  // rank 0 keeps the store's socket across exec
        ::setenv(kStoreListenFdEnv, std::to_string(store_fd).c_str(), 1);
      } else {
        ::unsetenv(kStoreListenFdEnv);
      }
      std::vector<char*> argv;
      for (const std::string& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "blutrain launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so a kill right after fork reaches the group
    ::close(pipes[0][1]);
    ::close(pipes[1][1]);
    Child& c = children[size_t(r)];
    c.pid = pid;
    c.running = true;
    c.streams[0] = {pipes[0][0], {}, out, {}};
    c.streams[1] = {pipes[1][0], {}, err, {}};
  }
  if (store_fd >= 0) ::close(store_fd);  // rank 0 has its own copy

  int failed_rank = -1, failed_status = 0;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  auto signal_all = [&](int sig) {
    for (Child& c : children)
      if (c.running) ::kill(-c.pid, sig);
  };
  auto begin_stop = [&] {
    if (stopping) return;
    stopping = true;
    signal_all(SIGTERM);
    stop_deadline = std::chrono::steady_clock::now() + o.grace;
  };

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, int>> which;  // (rank, stream)
    for (int r = 0; r < o.nproc; ++r)
      for (int s = 0; s < 2; ++s)
        if (children[size_t(r)].streams[s].fd >= 0) {
          fds.push_back({children[size_t(r)].streams[s].fd, POLLIN, 0});
          which.emplace_back(r, s);
        }
    bool any_running = false;
    for (const Child& c : children) any_running |= c.running;
    if (fds.empty() && !any_running) break;
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 50);
    } else {
      ::usleep(20000);
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [r, s] = which[i];
      Stream& st = children[size_t(r)].streams[s];
      char buf[65536];
      const ssize_t n = ::read(st.fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        forward(st, r, buf, 0, true);
        ::close(st.fd);
        st.fd = -1;
      } else {
        forward(st, r, buf, size_t(n), false);
      }
    }
    for (int r = 0; r < o.nproc; ++r) {
      Child& c = children[size_t(r)];
      if (!c.running) continue;
      int st = 0;
      if (::waitpid(c.pid, &st, WNOHANG) != c.pid) continue;
      c.running = false;
      c.status = decode_status(st);
      // A rank that stopped on a signal after saving its checkpoint (kExitStoppedResumable) has not
      // failed: the others stop at the same step by themselves.
      if (c.status != 0 && c.status != kExitStoppedResumable && failed_rank < 0 && !stopping) {
        failed_rank = r;
        failed_status = c.status;
        std::fprintf(err, "blutrain launch: rank %d failed (%s); stopping the other ranks\n", r,
                     describe(st).c_str());
        std::fflush(err);
        begin_stop();
      }
    }
    if (g_signal != 0 && !stopping) {
      std::fprintf(err, "blutrain launch: got signal %d; stopping all ranks\n", int(g_signal));
      failed_status = 128 + g_signal;
      stopped = true;
      begin_stop();
    }
    if (stopping && (std::chrono::steady_clock::now() >= stop_deadline || g_signal_count >= 2)) {  // a second signal: now
      signal_all(SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (failed_rank >= 0) print_flight_summary(children, err);
  bool all_resumable = true;
  for (const Child& c : children) all_resumable &= c.status == kExitStoppedResumable;
  if (all_resumable) {  // every rank checkpointed and stopped: the job can continue, not restart
    stopped = true;
    return kExitStoppedResumable;
  }
  return failed_status;
}

}  // namespace

int launch(const LaunchOptions& o, std::FILE* out, std::FILE* err) {
  BLU_CHECK(o.nproc >= 1, "launch: -n must be >= 1, got ", o.nproc);
  BLU_CHECK(!o.command.empty(), "launch: expected a command to run after `--`, got none");
  BLU_CHECK(o.max_restarts >= 0, "launch: --max-restarts must be >= 0, got ", o.max_restarts);
  for (int restart = 0;; ++restart) {
    bool stopped = false;
    const int status = run_once(o, restart, out, err, stopped);
    if (status == 0 || stopped || restart == o.max_restarts) return status;
    std::fprintf(err, "blutrain launch: restarting all %d ranks (restart %d of %d)\n", o.nproc, restart + 1,
                 o.max_restarts);
    std::fflush(err);
  }
}

}  // namespace blu::dist
