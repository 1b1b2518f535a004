// dist/pipeline_schedule: what a pipeline runs, before anything runs — which blocks each stage
// owns, the per-rank list of forward and backward actions for GPipe, 1F1B and interleaved 1F1B,
// and the deadlock checker that simulates every rank's list against the others.
//   Virtual stages: with `chunks` = v model chunks per rank, there are stages·v virtual stages;
//     virtual stage s = chunk·stages + rank (Megatron's round-robin), each owning a contiguous
//     range of blocks, in order. Virtual stage 0 also embeds, the last also runs the head.
//   An action is F or B of one micro-batch on one chunk. A forward on virtual stage s > 0 receives
//     its input from s-1 and a forward on s < last sends its output to s+1; a backward on s < last
//     receives the output's gradient from s+1 and one on s > 0 sends the input's gradient to s-1.
//   check_schedule simulates all ranks: receives block until the matching send happened, sends
//     are asynchronous but a rank holds at most `send_slots` unreceived sends (the executor's bound).
// Depends on core/error only. Keep: every invalid request (too few micro-batches, an empty stage,
// counts that do not split as asked, more stages than blocks) is a BLU_CHECK naming what was asked
// and why it cannot be done — nothing is ever adjusted silently; within a chunk a rank's forwards
// and its backwards each run in micro-batch order (the gradient accumulation order is fixed).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace blu::dist {

enum class PipelineScheduleKind { gpipe, one_f_one_b, interleaved };
const char* schedule_name(PipelineScheduleKind kind);            // "gpipe", "1f1b", "interleaved"
PipelineScheduleKind parse_schedule_kind(const std::string& name);  // BLU_CHECK on an unknown name

// The blocks of each virtual stage: virtual stage s owns blocks [first[s], first[s] + count[s]).
struct StageLayout {
  int stages = 1, chunks = 1;
  std::vector<int64_t> first, count;
  int virtual_stages() const { return stages * chunks; }
  int virtual_stage(int rank, int chunk) const { return chunk * stages + rank; }
  int rank_of(int vs) const { return vs % stages; }
  int chunk_of(int vs) const { return vs / stages; }
  bool is_first(int vs) const { return vs == 0; }
  bool is_last(int vs) const { return vs == virtual_stages() - 1; }
};

// Splits `num_blocks` blocks over stages × chunks virtual stages. `layers` empty: an even split,
// which must divide; otherwise one count per virtual stage (in virtual-stage order), each ≥ 1,
// summing to num_blocks (uneven splits allowed).
StageLayout split_blocks(int64_t num_blocks, int stages, int chunks, const std::vector<int64_t>& layers = {});

struct PipelineAction {
  enum Op { forward, backward } op;
  int64_t micro;
  int chunk = 0;
  bool operator==(const PipelineAction&) const = default;
};
std::string to_string(const PipelineAction& a);  // "F3" (one chunk), "B2.c1" (chunk 1)

struct PipelineSchedule {
  std::string name;
  int stages = 1, chunks = 1;
  int64_t micro_batches = 1;
  std::vector<std::vector<PipelineAction>> ranks;  // ranks[r]: rank r's actions, in order
  // The most micro-batch chunks rank r holds forwarded but not yet backwarded under its list: the
  // schedule's memory bound, which message-driven execution keeps too.
  int64_t max_in_flight(int rank) const;
  int64_t max_in_flight() const;  // over ranks
};

// GPipe: all forwards, then all backwards (both in micro-batch order). 1F1B: rank r forwards
// min(stages-r-1, micro) micro-batches, then alternates one forward and one backward, then drains.
// Interleaved 1F1B (chunks ≥ 2): Megatron's order — forwards go through chunks in groups of
// `stages` micro-batches (chunk 0 for micro-batches 0…p-1, chunk 1 for the same, …), backwards
// the same with chunks reversed; rank r warms up with (stages-r-1)·2 + (chunks-1)·stages forwards.
// BLU_CHECK: micro ≥ 1; 1F1B and interleaved need micro ≥ stages; interleaved needs chunks ≥ 2 and
// micro % stages == 0; GPipe and 1F1B take chunks == 1.
PipelineSchedule make_schedule(PipelineScheduleKind kind, int stages, int chunks, int64_t micro);

// Refuses (BLU_CHECK, before anything runs) a schedule that is malformed — a rank's list missing,
// repeating or misplacing an action, a backward before its forward, forwards or backwards of a
// chunk out of micro-batch order — or that would deadlock: the message names every blocked rank,
// the action it waits at and what it waits for. send_slots ≤ 0: unbounded sends.
void check_schedule(const PipelineSchedule& s, int64_t send_slots);

// One line per rank, one column per time step of the simulation (actions that can run in the same
// step line up): "rank 0 | F0 F1 F2 F3 .  .  .  B0 B1 …". For the docs and for error messages.
std::string timeline(const PipelineSchedule& s);

}  // namespace blu::dist
