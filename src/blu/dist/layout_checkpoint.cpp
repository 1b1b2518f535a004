#include "blu/dist/layout_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/zero.h"
#include "blu/dist/zero_checkpoint.h"
#include "blu/io/checksum.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace blu::dist {

namespace fs = std::filesystem;

namespace {

constexpr const char* kCommit = "COMMIT";
constexpr const char* kStateFile = "train_state.json";

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "ckpt_%08lld", static_cast<long long>(step));
  return buf;
}

std::string pieces_file_name(int rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "pieces_%05d.safetensors", rank);
  return buf;
}

// Every checkpoint of `dir` by step: committed directories and single files (any format).
std::vector<std::pair<int64_t, std::string>> all_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = checkpoint_step_of(e.path().filename().string());
    if (step < 0) continue;
    if (e.is_directory(ec) ? fs::exists(e.path() / kCommit) : e.path().extension() == ".safetensors")
      out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

nlohmann::json state_json(const TrainState& s) {
  return {{"step", s.step},     {"rng_seed", s.rng_seed},         {"rng_offset", s.rng_offset},
          {"loader", s.loader}, {"model_config", s.model_config}, {"run", s.run}};
}

// A whole tensor as one piece (0-d tensors as a one-element range: a box needs a dimension).
GlobalPiece whole_piece(const std::string& name, const Tensor& t) {
  if (t.dim() == 0) return GlobalPiece{name, {}, {}, 0, reshape(t.detach(), {1})};
  return GlobalPiece{name, t.shape(), std::vector<int64_t>(size_t(t.dim()), 0), -1, t.detach()};
}

// The pieces of `t` laid out as `p`'s local tensor (its segments along p.dim, or whole).
void add_like(std::vector<GlobalPiece>& out, const std::string& name, const Tensor& t, const HeldParameter& p) {
  if (p.dim < 0) return out.push_back(whole_piece(name, t));
  int64_t at = 0;
  for (const auto& [start, length] : p.segments) {
    std::vector<int64_t> offset(p.global_shape.size(), 0);
    offset[size_t(p.dim)] = start;
    out.push_back(GlobalPiece{name, p.global_shape, offset, -1, narrow(t.detach(), p.dim, at, length)});
    at += length;
  }
}

// This rank's part of global tensor `name` laid out as `p`'s local tensor, on the CPU.
Tensor read_like(const CheckpointTensors& r, const std::string& name, const HeldParameter& p) {
  if (p.dim < 0) return r.full(name);
  std::vector<Tensor> parts;
  for (const auto& [start, length] : p.segments) {
    std::vector<int64_t> offset(p.global_shape.size(), 0), shape = p.global_shape;
    offset[size_t(p.dim)] = start;
    shape[size_t(p.dim)] = length;
    parts.push_back(r.box(name, offset, shape));
  }
  return parts.size() == 1 ? parts[0] : cat(parts, p.dim);
}

// ZeRO's parameters in optimizer-group order with their flat offsets.
struct FlatParam {
  std::string name;
  Tensor tensor;
  int64_t offset;
};
std::vector<FlatParam> flat_params(const ZeroAdamW& opt) {
  std::vector<FlatParam> out;
  int64_t at = 0;
  for (const auto& g : opt.groups())
    for (const auto& [name, t] : g.params) {
      out.push_back({name, t, at});
      at += t.numel();
    }
  return out;
}

// Calls f(param, begin in the parameter, begin in the shard, count) for every overlap of this
// rank's flat ranges with a parameter.
template <class F>
void for_each_overlap(const std::vector<FlatParam>& params, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                      F&& f) {
  int64_t pos = 0;
  for (const auto& [off, len] : ranges) {
    for (const FlatParam& p : params) {
      const int64_t lo = std::max(off, p.offset), hi = std::min(off + len, p.offset + p.tensor.numel());
      if (lo < hi) f(p, lo - p.offset, pos + (lo - off), hi - lo);
    }
    pos += len;
  }
}

}  // namespace

std::vector<GlobalPiece> held_pieces(const std::vector<HeldParameter>& held, const nn::NamedTensors& opt_state,
                                     bool global_step) {
  std::vector<GlobalPiece> out;
  std::map<std::string, const HeldParameter*> by_name;
  for (const HeldParameter& p : held) {
    by_name.emplace(p.name, &p);
    if (p.write) add_like(out, "model." + p.name, p.local, p);
  }
  for (const auto& [key, t] : opt_state) {
    if (key == "step") {
      if (global_step) out.push_back(whole_piece("optim.step", t));
      continue;
    }
    const size_t dot = key.find('.');
    BLU_CHECK(dot != std::string::npos, "layout checkpoint: optimizer state '", key,
              "' is neither \"step\" nor \"<kind>.<parameter>\"");
    const auto it = by_name.find(key.substr(dot + 1));
    BLU_CHECK(it != by_name.end(), "layout checkpoint: optimizer state '", key, "' names no parameter held here");
    if (!it->second->write) continue;
    if (t.dim() == 0) out.push_back(whole_piece("optim." + key, t));
    else add_like(out, "optim." + key, t, *it->second);
  }
  return out;
}

std::vector<GlobalPiece> zero_pieces(ZeroAdamW& opt, bool first) {
  opt.gather_full();  // stage 3: the parameters readable (collective); stages 1 and 2 hold them
  std::vector<GlobalPiece> out;
  try {
    const std::vector<FlatParam> params = flat_params(opt);
    const nn::NamedTensors state = opt.state();  // step, exp_avg, exp_avg_sq
    std::map<std::string, Tensor> s(state.begin(), state.end());
    for_each_overlap(params, opt.shard_ranges(), [&](const FlatParam& p, int64_t begin, int64_t at, int64_t n) {
      const std::vector<int64_t> gshape = p.tensor.shape();
      // A copy: stage 3 releases the gathered storage below.
      out.push_back({"model." + p.name, gshape, {}, begin, clone(narrow(reshape(p.tensor.detach(), {-1}), 0, begin, n))});
      for (const char* kind : {"exp_avg", "exp_avg_sq"})
        out.push_back({std::string("optim.") + kind + "." + p.name, gshape, {}, begin, narrow(s.at(kind), 0, at, n)});
    });
    if (first) {
      out.push_back(whole_piece("optim.step", s.at("step")));
      for (const FlatParam& p : params)  // ZeRO updates every parameter every step
        out.push_back(whole_piece("optim.step." + p.name, optim::detail::count_tensor(opt.steps())));
    }
  } catch (...) {
    opt.release_full();
    throw;
  }
  opt.release_full();
  return out;
}

std::string save_layout_checkpoint(const std::string& dir, const CheckpointRanks& ranks,
                                   const std::vector<GlobalPiece>& pieces, const TrainState& st,
                                   const nlohmann::json& layout, int keep_last) {
  BLU_CHECK(ranks.files >= 1 && ranks.file_rank >= 0 && ranks.file_rank < ranks.files,
            "layout checkpoint: file rank ", ranks.file_rank, " of ", ranks.files, " writers");
  // Each phase ends with every rank learning whether any rank failed it.
  std::string error;
  const auto attempt = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  const auto failures = [&] { return ranks.count_failed ? ranks.count_failed(!error.empty()) : int(!error.empty()); };
  const auto why = [&](const char* others) { return error.empty() ? std::string(others) : error; };
  const fs::path step_dir = fs::path(dir) / step_dir_name(st.step);
  if (ranks.file_rank == 0)
    attempt([&] {  // an earlier save of this step (it may hold another layout's files) and saves cut short
      fs::create_directories(dir);
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_directory() && checkpoint_step_of(e.path().filename().string()) >= 0 &&
            (e.path() == step_dir || !fs::exists(e.path() / kCommit)))
          fs::remove_all(e.path());
    });
  BLU_CHECK(failures() == 0, "layout checkpoint: cannot prepare ", step_dir.string(), ": ",
            why("rank 0 failed (see its error)"));
  attempt([&] {
    fs::create_directories(step_dir);
    write_pieces(step_dir.string(), ranks.file_rank, pieces);
    if (ranks.file_rank == 0) {
      nlohmann::json js = state_json(st);
      js["layout"] = layout;
      io::write_json_file(step_dir / kStateFile, js);
    }
  });
  const int failed = failures();  // every rank's file is on disk, or not
  BLU_CHECK(failed == 0, "layout checkpoint: ", step_dir.string(), " is incomplete and not committed: ",
            why("rank(s) could not write their part (see their errors)"));
  if (ranks.file_rank == 0)
    attempt([&] {
      nlohmann::json files = nlohmann::json::array();
      std::vector<std::string> names{kStateFile};
      for (int q = 0; q < ranks.files; ++q) names.push_back(pieces_file_name(q));
      for (const std::string& n : names) {
        const io::FileDigest d = io::digest_file(step_dir / n);
        files.push_back({{"name", n}, {"bytes", d.bytes}, {"checksum", d.checksum}});
      }
      io::write_json_file(step_dir / kCommit, {{"format", kLayoutCheckpointFormat},
                                               {"format_version", kLayoutCheckpointFormatVersion},
                                               {"step", st.step},
                                               {"layout", layout},
                                               {"files", files}});
      if (keep_last > 0) {  // only once the new checkpoint is durable; it counts as one of the kept
        auto all = all_checkpoints(dir);
        std::erase_if(all, [&](const auto& c) { return fs::path(c.second) == step_dir; });
        for (size_t i = 0; i + size_t(keep_last - 1) < all.size(); ++i) fs::remove_all(all[i].second);
      }
    });
  // Nobody reads the checkpoint before it is committed, and every rank learns whether it was.
  BLU_CHECK(failures() == 0, "layout checkpoint: ", step_dir.string(), " was not committed: ",
            why("rank 0 failed (see its error)"));
  return step_dir.string();
}

bool is_layout_checkpoint(const std::string& path) {
  std::error_code ec;
  const fs::path commit = fs::path(path) / kCommit;
  if (!fs::is_regular_file(commit, ec)) return false;
  try {
    const nlohmann::json j = io::read_json_file(commit);
    return j.is_object() && j.value("format", "") == kLayoutCheckpointFormat;
  } catch (const std::exception&) {
    return false;
  }
}

void verify_layout_checkpoint(const std::string& ckpt_dir) {
  const fs::path d(ckpt_dir), commit_path = d / kCommit;
  BLU_CHECK(fs::exists(commit_path), "layout checkpoint: ", commit_path.string(),
            " is missing: the checkpoint was not committed (a save was interrupted?)");
  const nlohmann::json commit = io::read_json_file(commit_path);
  BLU_CHECK(commit.is_object() && commit.value("format", "") == kLayoutCheckpointFormat, commit_path.string(),
            ": expected \"format\": \"", kLayoutCheckpointFormat, "\", got ", commit.dump());
  const int version = commit.value("format_version", 0);
  BLU_CHECK(version == kLayoutCheckpointFormatVersion, "layout checkpoint ", ckpt_dir, " has format version ", version,
            "; this build reads version ", kLayoutCheckpointFormatVersion,
            " (written by another BluTrain? load it with that version)");
  BLU_CHECK(commit.contains("files") && commit["files"].is_array() && !commit["files"].empty(), commit_path.string(),
            ": expected \"files\" to list train_state.json and the pieces files");
  std::set<std::string> listed;
  for (const auto& f : commit["files"]) listed.insert(f.at("name").get<std::string>());
  BLU_CHECK(listed.count(kStateFile), commit_path.string(), ": \"files\" does not list ", kStateFile);
  for (const auto& e : fs::directory_iterator(d)) {
    const std::string n = e.path().filename().string();
    BLU_CHECK(!n.starts_with("pieces_") || n.find(".tmp") != std::string::npos || listed.count(n), "layout checkpoint: ",
              e.path().string(), " is not listed in its COMMIT (a file of another save?)");
  }
  verify_listed_files(ckpt_dir, commit["files"], "layout checkpoint");
}

std::string describe_checkpoint_format(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path commit = fs::path(path) / kCommit;
    if (!fs::exists(commit)) return "uncommitted checkpoint directory";
    nlohmann::json j;
    try {
      j = io::read_json_file(commit);
    } catch (const std::exception&) {
      return "checkpoint directory with an unreadable COMMIT";
    }
    const std::string v = std::to_string(j.value("format_version", 1));
    if (j.value("format", "") == kLayoutCheckpointFormat) return "layout checkpoint (format " + v + ")";
    if (j.contains("stages")) return "pipeline checkpoint (format " + v + ")";
    return "ZeRO-sharded checkpoint (format " + v + ")";
  }
  try {
    const SafeTensorsFile f = SafeTensorsFile::open(path);
    const auto it = f.metadata().find("format_version");
    return "single-file checkpoint (format " + (it == f.metadata().end() ? std::string("1") : it->second) + ")";
  } catch (const std::exception&) {
    return "unreadable file";
  }
}

std::string latest_any_checkpoint(const std::string& dir, const CheckpointWarning& warn) {
  return newest_verified(
      all_checkpoints(dir),
      [](const std::string& p) {
        if (!fs::is_directory(p)) return verify_checkpoint(p);
        if (is_layout_checkpoint(p)) return verify_layout_checkpoint(p);
        const nlohmann::json commit = io::read_json_file(fs::path(p) / kCommit);
        if (commit.is_object() && commit.contains("stages")) return PipelineStage::verify_checkpoint(p);
        if (commit.is_object() && commit.value("format", "") != "")
          BLU_CHECK(false, p, ": unknown checkpoint format '", commit.value("format", ""), "'");
        verify_sharded_checkpoint(p);
      },
      warn);
}

namespace {

class PiecesTensors final : public CheckpointTensors {
 public:
  explicit PiecesTensors(const std::string& dir) : r_(dir) {}
  std::vector<std::string> names() const override { return r_.names(); }
  bool contains(const std::string& n) const override { return r_.contains(n); }
  std::vector<int64_t> global_shape(const std::string& n) const override { return r_.global_shape(n); }
  DType dtype(const std::string& n) const override { return r_.dtype(n); }
  Tensor full(const std::string& n) const override { return r_.full(n); }
  Tensor box(const std::string& n, const std::vector<int64_t>& offset, const std::vector<int64_t>& shape) const override {
    return r_.box(n, offset, shape);
  }
  Tensor range(const std::string& n, int64_t begin, int64_t count) const override { return r_.range(n, begin, count); }

 private:
  GlobalTensorReader r_;
};

// Whole tensors in safetensors files (the first file holding a name wins: a pipeline's tied
// weight is in two stage files, with the same bytes).
class WholeTensors final : public CheckpointTensors {
 public:
  explicit WholeTensors(std::vector<SafeTensorsFile> files) : files_(std::move(files)) {
    for (size_t i = 0; i < files_.size(); ++i)
      for (const TensorEntry& e : files_[i].entries()) index_.emplace(e.name, std::make_pair(i, &e));
  }
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [n, e] : index_) out.push_back(n);
    return out;
  }
  bool contains(const std::string& n) const override { return index_.count(n) > 0; }
  std::vector<int64_t> global_shape(const std::string& n) const override { return at(n).shape; }
  DType dtype(const std::string& n) const override { return at(n).dtype; }
  Tensor full(const std::string& n) const override {
    const TensorEntry& e = at(n);
    Tensor t = empty(e.shape, e.dtype);
    const auto bytes = files_[index_.at(n).first].bytes(e);
    if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());
    return t;
  }
  Tensor box(const std::string& n, const std::vector<int64_t>& offset, const std::vector<int64_t>& shape) const override {
    const std::vector<int64_t> g = global_shape(n);
    BLU_CHECK(offset.size() == g.size() && shape.size() == g.size(), "checkpoint: a box of rank ", offset.size(),
              " for '", n, "' ", Shape(g));
    Tensor t = full(n);
    for (size_t d = 0; d < shape.size(); ++d) {
      BLU_CHECK(offset[d] >= 0 && shape[d] >= 0 && offset[d] + shape[d] <= g[d], "checkpoint: box ", Shape(offset),
                " of ", Shape(shape), " leaves '", n, "' ", Shape(g));
      t = narrow(t, int64_t(d), offset[d], shape[d]);
    }
    return contiguous(t);
  }
  Tensor range(const std::string& n, int64_t begin, int64_t count) const override {
    const Tensor t = full(n);
    BLU_CHECK(begin >= 0 && count >= 0 && begin + count <= t.numel(), "checkpoint: range [", begin, ", ",
              begin + count, ") leaves '", n, "' of ", t.numel(), " elements");
    return contiguous(narrow(reshape(t, {t.numel()}), 0, begin, count));
  }

 private:
  const TensorEntry& at(const std::string& n) const {
    const auto it = index_.find(n);
    BLU_CHECK(it != index_.end(), "checkpoint: no tensor '", n, "'");
    return *it->second.second;
  }
  std::vector<SafeTensorsFile> files_;
  std::map<std::string, std::pair<size_t, const TensorEntry*>> index_;
};

nlohmann::json train_state_metadata(const SafeTensorsFile& f, const std::string& path) {
  const auto it = f.metadata().find("train_state");
  BLU_CHECK(it != f.metadata().end(), path, " has no 'train_state' metadata (not a BluTrain checkpoint?)");
  const nlohmann::json j = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  BLU_CHECK(!j.is_discarded(), path, ": metadata 'train_state' is not valid JSON");
  return j;
}

}  // namespace

LayoutCheckpoint::LayoutCheckpoint(const std::string& path, const nlohmann::json& expected_model_config)
    : dir_(path) {
  nlohmann::json js;
  std::error_code ec;
  if (is_layout_checkpoint(path)) {
    verify_layout_checkpoint(path);
    js = io::read_json_file(fs::path(path) / kStateFile);
    layout_ = js.value("layout", nlohmann::json());
    tensors_ = std::make_unique<PiecesTensors>(path);
  } else if (fs::is_directory(path, ec)) {
    const std::string format = describe_checkpoint_format(path);
    BLU_CHECK(format.starts_with("pipeline"), "cannot load ", path, " under this layout: it is a ", format,
              ", which loads under ZeRO only (its moments are flat shards of ZeRO's own order); a layout checkpoint ",
              "(format ", kLayoutCheckpointFormatVersion, ") loads under every layout");
    PipelineStage::verify_checkpoint(path);  // COMMIT, version, every stage file's size and checksum
    const int P = io::read_json_file(fs::path(path) / kCommit).at("stages").get<int>();
    std::vector<SafeTensorsFile> files;
    for (int q = 0; q < P; ++q) {
      char name[64];
      std::snprintf(name, sizeof name, "stage_%03d_of_%03d.safetensors", q, P);
      files.push_back(SafeTensorsFile::open((fs::path(path) / name).string()));
    }
    js = train_state_metadata(files[0], path);
    layout_ = {{"name", "pipeline"}, {"pp", P}, {"format", format}};
    tensors_ = std::make_unique<WholeTensors>(std::move(files));
  } else {
    verify_checkpoint(path);  // a valid file, a known version, its checksum
    std::vector<SafeTensorsFile> files;
    files.push_back(SafeTensorsFile::open(path));
    js = train_state_metadata(files[0], path);
    layout_ = {{"name", "single"}, {"format", describe_checkpoint_format(path)}};
    tensors_ = std::make_unique<WholeTensors>(std::move(files));
  }
  try {
    state_.step = js.at("step").get<int64_t>();
    state_.rng_seed = js.at("rng_seed").get<uint64_t>();
    state_.rng_offset = js.at("rng_offset").get<uint64_t>();
    state_.loader = js.at("loader");
    state_.model_config = js.at("model_config");
    state_.run = js.at("run");
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, "checkpoint ", path, ": its train state is malformed: ", e.what());
  }
  BLU_CHECK(expected_model_config.is_null() || state_.model_config == expected_model_config, "checkpoint ", path,
            " holds model ", state_.model_config.dump(), ", expected ", expected_model_config.dump());
}

LayoutCheckpoint::~LayoutCheckpoint() = default;

void LayoutCheckpoint::load_held(const std::vector<HeldParameter>& held, optim::Optimizer* opt) const {
  const CheckpointTensors& r = *tensors_;
  // The optimizer state's kinds present for each parameter ("optim.<kind>.<param>").
  std::map<std::string, std::vector<std::string>> kinds;
  for (const std::string& n : r.names()) {
    if (!n.starts_with("optim.") || n == "optim.step") continue;
    const size_t dot = n.find('.', 6);
    if (dot != std::string::npos) kinds[n.substr(dot + 1)].push_back(n.substr(6, dot - 6));
  }
  for (const HeldParameter& p : held) {
    const std::string key = "model." + p.name;
    BLU_CHECK(r.contains(key), "layout checkpoint ", dir_, " has no parameter '", p.name, "'");
    BLU_CHECK(r.global_shape(key) == p.global_shape && r.dtype(key) == p.local.dtype(), "layout checkpoint ", dir_,
              ": parameter '", p.name, "' is ", r.dtype(key), " ", Shape(r.global_shape(key)), " there, ",
              p.local.dtype(), " ", Shape(p.global_shape), " in this model");
  }
  NoGradGuard no_grad;
  if (opt) {
    nn::NamedTensors state;
    state.emplace_back("step", r.contains("optim.step") ? r.full("optim.step") : optim::detail::count_tensor(0));
    for (const HeldParameter& p : held) {
      const auto it = kinds.find(p.name);
      if (it == kinds.end()) continue;
      // A parameter never updated has no state (a ZeRO writer records step 0 for it).
      if (r.contains("optim.step." + p.name) &&
          optim::detail::read_count(r.full("optim.step." + p.name), "step." + p.name) == 0)
        continue;
      for (const std::string& kind : it->second) {
        const std::string name = "optim." + kind + "." + p.name;
        state.emplace_back(kind + "." + p.name,
                           r.global_shape(name).empty() ? r.full(name) : read_like(r, name, p));
      }
    }
    opt->load_state(state);  // strict: refuses what does not fit before anything changes
  }
  for (const HeldParameter& p : held) copy_(p.local, to_device(read_like(r, "model." + p.name, p), p.local.device()));
}

void LayoutCheckpoint::load_zero(ZeroAdamW& opt) const {
  const CheckpointTensors& r = *tensors_;
  const std::vector<FlatParam> params = flat_params(opt);
  for (const FlatParam& p : params) {
    const std::string key = "model." + p.name;
    BLU_CHECK(r.contains(key), "layout checkpoint ", dir_, " has no parameter '", p.name, "'");
    BLU_CHECK(r.global_shape(key) == std::vector<int64_t>(p.tensor.shape()) && r.dtype(key) == p.tensor.dtype(),
              "layout checkpoint ", dir_, ": parameter '", p.name, "' is ", r.dtype(key), " ",
              Shape(r.global_shape(key)), " there, ", p.tensor.dtype(), " ", p.tensor.shape(), " in this model");
  }
  // This rank's moments (zeros for a parameter the writer never updated).
  const int64_t n = opt.shard_numel();
  Tensor m = zeros({n}, DType::f32), v = zeros({n}, DType::f32);
  for_each_overlap(params, opt.shard_ranges(), [&](const FlatParam& p, int64_t begin, int64_t at, int64_t count) {
    for (const auto& [kind, dst] : {std::pair<const char*, Tensor*>{"exp_avg", &m}, {"exp_avg_sq", &v}}) {
      const std::string name = std::string("optim.") + kind + "." + p.name;
      if (r.contains(name)) copy_(narrow(*dst, 0, at, count), to_dtype(r.range(name, begin, count), DType::f32));
    }
  });
  const Tensor step = r.contains("optim.step") ? r.full("optim.step") : optim::detail::count_tensor(0);
  opt.gather_full();  // stage 3: every parameter whole, then each rank keeps its chunks
  try {
    NoGradGuard no_grad;
    for (const FlatParam& p : params) copy_(p.tensor, to_device(r.full("model." + p.name), p.tensor.device()));
  } catch (...) {
    opt.release_full();
    throw;
  }
  opt.release_full(/*write_back=*/true);
  opt.load_state({{"step", step}, {"exp_avg", m}, {"exp_avg_sq", v}});
}

}  // namespace blu::dist
