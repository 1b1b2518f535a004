// io/checkpoint: training checkpoints — one safetensors file per save holding the model's state
// dict ("model.<name>"), the optimizer's state ("optim.<name>") and the TrainState (step, RNG,
// loader position, model config, run options) as JSON metadata "train_state", so a run resumes
// bit-exactly. Files are <dir>/ckpt_<step, 8 digits>.safetensors; the newest keep_last are kept.
// Note [Checkpoint format version]: metadata "format_version" is kCheckpointFormatVersion (2);
// a file without it is format 1 (written before versions existed, no checksum) and still loads;
// a higher version is refused with a message naming it. Format 2 adds metadata "checksum", the
// io/checksum hash of every tensor (its name, a NUL byte, its bytes, in name order) followed by
// the "train_state" text, verified on load.
// Depends on io/safetensors (strict reader, atomic writer), io/checksum, nn/module,
// optim/optimizer, nlohmann-json. Keep: a save is atomic (old checkpoints survive any failure, and
// pruning runs only after the new file is in place); a load checks everything it can — file
// validity, version, checksum, config, names, shapes — before it changes anything, and a failed
// load leaves model and optimizer as they were; "latest" means the highest step, never the name.
// Tensors must be on the CPU for now (no device copy op yet: BLU_CHECK says so).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>

#include "blu/nn/module.h"
#include "blu/optim/optimizer.h"

namespace blu {

inline constexpr int kCheckpointFormatVersion = 2;

struct TrainState {
  int64_t step = 0;                       // optimizer steps completed
  uint64_t rng_seed = 0, rng_offset = 0;  // blu::default_generator() state
  nlohmann::json loader;                  // DataLoader::state() JSON
  nlohmann::json model_config;            // CausalLM::config()
  nlohmann::json run;                     // free-form run options (lr schedule, batch, …)
};

// Writes <dir>/ckpt_<step as 8 digits>.safetensors atomically (temp file + fsync + rename, via
// SafeTensorsWriter::write) holding "model.<name>" for every model state_dict entry,
// "optim.<name>" for every optimizer state entry (opt may be null) and metadata key
// "train_state" = TrainState as JSON. Creates dir if needed. Then keeps only the newest keep_last
// checkpoints by step (keep_last <= 0: keep all; the file just written is never removed) and
// removes temporary files that an interrupted save left behind. Returns the path written.
std::string save_checkpoint(const std::string& dir, const nn::Module& model, const optim::Optimizer* opt,
                            const TrainState& st, int keep_last = 3);
// The checkpoint with the highest step in dir; "" when none (or no such directory).
std::string latest_checkpoint(const std::string& dir);
// The step a checkpoint's name carries: "ckpt_<8 to 18 digits>" (a committed directory) or that
// with ".safetensors" (a single file) -> the number; -1 for any other name (temp files included).
int64_t checkpoint_step_of(const std::string& name);
// Checks a checkpoint file without loading it — a valid safetensors file, a known format
// version, the checksum (format 2) — and throws a blu::Error naming the file and what is wrong
// (for a checksum: expected and got).
void verify_checkpoint(const std::string& path);
// Called with one line for each checkpoint that is skipped because it does not verify.
using CheckpointWarning = std::function<void(const std::string&)>;
// The checkpoint with the highest step in dir that verifies; every newer one that does not is
// reported through `warn` and skipped. "" when none verifies.
std::string latest_valid_checkpoint(const std::string& dir, const CheckpointWarning& warn = {});
// The last of `candidates` (sorted by step) that `verify` accepts (it throws on a bad one); every
// later one is reported through `warn` and skipped. "" when none verifies. What the single-file,
// sharded and pipeline checkpoints' "latest" share.
std::string newest_verified(const std::vector<std::pair<int64_t, std::string>>& candidates,
                            const std::function<void(const std::string&)>& verify, const CheckpointWarning& warn);
// Checks the files a COMMIT lists — [{"name", "bytes", "checksum"}, …] in `dir` — exist with their
// size and checksum; BLU_CHECK naming `what`, the file, expected and got.
void verify_listed_files(const std::string& dir, const nlohmann::json& files, const std::string& what);
// Loads model (strict) and optimizer (when non-null), after verify_checkpoint's checks. If expected_model_config is not null, a
// checkpoint whose model_config differs is refused with a BLU_CHECK naming the differing keys and
// both values, BEFORE anything is modified. Returns the TrainState (the caller restores the RNG
// and the loader from it).
TrainState load_checkpoint(const std::string& path, nn::Module& model, optim::Optimizer* opt,
                           const nlohmann::json& expected_model_config = nullptr);

}  // namespace blu
