// dist/annotations: Whale's four primitives, which mark parts of a single-device model and nest into
// a hybrid layout, in a C++ form and an equivalent text form (`--parallel`):
//   replicate(n [, weights=[w…]|probe] [, zero=0|1|2|3]) { … }   data parallelism over n replicas;
//                                                            weights: each replica's share of the
//                                                            batch, or probe: measured at start-up
//   pipeline(n [, schedule=gpipe|1f1b|interleaved] [, micro=M] [, chunks=v] [, balance=even|time]) { stage… }
//                                                            n pipeline stages over the model's blocks
//   stage(BLOCKS) { … }                                      one stage: a contiguous range of blocks,
//                                                            "h.0-h.5" or "h.0-5" or one block "h.7"
//   split(n [, sp=true] [, widths=[w…]|probe] [, row_chunks=k])  tensor parallelism of degree n
//                                                            (Megatron column/row splits); sp: sequence
//                                                            parallel; row_chunks: each row linear's
//                                                            forward in k pieces, each piece's
//                                                            collective beside the next one's GEMM
// For example, data parallel over a pipeline whose stages are tensor parallel (8 ranks):
//   replicate(2) { pipeline(2, schedule=1f1b, micro=8) { stage(h.0-h.5) { split(2) } stage(h.6-h.11) { split(2) } } }
// A tree resolves against the model's block names and the world size into a Layout — the mesh
// (dp × pp × tp), the stage ranges, the schedule — which the strategy rewrites the model into.
// Everything wrong with an annotation is refused here, before any rank starts work, with a message
// naming the primitive, the argument and what was expected.
// Depends on core/error. Keep: the text form of a Layout (to_text) parses back to the same Layout;
// resolve never changes what was asked (a pipeline of 3 stages over 8 blocks is an error unless the
// stages say how to split, never a silent 3/3/2).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace blu::dist {

// One primitive and what it encloses. `args` hold the named arguments as written (text) or as set
// (C++ builders), so both forms are checked by the same code.
struct Annotation {
  std::string kind;                         // replicate | pipeline | stage | split
  int64_t degree = 0;                       // n (replicate, pipeline, split)
  std::string blocks;                       // stage: "h.0-h.5"
  std::map<std::string, std::string> args;  // named arguments: "schedule" → "1f1b", "weights" → "[3,1]"
  std::vector<Annotation> children;
  size_t column = 0;                        // where the text form had it (1-based; 0: built in C++)
  bool empty() const { return kind.empty(); }
};

// The C++ form. Each returns the node; nesting by argument:
//   replicate(2, pipeline(2, {{"schedule", "1f1b"}, {"micro", "8"}},
//                         {stage("h.0-h.5", split(2)), stage("h.6-h.11", split(2))}))
Annotation replicate(int64_t n, Annotation inner = {}, std::map<std::string, std::string> args = {});
Annotation pipeline(int64_t n, std::map<std::string, std::string> args, std::vector<Annotation> stages = {});
Annotation stage(std::string blocks, Annotation inner = {});
Annotation split(int64_t n, std::map<std::string, std::string> args = {});

// Parses the text form; BLU_CHECK errors name the column and what was expected.
Annotation parse_annotation(const std::string& text);
// The canonical text of a tree (parse_annotation(to_text(a)) == a, up to columns).
std::string to_text(const Annotation& a);

enum class Schedule { gpipe, one_f_one_b, interleaved };
const char* schedule_name(Schedule s);

struct Layout {
  int dp = 1, pp = 1, tp = 1;
  int zero = 0;                          // ZeRO stage of the data-parallel replicas (0: DDP)
  std::vector<double> replica_weights;   // dp shares of the batch, summing to 1 (even when not asked)
  bool probe_weights = false;            // weights=probe: shares from a start-up probe of each rank's speed
  bool probe_widths = false;             // split's widths=probe: the same, for the tp shares
  Schedule schedule = Schedule::one_f_one_b;
  int64_t micro_batches = 0;             // per optimizer step and replica (0: not pipelined)
  int chunks = 1;                        // virtual stages per rank (interleaved)
  bool balance_by_time = false;          // stage sizes from measured block times (no explicit stages)
  // Each stage's blocks as [first, last] block indices (pp entries; even split when not given).
  std::vector<std::pair<int64_t, int64_t>> stage_blocks;
  bool sequence_parallel = false;
  std::vector<double> tp_widths;         // tp shares of each split dimension, summing to 1
  int64_t tp_row_chunks = 1;             // split's row_chunks (TPOptions::row_chunks)
  int world_size() const { return dp * pp * tp; }
  std::string describe() const;          // "dp=2 × pp=2 (1f1b, 8 micro-batches) × tp=2"
};

// Validates `a` against the model's blocks (in order) and the job's world size (0: not checked)
// and returns the layout. Every rule the header names is checked here.
Layout resolve_layout(const Annotation& a, const std::vector<std::string>& block_names, int world_size);

}  // namespace blu::dist
