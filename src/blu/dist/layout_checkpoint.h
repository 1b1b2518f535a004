// dist/layout_checkpoint: one checkpoint format for every parallel layout — each rank writes its
// pieces of the global tensors (io/global_tensors: a box for a tensor-parallel shard or a whole
// tensor, a flat range for a ZeRO shard), and any layout on any number of ranks reads the boxes
// and ranges it holds now. Note [Layout checkpoint format]:
//   <dir>/ckpt_<step, 8 digits>/pieces_<file rank, 5 digits>.safetensors — one file per process
//     (possibly holding no piece), with the global names
//       "model.<param>"            the fp32 (master) parameter,
//       "optim.<kind>.<param>"     the optimizer's per-parameter state: AdamW's exp_avg and
//                                  exp_avg_sq (the parameter's global shape, the same box or range
//                                  as the parameter's piece) and step (0-d: that parameter's update
//                                  count); SGD's momentum buffers likewise,
//       "optim.step"               the optimizer's step count (0-d), written once;
//     every global tensor covered exactly once over all files;
//   train_state.json — the scalar state once (TrainState: step, RNG, loader position, model
//     config, run options) and the writer's layout ("layout": name, ranks, tp, pp, zero);
//   COMMIT — {"format": "blutrain.layout_checkpoint", "format_version": 3, "step", "layout",
//     "files": [{"name", "bytes", "checksum"}, …]} naming train_state.json and every pieces file,
//     written last by file rank 0 through io/json_file's durable write (temp, fsync, rename,
//     directory fsync) once every rank's file is on disk. Version 3 continues the numbering of the
//     single-file (2), ZeRO-sharded (2) and pipeline (2) formats, whose readers refuse it by
//     version.
// A directory without COMMIT, or whose COMMIT does not verify, is never loaded; "latest" is the
// highest step that verifies over every format in the directory (latest_any_checkpoint).
// Depends on io/global_tensors, io/checkpoint (TrainState, newest_verified, verify_listed_files),
// io/json_file, io/checksum, dist/process_group, dist/zero (ZeRO's flat layout), optim/. Keep:
// pieces are written as they are (fp32 master weights and moments, no conversion); a load checks
// COMMIT, every file's size and checksum, the model config and every tensor's global shape before
// it changes anything; each reader assembles one tensor at a time (peak host memory about the
// largest tensor, plus ZeRO-3's gathered model while it loads).
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "blu/io/checkpoint.h"
#include "blu/io/global_tensors.h"
#include "blu/optim/optimizer.h"

namespace blu::dist {

class ZeroAdamW;

inline constexpr int kLayoutCheckpointFormatVersion = 3;
inline constexpr const char* kLayoutCheckpointFormat = "blutrain.layout_checkpoint";

// A parameter this rank holds, with its place in the global tensor: a box per segment along `dim`
// ((start, length) each, the local tensor being the segments concatenated along dim in order: a
// tensor-parallel shard, GPT-2's fused q|k|v three of them), or the whole tensor (dim -1).
struct HeldParameter {
  std::string name;             // global name
  Tensor local;                 // the tensor this rank trains
  std::vector<int64_t> global_shape;
  int64_t dim = -1;
  std::vector<std::pair<int64_t, int64_t>> segments;
  bool write = true;  // this rank writes its pieces (of a replicated tensor exactly one rank does)
};

// The processes that write one checkpoint together: every one calls save with the same step.
struct CheckpointRanks {
  int file_rank = 0;  // this process's pieces file; file rank 0 commits
  int files = 1;      // the processes writing (file ranks 0 .. files-1)
  // Collective over all writers (an empty function on a single process): the number of ranks that
  // pass true, returned on every rank once every rank has called it — a barrier that also tells
  // every rank whether another failed, so a failure on one rank is an error on all.
  std::function<int(bool failed)> count_failed;
};

// The pieces of `held` (those with write) and of the plain optimizer state `opt_state` (its
// "<kind>.<param>" entries shaped like the local parameter get the parameter's pieces, 0-d ones are
// whole); with `global_step`, "optim.step".
std::vector<GlobalPiece> held_pieces(const std::vector<HeldParameter>& held, const nn::NamedTensors& opt_state,
                                     bool global_step);
// ZeRO-1/2/3: this rank's flat ranges of every parameter ("model.*") and of the moments, file rank
// 0 also "optim.step" and every "optim.step.<param>". Collective (stage 3 gathers the parameters).
std::vector<GlobalPiece> zero_pieces(ZeroAdamW& opt, bool first);

// Writes this rank's pieces and (file rank 0) train_state.json and COMMIT; removes an earlier save
// of the same step and saves that were cut short first, and prunes all but the newest keep_last
// checkpoints of any format after the commit (<= 0: keep all). A failure on any rank (a full disk)
// is an error on every rank, and the checkpoints committed before stay. Returns the checkpoint
// directory.
std::string save_layout_checkpoint(const std::string& dir, const CheckpointRanks& ranks,
                                   const std::vector<GlobalPiece>& pieces, const TrainState& st,
                                   const nlohmann::json& layout, int keep_last);

// Whether `path` is a directory whose COMMIT names this format (it may still fail to verify).
bool is_layout_checkpoint(const std::string& path);
// COMMIT (present, this format, a known version) and every file it lists (size, checksum), and no
// pieces file that COMMIT does not list; BLU_CHECK naming the file, expected and got.
void verify_layout_checkpoint(const std::string& ckpt_dir);
// The newest checkpoint in `dir` of any format — single-file (io/checkpoint), ZeRO-sharded
// (dist/zero), pipeline (dist/pipeline), layout — that verifies, by step; each newer one that does
// not is reported through warn. "" when none.
std::string latest_any_checkpoint(const std::string& dir, const CheckpointWarning& warn = {});
// "layout checkpoint (format 3)", "single-file checkpoint (format 2)", "ZeRO-sharded checkpoint
// (format 2)", "pipeline checkpoint (format 2)": for messages and `blutrain info`.
std::string describe_checkpoint_format(const std::string& path);

// The global tensors of a checkpoint by name ("model.<param>", "optim.<kind>.<param>",
// "optim.step"): a layout checkpoint's pieces, or the whole tensors of a single-file checkpoint
// (io/checkpoint) or of a pipeline checkpoint's stage files (dist/pipeline), which use the same
// names. box() and range() of whole tensors read the tensor and cut it.
class CheckpointTensors {
 public:
  virtual ~CheckpointTensors() = default;
  virtual std::vector<std::string> names() const = 0;  // sorted
  virtual bool contains(const std::string& name) const = 0;
  virtual std::vector<int64_t> global_shape(const std::string& name) const = 0;
  virtual DType dtype(const std::string& name) const = 0;
  virtual Tensor full(const std::string& name) const = 0;
  virtual Tensor box(const std::string& name, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& shape) const = 0;
  virtual Tensor range(const std::string& name, int64_t begin, int64_t count) const = 0;
};

// A verified checkpoint open for loading under any layout: a layout checkpoint, a single-file
// checkpoint (formats 1 and 2) or a pipeline checkpoint (formats 1 and 2). A ZeRO-sharded
// checkpoint (its moments are flat shards of the optimizer's own order) is refused with its format
// and version: it loads under ZeRO only (dist/zero.h).
class LayoutCheckpoint {
 public:
  // Verifies (COMMIT, sizes, checksums), then indexes every file. A non-null
  // expected_model_config must equal the checkpoint's (BLU_CHECK naming both).
  explicit LayoutCheckpoint(const std::string& path, const nlohmann::json& expected_model_config = nullptr);
  ~LayoutCheckpoint();
  const std::string& dir() const { return dir_; }
  const TrainState& train_state() const { return state_; }
  // The writer's layout (null for the formats that did not record it).
  const nlohmann::json& layout() const { return layout_; }
  const CheckpointTensors& tensors() const { return *tensors_; }

  // Checks every held parameter is in the checkpoint with its global shape and dtype (nothing
  // changes on failure), then copies this rank's boxes of the parameters and of the plain
  // optimizer's state into `held` and `opt` (null: the parameters only).
  void load_held(const std::vector<HeldParameter>& held, optim::Optimizer* opt) const;
  // ZeRO-1/2/3: every parameter (stage 3 gathers them and keeps its chunks) and this rank's flat
  // ranges of the moments. Collective under stage 3.
  void load_zero(ZeroAdamW& opt) const;

 private:
  std::string dir_;
  TrainState state_;
  nlohmann::json layout_;
  std::unique_ptr<CheckpointTensors> tensors_;
};

}  // namespace blu::dist
