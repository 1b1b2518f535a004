// dist/flight_recorder: what this process's collectives were doing when a job failed. Every
// process group (Gloo and NCCL, every prefix) records each collective and point-to-point
// operation into one per-process ring buffer — group, sequence number, kind, bytes, dtype, peer,
// the phase the trainer named, and its state (enqueued → started → completed, or failed) with
// the time of each transition — and on a timeout, an abort, a fatal error or SIGTERM the buffer is
// dumped as JSON (by default RUN/flight_recorder/rank_R.json), so that after a hang each rank's
// last completed collective can be compared with the others'.
//
// Recording is lock-cheap: an operation takes a slot with one atomic increment and fills it under
// that slot's own spin lock (a fixed-size copy, no allocation), so concurrent groups never
// serialise on a global lock; a state change writes one slot the same way and is dropped when the
// slot has since been reused. A dump copies every slot under its lock and writes the file from
// ordinary (non-signal) context: signal handlers only call request_dump_from_signal(), which
// writes one byte to a pipe that the recorder's dump thread reads.
//
// Dump file (version 1):
//   {"version": 1, "rank": R, "world_size": N, "pid": P, "reason": "...", "dumped_at_us": T,
//    "capacity": C, "recorded": total operations ever recorded,
//    "last_completed": {"<group>": {"seq": S, "kind": "all_reduce", "phase": "...", "completed_us": T}},
//    "entries": [{"id", "group", "backend", "seq", "kind", "dtype", "bytes", "peer", "phase",
//                 "state", "enqueued_us", "started_us", "completed_us"}, ...]}   oldest first
// Times are microseconds since the Unix epoch (system clock: comparable across ranks of one host);
// 0 means "not reached".
// Depends on core/dtype, io/json_file (the atomic write), nlohmann/json. Keep: record() and
// update() never allocate or block on anything but one slot; a dump never throws (a failing write
// is reported on stderr) and writes the file atomically; each dump prints one line on stderr that
// ends in kDumpLineMarker and the file's path (`blutrain launch` collects those paths).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "blu/core/dtype.h"

namespace blu::dist {

// captured: enqueued while its stream recorded a CUDA graph (the compiled step); it runs each time
// the graph does, which the recorder does not observe.
enum class OpState : uint8_t { enqueued, started, completed, failed, captured };
const char* op_state_name(OpState s);

struct FlightEntry {
  uint64_t id = 0;   // the recorder's running number (slot = id % capacity)
  uint64_t seq = 0;  // the group's sequence number of the operation (1, 2, ...)
  char group[40] = {};
  char backend[8] = {};
  char kind[24] = {};
  char dtype[8] = {};
  char phase[96] = {};  // truncated to fit
  int64_t bytes = 0;
  int peer = -1;  // broadcast's root, send's destination, recv's source; -1 otherwise
  OpState state = OpState::enqueued;
  int64_t enqueued_us = 0, started_us = 0, completed_us = 0;  // completed_us: also the failure time
};

// What a process group tells the recorder about one operation.
struct FlightOp {
  std::string_view group, backend, kind;
  uint64_t seq = 0;
  DType dtype = DType::f32;
  bool has_dtype = true;  // false: barrier, init (no payload)
  int64_t bytes = 0;
  int peer = -1;
  std::string_view phase;
};

// The end of every dump's stderr line, followed by the dump's path.
inline constexpr const char* kDumpLineMarker = "; dump: ";

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = 4096);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // The process's recorder (never destroyed, so threads may record until the process exits).
  static FlightRecorder& global();

  // A new operation in state `enqueued`; returns its id for update().
  uint64_t record(const FlightOp& op);
  // Moves operation `id` to `state`, stamping the time; nothing when its slot was reused since.
  void update(uint64_t id, OpState state);

  size_t capacity() const { return capacity_; }
  uint64_t recorded() const { return next_.load(std::memory_order_relaxed); }
  // The entries still held, oldest first.
  std::vector<FlightEntry> snapshot() const;
  nlohmann::json to_json(int rank, int world_size, std::string_view reason) const;

  // Where dumps go: <dir>/rank_<rank>.json. Until set, dumps go to $BLU_FLIGHT_RECORDER_DIR (rank
  // and world size from the launcher's environment, dist/env.h) and, without it, nowhere. Also
  // starts the thread that serves request_dump_from_signal().
  void set_dump_target(std::string dir, int rank, int world_size);
  // Writes the dump now when a target is known and something was recorded; returns the file's
  // path ("" when nothing was written). Never throws.
  std::string dump(std::string_view reason);
  // Async-signal-safe: asks the dump thread to dump with reason "signal <sig>".
  void request_dump_from_signal(int sig);
  // A dump was written by this process (fatal-error paths skip theirs when the failing process
  // group has already written one).
  bool dumped() const { return dumps_.load() > 0; }

 private:
  struct Slot;
  void dump_thread_main();

  const size_t capacity_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{0};
  std::atomic<bool> target_set_{false};
  std::atomic<int> dumps_{0};
  std::mutex dump_mu_;  // one dump at a time (they share the temporary file); guards the target
  std::string dir_;
  int rank_ = 0, world_size_ = 1;
  int pipe_[2] = {-1, -1};
  std::thread dump_thread_;  // joined by the destructor (the global recorder's runs until exit)
};

// The summary of one dump file: "last completed <group> #S kind (phase); in flight: #S kind
// (state)" — what `blutrain launch` prints per rank after a failed job. Throws blu::Error when the
// file is not a flight-recorder dump.
std::string summarize_dump(const std::string& path);

}  // namespace blu::dist
