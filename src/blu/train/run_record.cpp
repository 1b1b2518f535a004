#include "blu/train/run_record.h"

#include <array>
#include <filesystem>
#include <string_view>

#include "blu/io/json_file.h"

namespace blu::train {

namespace fs = std::filesystem;

bool changes_trajectory(const std::string& key) {
  static constexpr std::array<std::string_view, 16> kKeys = {
      "train_pattern", "model",     "seq_len",   "shuffle", "lr",    "min_lr",      "warmup", "schedule",
      "weight_decay",  "grad_clip", "optimizer", "beta1",   "beta2", "adamw_state", "seed",   "precision"};
  for (std::string_view k : kKeys)
    if (k == key) return true;
  return false;
}

std::string OptionChange::str() const { return key + " " + before.dump() + " -> " + after.dump(); }

std::vector<OptionChange> changed_options(const nlohmann::json& before, const nlohmann::json& now) {
  std::vector<OptionChange> changes;
  if (!before.is_object() || !now.is_object()) return changes;
  for (const auto& [key, value] : now.items())
    if (before.contains(key) && before[key] != value) changes.push_back({key, before[key], value});
  return changes;
}

std::vector<OptionChange> trajectory_changes(const nlohmann::json& before, const nlohmann::json& now) {
  std::vector<OptionChange> out;
  for (OptionChange& c : changed_options(before, now))
    if (changes_trajectory(c.key)) out.push_back(std::move(c));
  const auto global_batch = [](const nlohmann::json& o) -> nlohmann::json {
    int64_t n = 1;
    for (const char* k : {"batch_size", "grad_accum", "dp"}) {
      if (!o.is_object() || !o.contains(k) || !o[k].is_number_integer()) return nullptr;
      n *= o[k].get<int64_t>();
    }
    return n;
  };
  const nlohmann::json a = global_batch(before), b = global_batch(now);
  if (!a.is_null() && !b.is_null() && a != b) out.push_back({"global batch (batch_size x grad_accum x dp)", a, b});
  return out;
}

namespace {

nlohmann::json read_record(const std::string& run_dir) {
  const fs::path p = fs::path(run_dir) / "run.json";
  if (run_dir.empty() || !fs::exists(p)) return nullptr;
  nlohmann::json j = io::read_json_file(p);
  return j.is_object() ? j : nlohmann::json();
}

}  // namespace

nlohmann::json recorded_options(const std::string& run_dir) {
  const nlohmann::json j = read_record(run_dir);
  if (j.is_null()) return nullptr;
  if (j.contains("options") && j["options"].is_object()) return j["options"];
  return nullptr;
}

nlohmann::json recorded_model(const std::string& run_dir) {
  const nlohmann::json j = read_record(run_dir);
  if (j.is_null()) return nullptr;
  if (j.contains("model_config") && j["model_config"].is_object()) return j["model_config"];
  return nullptr;
}

int recorded_world_size(const std::string& run_dir) {
  const nlohmann::json j = read_record(run_dir);
  if (j.is_null() || !j.contains("world_size") || !j["world_size"].is_number_integer()) return 0;
  return j["world_size"].get<int>();
}

void write_run_record(const std::string& run_dir, const nlohmann::json& options, const nlohmann::json& model_config,
                      int world_size, int64_t from_step, bool continued) {
  nlohmann::json invocations = nlohmann::json::array();
  if (continued) {
    const nlohmann::json old = read_record(run_dir);
    if (old.contains("invocations") && old["invocations"].is_array())
      invocations = old["invocations"];
    else if (old.contains("options"))  // a run.json from before invocations were kept
      invocations.push_back({{"from_step", nullptr}, {"options", old["options"]}});
  }
  invocations.push_back({{"from_step", from_step}, {"options", options}});
  io::write_json_file(fs::path(run_dir) / "run.json", {{"blutrain_version", BLU_VERSION},
                                                        {"model_config", model_config},
                                                        {"world_size", world_size},
                                                        {"options", options},
                                                        {"invocations", invocations}});
}

}  // namespace blu::train
