// train/run_record: run.json, the record of a run directory. It holds the options of the latest
// invocation on top ("options", "model_config"), and every invocation of the run with the step it
// started from ("invocations"). A resume reads it twice: the command line takes the options it was
// not given from it (`blutrain train --out RUN --resume` repeats nothing), and the trainer compares
// what it was given with it — an option that changes the training trajectory is refused unless
// the user asks for the change.
// Depends on io/json_file, nlohmann::json.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace blu::train {

// Whether changing this option (a key of TrainOptions::to_json()) on resume changes what the run
// computes from then on: the data, the model, the sequence length, the optimizer and its
// schedule's shape, the seed, the precision. Steps (extending a run is what a resume is for), the
// device, the layout (ranks, ZeRO stage, parallel annotations: the same step, up to summation
// order), logging, validation, sampling, checkpointing and timeouts do not. The batch is compared
// as the global batch (trajectory_changes).
bool changes_trajectory(const std::string& key);

struct OptionChange {
  std::string key;
  nlohmann::json before, after;
  std::string str() const;  // "lr 0.001 -> 0.0005"
};

// The keys of `now` whose value differs from `before`'s (keys `before` lacks are not changes: an
// older run.json simply did not record them).
std::vector<OptionChange> changed_options(const nlohmann::json& before, const nlohmann::json& now);

// The changes of trajectory keys, and of the global batch (batch_size x grad_accum x dp) when both
// sides record it: a resume on other ranks with the same global batch changes nothing.
std::vector<OptionChange> trajectory_changes(const nlohmann::json& before, const nlohmann::json& now);

// The latest invocation's options of run_dir/run.json; null when there is no run.json or it holds
// no options object. A run.json that is not JSON is an error naming it.
nlohmann::json recorded_options(const std::string& run_dir);
// The model config run_dir/run.json records; null when none.
nlohmann::json recorded_model(const std::string& run_dir);
// The number of processes the run's latest invocation ran on; 0 when run.json does not say.
int recorded_world_size(const std::string& run_dir);

// Writes run_dir/run.json (atomically): `options`, the model config and the job's world size on
// top, and the invocations of the run before (those of the existing run.json when `continued`,
// else none) followed by this one, started at from_step.
void write_run_record(const std::string& run_dir, const nlohmann::json& options, const nlohmann::json& model_config,
                      int world_size, int64_t from_step, bool continued);

}  // namespace blu::train
