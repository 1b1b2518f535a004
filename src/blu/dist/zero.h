// dist/zero: ZeRO stages 1 and 2 for AdamW (stage 3, sharded parameters, is not implemented).
// The parameters, in optimizer-group order, are seen as one flat vector of N elements; rank r of
// W owns the contiguous slice [r·S, min((r+1)·S, N)), S = ceil(N / W), and keeps AdamW's moments
// for that slice only (a W-th of the optimizer state per rank).
//   Stage 1 — use with DistributedDataParallel: gradients arrive averaged (DDP's bucketed
//     all-reduce overlapped with backward); step() updates the owned slice of the parameters.
//   Stage 2 — use without DDP (call broadcast_parameters once): gradients are this rank's local
//     ones; reduce_gradients() (called by step() or clip_grad_norm() when not yet done) reduce-
//     scatters their average so each rank keeps only its slice of the averaged gradient, and the
//     parameters' own gradients are released.
//   Both: AdamW on the slice, each parameter's piece with its group's weight decay and the same
//   fp32 kernel as optim's AdamW (adamw_step_), then an all-gather of the updated slices so every
//   rank holds the whole new parameters.
// Sharded checkpoints: <dir>/ckpt_<step, 8 digits>/ holds model.safetensors… (the replicated model
// and TrainState, written by rank 0 through io/checkpoint), optim_<rank>_of_<W>.safetensors (each
// rank's moments with its slice bounds), and COMMIT, written by rank 0 after a barrier once every
// shard is on disk: a directory without COMMIT is ignored. Loading re-slices the moments from all
// shard files, so a checkpoint saved by W ranks resumes on any number of ranks.
// Depends on dist/process_group, optim/optimizer, ops/optim, io/checkpoint. Keep: the update of
// each element is exactly optim's AdamW given the same averaged gradient; every parameter is
// updated every step (bias correction uses the optimizer's step count: DDP gives unused
// parameters a zero gradient, so plain AdamW steps them every step too); parameters are f32.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/io/checkpoint.h"
#include "blu/optim/optimizer.h"

namespace blu::dist {

class ZeroAdamW final : public optim::Optimizer {
 public:
  ZeroAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions options, std::shared_ptr<ProcessGroup> pg,
            int stage);

  // Stage 2: reduce-scatters the average of the local gradients into this rank's slice and drops
  // the parameters' gradients. Stage 1: nothing (DDP has averaged them).
  void reduce_gradients();
  // Global L2 norm of the averaged gradient (the same value on every rank) and clipping to
  // max_norm as optim::clip_grad_norm does; stage 2 reduces first.
  double clip_grad_norm(double max_norm);
  void step() override;

  // This rank's state: "step", "exp_avg" and "exp_avg_sq" (1-d, the owned slice). Loading takes the
  // same layout; a different world size goes through load_sharded_checkpoint.
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;

  int stage() const { return stage_; }
  int64_t total_numel() const { return total_; }
  int64_t shard_begin() const { return begin_; }
  int64_t shard_end() const { return end_; }
  ProcessGroup& process_group() { return *pg_; }

 private:
  friend TrainState load_sharded_checkpoint(const std::string&, nn::Module&, ZeroAdamW&, const nlohmann::json&);
  // The piece of parameter `param` inside the owned slice.
  struct Segment {
    size_t param;
    int64_t param_offset, shard_offset, length;
  };
  struct Param {
    std::string name;
    Tensor tensor;
    double weight_decay;
    int64_t offset;  // in the flat vector
  };
  std::vector<Param> params_;
  std::vector<Segment> segments_;
  optim::AdamWOptions options_;
  std::shared_ptr<ProcessGroup> pg_;
  int stage_;
  int64_t total_ = 0, chunk_ = 0, begin_ = 0, end_ = 0;
  Device device_ = kCPU;         // the parameters' device: shards, state and buffers live there
  Tensor exp_avg_, exp_avg_sq_;  // [end - begin]
  Tensor shard_grad_;            // stage 2: [chunk] averaged gradient of the slice, once reduced
  bool reduced_ = false;
};

// Writes this rank's part of a sharded checkpoint (collective: every rank calls it with the same
// step). Then rank 0 removes all but the newest keep_last committed checkpoints (<= 0: keeps all).
// Returns the checkpoint directory.
std::string save_sharded_checkpoint(const std::string& dir, const nn::Module& model, ZeroAdamW& opt,
                                    const TrainState& st, int keep_last = 0);
// The committed sharded checkpoint with the highest step in dir; "" when none.
std::string latest_sharded_checkpoint(const std::string& dir);
// Loads the model and this rank's slice of the moments, re-slicing when the checkpoint was saved
// by another number of ranks. Checks (before changing anything) that COMMIT exists, that every
// shard file is there and that the flat layout (parameter names and sizes) matches.
TrainState load_sharded_checkpoint(const std::string& ckpt_dir, nn::Module& model, ZeroAdamW& opt,
                                   const nlohmann::json& expected_model_config = nullptr);

}  // namespace blu::dist
