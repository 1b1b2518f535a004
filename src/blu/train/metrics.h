// train/metrics: what the trainer reports — the console progress line, the parameter table, and
// the run's metrics file (<out>/metrics.jsonl, one JSON object per line: step, eval and sample
// events, each with "event" and "step").
// Depends on nn/module, nlohmann::json. Keep: every metrics line is a complete JSON object (text
// that is not UTF-8, e.g. a sample, has its invalid bytes replaced by U+FFFD) and is
// flushed when written, so a killed run leaves a readable file; truncate_after() lets a resumed
// run drop the events of steps it is about to redo.
#pragma once
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "blu/nn/module.h"

namespace blu::train {

struct StepStats {
  int64_t step = 0;         // 1-based: the number of optimizer steps done after this one
  int64_t total_steps = 0;
  double loss = 0;          // mean train loss over the step's micro-batches
  double lr = 0;
  double grad_norm = 0;     // global L2 norm before clipping
  double ms = 0;            // wall time of the step
  double tokens_per_s = 0;
  double mfu = 0;           // model FLOPs utilisation per rank, a fraction (0: no peak known)
  int64_t tokens = 0;       // tokens processed by this step (B * T * grad_accum)
  int64_t mem_bytes = 0;    // allocator peak during the step
  int64_t skipped = -1;     // fp16: steps skipped for inf/NaN gradients so far (-1: not fp16)
  double elapsed_s = -1;    // wall time since this run's first step, validation and samples included
  double eta_s = -1;        // the rest of the run at the pace so far (-1: none shown)
};

// "step  12/200 | loss 4.1234 | lr 3.00e-04 | norm 1.23 | 152.3 ms | 3360 tok/s | mem 210 MiB
//  | 0:02 elapsed, ETA 0:31"
std::string format_progress_line(const StepStats& s);
// "1.23 MiB", "512 B", ...
std::string format_bytes(int64_t bytes);
// "0:07", "12:34", "1:02:03"
std::string format_duration(double seconds);
// "124,439,808"
std::string format_count(int64_t n);
// One line per parameter (name, shape, count) and the total.
void print_parameter_table(std::ostream& os, const nn::NamedTensors& params);

class MetricsLog {
 public:
  MetricsLog() = default;  // closed: write() does nothing
  // Opens `path` for appending (creating it).
  explicit MetricsLog(const std::string& path);
  // One line; strings that are not valid UTF-8 are written with U+FFFD for the invalid bytes.
  void write(const nlohmann::json& event);
  bool is_open() const { return out_.is_open(); }
  // Rewrites `path` keeping only events whose "step" is <= step (lines that do not parse are
  // dropped too: a run killed mid-write may leave half a line).
  static void truncate_after(const std::string& path, int64_t step);

 private:
  std::ofstream out_;
  std::string path_;
};

}  // namespace blu::train
