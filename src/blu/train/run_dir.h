// train/run_dir: what a run directory holds of ours, and where a run in it resumes. The trainer's
// files (metrics.jsonl, run.json, checkpoints in every format, the best-validation copy, flight
// recorder dumps) are the only ones --overwrite removes; a directory holding a run is refused
// unless the invocation resumes or overwrites it; a resume starts from the newest checkpoint that
// verifies and may not change the run's trajectory unless asked (run_record.h).
// Depends on dist/layout_checkpoint, io/json_file, train/run_record. Keep: every check here runs
// before anything is written.
#pragma once
#include <filesystem>
#include <iosfwd>
#include <string>
#include <vector>

namespace blu::train {

struct TrainOptions;

// The copy of the best-validation checkpoint (TrainOptions::keep_best).
inline constexpr const char* kBestCheckpoint = "best.safetensors";

// Files this trainer writes into a run directory, sorted (and so the only ones --overwrite removes).
std::vector<std::filesystem::path> own_files(const std::filesystem::path& dir);

// The run directory already holds a run: a metrics file or checkpoints.
bool holds_run(const std::string& dir);

// Where this invocation's run starts: `from` the checkpoint --resume/--auto-resume continues
// (the newest that verifies; a newer corrupt one is skipped with a warning on `log`), or "";
// `restart` when --auto-resume finds a run of the same model without any checkpoint (it starts
// over). BLU_CHECK, naming the directory and the way out, when the directory holds another run, a
// resume finds nothing to resume, or the invocation changes the run's trajectory without
// --allow-changes.
struct ResumePoint {
  std::string from;
  bool restart = false;
};
ResumePoint find_resume_point(const TrainOptions& o, std::ostream* log);

}  // namespace blu::train
