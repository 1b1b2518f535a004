// train/run_dir: the run directory's own files and the point a run resumes from.
#include "blu/train/run_dir.h"

#include <algorithm>
#include <ostream>

#include "blu/core/error.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/io/checkpoint.h"
#include "blu/io/json_file.h"
#include "blu/train/run_record.h"
#include "blu/train/trainer.h"

namespace blu::train {

namespace fs = std::filesystem;

namespace {

bool is_checkpoint_file(const fs::path& p) {
  const std::string name = p.filename().string();
  return name.starts_with("ckpt_") && name.ends_with(".safetensors");
}

}  // namespace

// Files this trainer writes into a run directory (and so the only ones --overwrite removes).
std::vector<fs::path> own_files(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "metrics.jsonl" || name == "run.json" || name == kBestCheckpoint || is_checkpoint_file(e.path()) ||
        (e.is_directory() && name.starts_with("ckpt_")) ||  // a sharded checkpoint (dist/zero.h)
        (e.is_directory() && name == "flight_recorder"))    // dist/flight_recorder.h
      out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool holds_run(const std::string& dir) {
  if (dir.empty() || !fs::is_directory(dir)) return false;
  for (const auto& p : own_files(dir))
    if (p.filename() == "metrics.jsonl" || p.filename().string().starts_with("ckpt_")) return true;
  return false;
}

ResumePoint find_resume_point(const TrainOptions& o, std::ostream* log) {
  std::string resume_from;
  bool restart = false;
  if (!o.out.empty()) {
    if (o.resume || o.auto_resume) {
      // The newest checkpoint that verifies; a corrupt or truncated newer one is skipped with a
      // warning (rank 0 prints it).
      std::vector<std::string> skipped;
      const CheckpointWarning warn = [&](const std::string& w) {
        skipped.push_back(w);
        if (log) *log << w << "\n" << std::flush;
      };
      // Any format: every layout loads a layout checkpoint and a single file (dist/layout_checkpoint.h).
      resume_from = dist::latest_any_checkpoint(o.out, warn);
      std::string reasons;
      for (const std::string& w : skipped) reasons += "\n  " + w;
      BLU_CHECK(!resume_from.empty() || skipped.empty(), o.resume ? "--resume" : "--auto-resume",
                ": no checkpoint in ", o.out, " verifies:", reasons);
      BLU_CHECK(!o.resume || !resume_from.empty(), "--resume: expected a checkpoint (ckpt_*.safetensors or a "
                "committed ckpt_*/COMMIT) in ", o.out, ", found none");
      if (resume_from.empty() && holds_run(o.out)) {
        const fs::path run_json = fs::path(o.out) / "run.json";
        nlohmann::json saved;
        if (fs::exists(run_json)) saved = io::read_json_file(run_json).value("model_config", nlohmann::json());
        BLU_CHECK(saved == o.model, "--auto-resume: the run directory ", o.out,
                  " holds a run without a checkpoint whose run.json ",
                  saved.is_null() ? std::string("is missing or names no model") : "names another model (" + saved.dump() + ")",
                  "; pass --overwrite to replace it or choose another --out");
        restart = true;
      }
    } else {
      BLU_CHECK(o.overwrite || !holds_run(o.out), "the run directory ", o.out,
                " already holds a run (metrics.jsonl or checkpoints): pass --auto-resume to continue it (from its "
                "newest valid checkpoint, or from the start when it has none), --overwrite to replace it, or choose "
                "another --out");
    }
  } else {
    BLU_CHECK(!o.resume && !o.auto_resume, "--resume and --auto-resume need --out (the run directory)");
  }
  // A resume continues the run: an option that changes its trajectory must be asked for.
  if (!resume_from.empty() || restart) {
    std::string refused;
    for (const OptionChange& c : trajectory_changes(recorded_options(o.out), o.to_json()))
      refused += (refused.empty() ? "" : ", ") + c.str();
    BLU_CHECK(refused.empty() || o.allow_changes, o.resume ? "--resume" : "--auto-resume", ": the run in ", o.out,
              " was trained with other options than this invocation gives (", refused,
              "); a resume takes every option it is not given from the run's run.json, so drop these flags to "
              "continue the run as it was, or pass --allow-changes to continue it with the new values");
  }
  return {resume_from, restart};
}

}  // namespace blu::train
