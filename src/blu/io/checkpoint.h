// io/checkpoint: training checkpoints — one safetensors file per save holding the model's state
// dict ("model.<name>"), the optimizer's state ("optim.<name>") and the TrainState (step, RNG,
// loader position, model config, run options) as JSON metadata "train_state", so a run resumes
// bit-exactly. Files are <dir>/ckpt_<step, 8 digits>.safetensors; the newest keep_last are kept.
// Depends on io/safetensors (strict reader, atomic writer), nn/module, optim/optimizer,
// nlohmann-json. Keep: a save is atomic (old checkpoints survive any failure, and pruning runs only
// after the new file is in place); a load checks everything it can — file validity, config, names,
// shapes — before it changes anything, and a failed load leaves model and optimizer as they were.
// Tensors must be on the CPU for now (no device copy op yet: BLU_CHECK says so).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "blu/nn/module.h"
#include "blu/optim/optimizer.h"

namespace blu {

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
// checkpoints by step (keep_last <= 0: keep all; the file just written is never removed).
// Returns the path written.
std::string save_checkpoint(const std::string& dir, const nn::Module& model, const optim::Optimizer* opt,
                            const TrainState& st, int keep_last = 3);
// The checkpoint with the highest step in dir; "" when none (or no such directory).
std::string latest_checkpoint(const std::string& dir);
// Loads model (strict) and optimizer (when non-null). If expected_model_config is not null, a
// checkpoint whose model_config differs is refused with a BLU_CHECK naming the differing keys and
// both values, BEFORE anything is modified. Returns the TrainState (the caller restores the RNG
// and the loader from it).
TrainState load_checkpoint(const std::string& path, nn::Module& model, optim::Optimizer* opt,
                           const nlohmann::json& expected_model_config = nullptr);

}  // namespace blu
