// dist/flight_recorder: the ring buffer, its JSON dump and the signal-requested dump thread (see
// flight_recorder.h for the format and the locking).
#include "blu/dist/flight_recorder.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include "blu/core/error.h"
#include "blu/dist/env.h"
#include "blu/io/json_file.h"

namespace blu::dist {

namespace fs = std::filesystem;

const char* op_state_name(OpState s) {
  switch (s) {
    case OpState::enqueued: return "enqueued";
    case OpState::started: return "started";
    case OpState::completed: return "completed";
    case OpState::failed: return "failed";
    case OpState::captured: return "captured";
  }
  return "?";
}

namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Copies `s` into a fixed field, truncating, always NUL-terminated.
template <size_t N>
void copy_field(char (&dst)[N], std::string_view s) {
  const size_t n = std::min(s.size(), N - 1);
  if (n > 0) std::memcpy(dst, s.data(), n);  // an empty view's data() may be null: no memcpy then
  dst[n] = '\0';
}

// "default_pg #41 all_reduce during training step 2"
std::string describe_op(const nlohmann::json& e) {
  std::string s = e.value("group", std::string("?")) + " #" + std::to_string(e.value("seq", uint64_t(0))) + " " +
                  e.value("kind", std::string("?"));
  const std::string phase = e.value("phase", std::string());
  if (!phase.empty()) s += " during " + phase;
  return s;
}

// Each group's last completed operation, and the oldest one not completed, of a dump's JSON.
std::string describe_dump(const nlohmann::json& j) {
  std::string s = "last completed ";
  const auto& last = j.at("last_completed");
  if (last.empty()) s += "none";
  bool first = true;
  for (const auto& [group, e] : last.items()) {
    nlohmann::json op = e;
    op["group"] = group;
    s += (first ? "" : ", ") + describe_op(op);
    first = false;
  }
  for (const auto& e : j.at("entries")) {
    if (e.value("state", std::string()) == "completed") continue;
    return s + "; oldest not completed: " + describe_op(e) + " (" + e.value("state", std::string("?")) + ")";
  }
  return s + "; none in flight";
}

}  // namespace

struct FlightRecorder::Slot {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  bool used = false;
  FlightEntry e;

  void lock() {
    for (int spins = 0; busy.test_and_set(std::memory_order_acquire); ++spins)
      if (spins > 64) std::this_thread::yield();  // a dump copying this slot
  }
  void unlock() { busy.clear(std::memory_order_release); }
};

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity), slots_(new Slot[capacity]) {
  BLU_CHECK(capacity > 0, "FlightRecorder: capacity must be > 0, got ", capacity);
}

FlightRecorder::~FlightRecorder() {
  if (pipe_[1] >= 0) ::close(pipe_[1]);  // the dump thread reads end of file and returns
  if (dump_thread_.joinable()) dump_thread_.join();
  if (pipe_[0] >= 0) ::close(pipe_[0]);
}

FlightRecorder& FlightRecorder::global() {
  static FlightRecorder* r = new FlightRecorder();  // leaked on purpose: see the header
  return *r;
}

uint64_t FlightRecorder::record(const FlightOp& op) {
  const uint64_t id = next_.fetch_add(1, std::memory_order_relaxed);
  Slot& s = slots_[id % capacity_];
  const int64_t t = now_us();
  s.lock();
  s.used = true;
  FlightEntry& e = s.e;
  e.id = id;
  e.seq = op.seq;
  copy_field(e.group, op.group);
  copy_field(e.backend, op.backend);
  copy_field(e.kind, op.kind);
  copy_field(e.dtype, op.has_dtype ? dtype_name(op.dtype) : std::string_view());
  copy_field(e.phase, op.phase);
  e.bytes = op.bytes;
  e.peer = op.peer;
  e.state = OpState::enqueued;
  e.enqueued_us = t;
  e.started_us = 0;
  e.completed_us = 0;
  s.unlock();
  return id;
}

void FlightRecorder::update(uint64_t id, OpState state) {
  Slot& s = slots_[id % capacity_];
  const int64_t t = now_us();
  s.lock();
  if (s.used && s.e.id == id) {
    s.e.state = state;
    if (state == OpState::started) s.e.started_us = t;
    if (state == OpState::completed || state == OpState::failed) s.e.completed_us = t;
  }
  s.unlock();
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::vector<FlightEntry> out;
  out.reserve(capacity_);
  for (size_t i = 0; i < capacity_; ++i) {
    Slot& s = slots_[i];
    s.lock();
    if (s.used) out.push_back(s.e);
    s.unlock();
  }
  std::sort(out.begin(), out.end(), [](const FlightEntry& a, const FlightEntry& b) { return a.id < b.id; });
  return out;
}

nlohmann::json FlightRecorder::to_json(int rank, int world_size, std::string_view reason) const {
  const std::vector<FlightEntry> entries = snapshot();
  nlohmann::json list = nlohmann::json::array();
  std::map<std::string, const FlightEntry*> last;  // group → its completed entry of the highest seq
  for (const FlightEntry& e : entries) {
    list.push_back({{"id", e.id},
                    {"group", e.group},
                    {"backend", e.backend},
                    {"seq", e.seq},
                    {"kind", e.kind},
                    {"dtype", e.dtype},
                    {"bytes", e.bytes},
                    {"peer", e.peer},
                    {"phase", e.phase},
                    {"state", op_state_name(e.state)},
                    {"enqueued_us", e.enqueued_us},
                    {"started_us", e.started_us},
                    {"completed_us", e.completed_us}});
    if (e.state != OpState::completed) continue;
    const FlightEntry*& l = last[e.group];
    if (!l || e.seq > l->seq) l = &e;
  }
  nlohmann::json lc = nlohmann::json::object();
  for (const auto& [group, e] : last)
    lc[group] = {{"seq", e->seq}, {"kind", e->kind}, {"phase", e->phase}, {"completed_us", e->completed_us}};
  return {{"version", 1},
          {"rank", rank},
          {"world_size", world_size},
          {"pid", int64_t(::getpid())},
          {"reason", std::string(reason)},
          {"dumped_at_us", now_us()},
          {"capacity", capacity_},
          {"recorded", recorded()},
          {"last_completed", std::move(lc)},
          {"entries", std::move(list)}};
}

void FlightRecorder::set_dump_target(std::string dir, int rank, int world_size) {
  std::lock_guard lock(dump_mu_);
  dir_ = std::move(dir);
  rank_ = rank;
  world_size_ = world_size;
  target_set_ = true;
  if (pipe_[0] >= 0) return;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;  // no signal-requested dumps; the others still work
  pipe_[0] = fds[0];
  pipe_[1] = fds[1];
  dump_thread_ = std::thread([this] { dump_thread_main(); });
}

void FlightRecorder::request_dump_from_signal(int sig) {
  const int fd = pipe_[1];
  if (fd < 0) return;
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(fd, &b, 1);
}

void FlightRecorder::dump_thread_main() {
  for (;;) {
    unsigned char b = 0;
    const ssize_t n = ::read(pipe_[0], &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) return;
    const char* name = b == SIGTERM ? "SIGTERM" : b == SIGINT ? "SIGINT" : nullptr;
    dump(name ? std::string("signal ") + name : "signal " + std::to_string(int(b)));
  }
}

std::string FlightRecorder::dump(std::string_view reason) {
  try {
    std::lock_guard lock(dump_mu_);
    std::string dir = dir_;
    int rank = rank_, world = world_size_;
    if (!target_set_) {
      const char* env = std::getenv("BLU_FLIGHT_RECORDER_DIR");
      if (!env || !*env) return "";
      dir = env;
      const DistEnv de = detect_env();
      rank = de.rank;
      world = de.world_size;
    }
    if (recorded() == 0) return "";
    fs::create_directories(dir);
    const fs::path path = fs::path(dir) / ("rank_" + std::to_string(rank) + ".json");
    const nlohmann::json j = to_json(rank, world, reason);
    io::write_file_atomic(path, j.dump(1) + "\n");
    ++dumps_;
    // The reason's first line, shortened: an error message can run over several.
    std::string why(reason.substr(0, std::min(reason.find('\n'), size_t(160))));
    if (why.size() < reason.size()) why += "...";
    std::fprintf(stderr, "flight recorder: rank %d (%s): %s%s%s\n", rank, why.c_str(), describe_dump(j).c_str(),
                 kDumpLineMarker, path.c_str());
    std::fflush(stderr);
    return path.string();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flight recorder: could not write the dump (%.*s): %s\n", int(std::min(reason.size(), size_t(160))),
                 reason.data(), e.what());
    return "";
  }
}

std::string summarize_dump(const std::string& path) {
  const nlohmann::json j = io::read_json_file(path);
  BLU_CHECK(j.is_object() && j.value("version", 0) == 1 && j.contains("entries") && j.contains("last_completed"),
            path, ": expected a flight-recorder dump (version 1, with entries and last_completed), got another JSON");
  try {
    return describe_dump(j);
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, path, ": malformed flight-recorder dump: ", e.what());
  }
  return {};
}

}  // namespace blu::dist
