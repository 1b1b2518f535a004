#include "blu/io/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <span>
#include <string_view>
#include <vector>

#include "blu/io/checksum.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu {

namespace fs = std::filesystem;

namespace {

constexpr const char* kMetaKey = "train_state";
constexpr const char* kModelPrefix = "model.";
constexpr const char* kOptimPrefix = "optim.";
constexpr const char* kVersionKey = "format_version";
constexpr const char* kChecksumKey = "checksum";

// The checksum of Note [Checkpoint format version]: (name, bytes) pairs in any order.
std::string content_checksum(std::vector<std::pair<std::string, std::span<const std::byte>>> tensors,
                             const std::string& train_state) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  io::Checksum sum;
  for (const auto& [name, bytes] : tensors) {
    sum.update(std::string_view(name.c_str(), name.size() + 1));  // the name and its NUL
    sum.update(bytes);
  }
  sum.update(train_state);
  return sum.hex();
}

// The format version in a file's metadata (1 when absent); refuses what this build cannot read.
int format_version(const SafeTensorsFile& f, const std::string& path) {
  auto it = f.metadata().find(kVersionKey);
  if (it == f.metadata().end()) return 1;
  int v = 0;
  try {
    size_t used = 0;
    v = std::stoi(it->second, &used);
    if (used != it->second.size()) v = 0;
  } catch (const std::exception&) {
    v = 0;
  }
  BLU_CHECK(v >= 1, "checkpoint ", path, ": format_version must be a positive integer, got '", it->second, "'");
  BLU_CHECK(v <= kCheckpointFormatVersion, "checkpoint ", path, " has format version ", v,
            "; this build reads versions 1 to ", kCheckpointFormatVersion,
            " (written by a newer BluTrain? load it with that version)");
  return v;
}

// Opens, validates and (format 2) checks the checksum of a checkpoint file.
SafeTensorsFile open_verified(const std::string& path, const char* who) {
  SafeTensorsFile file = [&] {
    try {
      return SafeTensorsFile::open(path);
    } catch (const Error& e) {
      BLU_CHECK(false, who, ": ", path, " is not a readable checkpoint: ", e.what());
      throw;  // unreachable
    }
  }();
  const int version = format_version(file, path);
  auto meta = file.metadata().find(kMetaKey);
  BLU_CHECK(meta != file.metadata().end(), who, ": ", path, " has no '", kMetaKey,
            "' metadata (not a BluTrain checkpoint?)");
  if (version >= 2) {
    auto want = file.metadata().find(kChecksumKey);
    BLU_CHECK(want != file.metadata().end(), who, ": ", path, " (format ", version, ") has no '", kChecksumKey,
              "' metadata");
    std::vector<std::pair<std::string, std::span<const std::byte>>> tensors;
    for (const TensorEntry& e : file.entries()) tensors.emplace_back(e.name, file.bytes(e));
    const std::string got = content_checksum(std::move(tensors), meta->second);
    BLU_CHECK(got == want->second, who, ": checksum mismatch in ", path, ": expected ", want->second, ", got ", got,
              " (the file is corrupt)");
  }
  return file;
}

nlohmann::json train_state_to_json(const TrainState& s) {
  return {{"step", s.step},       {"rng_seed", s.rng_seed},         {"rng_offset", s.rng_offset},
          {"loader", s.loader},   {"model_config", s.model_config}, {"run", s.run}};
}

TrainState train_state_from_json(const nlohmann::json& j, const std::string& path) {
  BLU_CHECK(j.is_object(), "checkpoint ", path, ": metadata '", kMetaKey, "' is not a JSON object");
  for (const char* key : {"step", "rng_seed", "rng_offset", "loader", "model_config", "run"})
    BLU_CHECK(j.contains(key), "checkpoint ", path, ": metadata '", kMetaKey, "' lacks \"", key, "\"");
  BLU_CHECK(j["step"].is_number_integer() && j["step"].get<int64_t>() >= 0, "checkpoint ", path,
            ": train_state.step must be an integer >= 0, got ", j["step"].dump());
  for (const char* key : {"rng_seed", "rng_offset"})
    BLU_CHECK(j[key].is_number_unsigned() || (j[key].is_number_integer() && j[key].get<int64_t>() >= 0),
              "checkpoint ", path, ": train_state.", key, " must be an unsigned integer, got ", j[key].dump());
  TrainState s;
  s.step = j["step"].get<int64_t>();
  s.rng_seed = j["rng_seed"].get<uint64_t>();
  s.rng_offset = j["rng_offset"].get<uint64_t>();
  s.loader = j["loader"];
  s.model_config = j["model_config"];
  s.run = j["run"];
  return s;
}

// "ckpt_00001234.safetensors" -> 1234; -1 for any other name (temp files and directories included).
int64_t checkpoint_step(const std::string& filename) {
  return filename.ends_with(".safetensors") ? checkpoint_step_of(filename) : -1;
}

// (step, path) of every checkpoint in dir, oldest first.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = checkpoint_step(e.path().filename().string());
    if (step >= 0 && e.is_regular_file(ec)) out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Adds each tensor (CPU, made contiguous; kept alive in `keep` until the write) under prefix.
void add_tensors(SafeTensorsWriter& w, const nn::NamedTensors& tensors, const std::string& prefix,
                 std::vector<Tensor>& keep, std::vector<std::pair<std::string, std::span<const std::byte>>>& added,
                 const char* what) {
  for (const auto& [name, t] : tensors) {
    BLU_CHECK(t.defined(), "save_checkpoint: ", what, " tensor '", name, "' is undefined");
    Tensor c = contiguous(to_device(t.detach(), kCPU));  // device tensors are copied to the host
    keep.push_back(c);
    const std::span<const std::byte> bytes{static_cast<const std::byte*>(c.raw_data()), c.nbytes()};
    w.add(prefix + name, c.dtype(), c.shape(), bytes);
    added.emplace_back(prefix + name, bytes);
  }
}

Tensor tensor_from(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

// "n_layer: checkpoint 12, expected 6; vocab_size: checkpoint (absent), expected 50257"
std::string config_diff(const nlohmann::json& got, const nlohmann::json& want) {
  if (!got.is_object() || !want.is_object())
    return got == want ? "" : "model_config: checkpoint " + got.dump() + ", expected " + want.dump();
  std::set<std::string> keys;
  for (auto it = got.begin(); it != got.end(); ++it) keys.insert(it.key());
  for (auto it = want.begin(); it != want.end(); ++it) keys.insert(it.key());
  std::string out;
  for (const std::string& k : keys) {
    const bool in_got = got.contains(k), in_want = want.contains(k);
    if (in_got && in_want && got[k] == want[k]) continue;
    // A config without "family" is GPT-2's (written before other model families existed).
    if (k == "family" && (in_got ? got[k] : want[k]) == "gpt2") continue;
    out += (out.empty() ? "" : "; ") + k + ": checkpoint " + (in_got ? got[k].dump() : "(absent)") + ", expected " +
           (in_want ? want[k].dump() : "(absent)");
  }
  return out;
}

}  // namespace

int64_t checkpoint_step_of(const std::string& name) {
  if (name.rfind("ckpt_", 0) != 0) return -1;
  std::string digits = name.substr(5);
  if (digits.ends_with(".safetensors")) digits.resize(digits.size() - 12);
  if (digits.size() < 8 || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

std::string save_checkpoint(const std::string& dir, const nn::Module& model, const optim::Optimizer* opt,
                            const TrainState& st, int keep_last) {
  BLU_CHECK(st.step >= 0, "save_checkpoint: step must be >= 0, got ", st.step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  BLU_CHECK(!ec && fs::is_directory(dir), "save_checkpoint: cannot create directory '", dir, "'",
            ec ? ": " + ec.message() : std::string());
  char name[64];
  std::snprintf(name, sizeof name, "ckpt_%08lld.safetensors", static_cast<long long>(st.step));
  const std::string path = (fs::path(dir) / name).string();

  // Temporary files of saves that were cut short (the writer's mkstemp names).
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with("ckpt_") && n.find(".safetensors.tmp.") != std::string::npos) fs::remove(e.path(), ec);
  }

  SafeTensorsWriter w;
  std::vector<Tensor> keep;
  std::vector<std::pair<std::string, std::span<const std::byte>>> added;
  add_tensors(w, model.state_dict(), kModelPrefix, keep, added, "model");
  if (opt) add_tensors(w, opt->state(), kOptimPrefix, keep, added, "optimizer");
  const std::string state = train_state_to_json(st).dump();
  w.set_metadata(kMetaKey, state);
  w.set_metadata(kVersionKey, std::to_string(kCheckpointFormatVersion));
  w.set_metadata(kChecksumKey, content_checksum(std::move(added), state));
  w.write(path);  // atomic; on failure it throws and nothing below runs

  if (keep_last > 0) {
    auto all = list_checkpoints(dir);
    std::erase_if(all, [&](const auto& c) { return fs::equivalent(c.second, path, ec); });
    // The new file counts as one of the kept.
    const size_t keep_others = size_t(keep_last - 1);
    for (size_t i = 0; i + keep_others < all.size(); ++i) fs::remove(all[i].second, ec);
  }
  return path;
}

std::string latest_checkpoint(const std::string& dir) {
  auto all = list_checkpoints(dir);
  return all.empty() ? std::string() : all.back().second;
}

void verify_checkpoint(const std::string& path) { open_verified(path, "verify_checkpoint"); }

std::string newest_verified(const std::vector<std::pair<int64_t, std::string>>& candidates,
                            const std::function<void(const std::string&)>& verify, const CheckpointWarning& warn) {
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    try {
      verify(it->second);
      return it->second;
    } catch (const std::exception& e) {
      if (warn)
        warn("warning: skipping checkpoint " + it->second + " (step " + std::to_string(it->first) + "): " + e.what() +
             (it + 1 != candidates.rend() ? "; trying the previous one" : ""));
    }
  }
  return "";
}

void verify_listed_files(const std::string& dir, const nlohmann::json& files, const std::string& what) {
  for (const auto& f : files) {
    BLU_CHECK(f.is_object() && f.contains("name") && f["name"].is_string() && f.contains("bytes") &&
                  f["bytes"].is_number_unsigned() && f.contains("checksum") && f["checksum"].is_string(),
              what, " ", dir, ": COMMIT lists ", f.dump(),
              "; expected {\"name\": a file name, \"bytes\": a size, \"checksum\": a string}");
    const std::string name = f.at("name").get<std::string>();
    BLU_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", what, " ", dir,
              ": COMMIT lists a bad file name '", name, "'");
    const fs::path p = fs::path(dir) / name;
    std::error_code ec;  // a name the file system refuses (too long, ...) is an error here, not a throw
    const bool present = fs::exists(p, ec);
    BLU_CHECK(!ec, what, " ", dir, ": COMMIT lists a file name the file system refuses ('", name.substr(0, 64),
              name.size() > 64 ? "...'" : "'", ", ", name.size(), " bytes): ", ec.message());
    BLU_CHECK(present, what, ": ", p.string(), " is missing (listed in its COMMIT)");
    const io::FileDigest got = io::digest_file(p);
    const uint64_t want_bytes = f.at("bytes").get<uint64_t>();
    BLU_CHECK(got.bytes == want_bytes, what, ": ", p.string(), " has ", got.bytes, " bytes, expected ", want_bytes,
              " (truncated or overwritten)");
    const std::string want = f.at("checksum").get<std::string>();
    BLU_CHECK(got.checksum == want, what, ": checksum mismatch in ", p.string(), ": expected ", want, ", got ",
              got.checksum, " (the file is corrupt)");
  }
}

std::string latest_valid_checkpoint(const std::string& dir, const CheckpointWarning& warn) {
  return newest_verified(list_checkpoints(dir), [](const std::string& p) { verify_checkpoint(p); }, warn);
}

TrainState load_checkpoint(const std::string& path, nn::Module& model, optim::Optimizer* opt,
                           const nlohmann::json& expected_model_config) {
  // The reader validates the whole file (header, offsets, sizes), its version and its checksum
  // before anything is used.
  SafeTensorsFile file = open_verified(path, "load_checkpoint");
  auto meta = file.metadata().find(kMetaKey);
  nlohmann::json j = nlohmann::json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
  BLU_CHECK(!j.is_discarded(), "load_checkpoint: ", path, ": metadata '", kMetaKey, "' is not valid JSON");
  TrainState st = train_state_from_json(j, path);
  if (!expected_model_config.is_null()) {
    const std::string diff = config_diff(st.model_config, expected_model_config);
    BLU_CHECK(diff.empty(), "load_checkpoint: ", path, " was written for another model configuration: ", diff);
  }

  nn::NamedTensors model_state, optim_state;
  for (const TensorEntry& e : file.entries()) {
    if (e.name.rfind(kModelPrefix, 0) == 0)
      model_state.emplace_back(e.name.substr(std::strlen(kModelPrefix)), tensor_from(file, e));
    else if (e.name.rfind(kOptimPrefix, 0) == 0)
      optim_state.emplace_back(e.name.substr(std::strlen(kOptimPrefix)), tensor_from(file, e));
    else
      BLU_CHECK(false, "load_checkpoint: ", path, ": unexpected tensor '", e.name, "' (expected names starting with '",
                kModelPrefix, "' or '", kOptimPrefix, "')");
  }
  // Each load is strict and changes nothing when it fails. The optimizer goes first: if the model
  // then refuses its state, the optimizer gets its old state back (load_state made new tensors,
  // so the handles saved here still hold the old values).
  if (opt) {
    const nn::NamedTensors previous = opt->state();
    opt->load_state(optim_state);
    try {
      model.load_state_dict(model_state);
    } catch (...) {
      opt->load_state(previous);
      throw;
    }
  } else {
    model.load_state_dict(model_state);
  }
  return st;
}

}  // namespace blu
