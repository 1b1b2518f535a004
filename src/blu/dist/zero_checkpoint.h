// dist/zero_checkpoint: ZeRO's sharded checkpoints. <dir>/ckpt_<step, 8 digits>/ holds
// ckpt_<step>.safetensors (the replicated model and TrainState, written by rank 0 through
// io/checkpoint), optim_<rank>_of_<W>.safetensors (each rank's moments with the flat ranges of its
// shard), and COMMIT, written by rank 0 once every rank reported its shard on disk, through
// io/json_file's atomic write, with each file's size and checksum and a format version (Note
// [Sharded checkpoint format], zero_checkpoint.cpp). A directory without COMMIT is ignored, and
// removed by the next save; older checkpoints are pruned only after COMMIT is durable; "latest" is
// the highest step that verifies. Loading re-slices the moments from all shard files, so a
// checkpoint saved by W ranks (any stage) resumes on any number of ranks and under any stage.
// Depends on dist/zero, io/checkpoint, io/checksum, io/json_file, optim/state_io.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "blu/dist/zero.h"
#include "blu/io/checkpoint.h"

namespace blu::dist {

// Writes this rank's part of a sharded checkpoint (collective: every rank calls it with the same
// step). Then rank 0 commits it and removes all but the newest keep_last committed checkpoints
// (<= 0: keeps all). A failure on any rank (a full disk, say) is an error on every rank, and the
// checkpoints committed before stay. Returns the checkpoint directory.
std::string save_sharded_checkpoint(const std::string& dir, const nn::Module& model, ZeroAdamW& opt,
                                    const TrainState& st, int keep_last = 0);
// Checks a sharded checkpoint without loading it: COMMIT (present, not empty, a known version) and
// each file it lists (present, its size, its checksum); throws an error naming the file and what
// differs (expected and got).
void verify_sharded_checkpoint(const std::string& ckpt_dir);
// The committed sharded checkpoint with the highest step in dir that verifies; every newer one
// that does not is reported through `warn` and skipped. "" when none.
std::string latest_sharded_checkpoint(const std::string& dir, const CheckpointWarning& warn = {});
// Loads the model and this rank's slice of the moments, re-slicing when the checkpoint was saved
// by another number of ranks. Checks (before changing anything) what verify_sharded_checkpoint
// checks and that the flat layout (parameter names and sizes) matches.
TrainState load_sharded_checkpoint(const std::string& ckpt_dir, nn::Module& model, ZeroAdamW& opt,
                                   const nlohmann::json& expected_model_config = nullptr);

}  // namespace blu::dist
