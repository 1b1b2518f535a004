// dist/zero_checkpoint: ZeRO's sharded checkpoints (dist/zero_checkpoint.h).
#include "blu/dist/zero_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "blu/io/checksum.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace fs = std::filesystem;

namespace blu::dist {

namespace {

nlohmann::json layout_json(const nn::NamedTensors& params) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& [name, t] : params) j.push_back({name, t.numel()});
  return j;
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "ckpt_%08lld", static_cast<long long>(step));
  return buf;
}

std::string shard_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "optim_%05d_of_%05d.safetensors", rank, world);
  return buf;
}

constexpr const char* kCommit = "COMMIT";
constexpr const char* kZeroMeta = "zero";

// (step, directory) of every ckpt_<step> directory in dir, committed or not, oldest first.
std::vector<std::pair<int64_t, fs::path>> step_dirs(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = checkpoint_step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory(ec)) out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// How many ranks report `failed`: the save's steps are collective, so a rank that fails one tells
// the others instead of leaving them in the next barrier.
int64_t ranks_failed(ProcessGroup& pg, Device dev, bool failed) {
  Tensor flag = full({1}, failed ? 1.0 : 0.0, DType::f64, dev);
  pg.all_reduce(flag, ReduceOp::sum)->wait();
  return int64_t(std::llround((dev.is_cpu() ? flag : to_device(flag, kCPU)).item()));
}

// Note [Sharded checkpoint format]: COMMIT is {"format_version": 2, "step", "world_size",
// "total", "files": [{"name", "bytes", "checksum"}]} listing the model file and every shard with
// its size and io/checksum hash. A COMMIT without "format_version" is format 1 (no "files"): its
// files are only checked to exist.
constexpr int kShardedFormatVersion = 2;

}  // namespace

std::string save_sharded_checkpoint(const std::string& dir, const nn::Module& model, ZeroAdamW& opt,
                                    const TrainState& st, int keep_last) {
  ProcessGroup& pg = opt.process_group();
  const Device dev = opt.device();  // where this group's collectives run
  const fs::path step_dir = fs::path(dir) / step_dir_name(st.step);
  const std::string model_name = step_dir_name(st.step) + ".safetensors";
  const std::string shard_name = shard_file_name(pg.rank(), pg.size());
  // Rank 0 first removes what saves that were cut short left (directories without COMMIT, which
  // hold space a new save may need) and an earlier save of this step; then every rank writes.
  std::string error;
  if (pg.rank() == 0) {
    try {
      fs::create_directories(dir);
      for (const auto& [step, d] : step_dirs(dir))
        if (d == step_dir || !fs::exists(d / kCommit)) fs::remove_all(d);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  BLU_CHECK(ranks_failed(pg, dev, !error.empty()) == 0, "save_sharded_checkpoint: cannot prepare ", step_dir.string(),
            ": ", error.empty() ? std::string("rank 0 failed (see its error)") : error);
  opt.gather_full();  // stage 3: rank 0 writes the whole model (every rank takes part in the gather)
  try {
    fs::create_directories(step_dir);
    if (pg.rank() == 0) save_checkpoint(step_dir.string(), model, nullptr, st, 0);
    nn::NamedTensors params;
    for (const auto& g : opt.groups())
      for (const auto& np : g.params) params.push_back(np);
    const nn::NamedTensors state = opt.state();
    SafeTensorsWriter w;
    std::vector<Tensor> host;  // the writer keeps views of these bytes until write()
    for (const auto& [name, t] : state) {
      if (name == "step") continue;
      host.push_back(t.device().is_cpu() ? t : to_device(t, kCPU));
      const Tensor& h = host.back();
      w.add(name, h.dtype(), h.shape(), {static_cast<const std::byte*>(h.raw_data()), h.nbytes()});
    }
    const nlohmann::json meta = {{"rank", pg.rank()},   {"world_size", pg.size()},          {"ranges", opt.shard_ranges()},
                                 {"total", opt.total_numel()}, {"step", opt.steps()}, {"stage", opt.stage()},
                                 {"layout", layout_json(params)}};
    w.set_metadata(kZeroMeta, meta.dump());
    w.write((step_dir / shard_name).string());
  } catch (const std::exception& e) {
    error = e.what();
  }
  opt.release_full();
  const int64_t failed = ranks_failed(pg, dev, !error.empty());  // every shard is on disk, or not
  BLU_CHECK(failed == 0, "save_sharded_checkpoint: ", step_dir.string(), " is incomplete and not committed: ",
            error.empty() ? std::to_string(failed) + " rank(s) could not write their part (see their errors)" : error);
  // Rank 0 commits — COMMIT names every file with its size and checksum, written atomically — and
  // only then prunes older committed checkpoints.
  if (pg.rank() == 0) {
    try {
      nlohmann::json files = nlohmann::json::array();
      std::vector<std::string> names{model_name};
      for (int q = 0; q < pg.size(); ++q) names.push_back(shard_file_name(q, pg.size()));
      for (const std::string& n : names) {
        const io::FileDigest d = io::digest_file(step_dir / n);
        files.push_back({{"name", n}, {"bytes", d.bytes}, {"checksum", d.checksum}});
      }
      io::write_json_file(step_dir / kCommit, {{"format_version", kShardedFormatVersion},
                                               {"step", st.step},
                                               {"world_size", pg.size()},
                                               {"total", opt.total_numel()},
                                               {"files", files}});
      if (keep_last > 0) {
        std::vector<fs::path> committed;
        for (const auto& [step, d] : step_dirs(dir))
          if (d != step_dir && fs::exists(d / kCommit)) committed.push_back(d);
        // The new checkpoint counts as one of the kept.
        for (size_t i = 0; i + size_t(keep_last - 1) < committed.size(); ++i) fs::remove_all(committed[i]);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Nobody reads the checkpoint before it is committed, and every rank learns whether it was.
  BLU_CHECK(ranks_failed(pg, dev, !error.empty()) == 0, "save_sharded_checkpoint: ", step_dir.string(),
            " was not committed: ", error.empty() ? std::string("rank 0 failed (see its error)") : error);
  return step_dir.string();
}

void verify_sharded_checkpoint(const std::string& ckpt_dir) {
  const fs::path d(ckpt_dir);
  const fs::path commit_path = d / kCommit;
  BLU_CHECK(fs::exists(commit_path), "sharded checkpoint: ", commit_path.string(),
            " is missing: the checkpoint was not committed (a save was interrupted?)");
  const nlohmann::json commit = io::read_json_file(commit_path);
  BLU_CHECK(commit.is_object(), commit_path.string(), ": expected a JSON object, got ", commit.dump());
  BLU_CHECK(!commit.contains("format_version") || commit["format_version"].is_number_integer(), commit_path.string(),
            ": expected an integer \"format_version\", got ", commit.value("format_version", nlohmann::json()).dump());
  const int64_t version = commit.value("format_version", int64_t(1));
  BLU_CHECK(version >= 1 && version <= kShardedFormatVersion, "sharded checkpoint ", ckpt_dir, " has format version ",
            version, "; this build reads versions 1 to ", kShardedFormatVersion,
            " (written by a newer BluTrain? load it with that version)");
  for (const char* key : {"world_size", "step", "total"})
    BLU_CHECK(commit.contains(key) && commit[key].is_number_integer(), commit_path.string(), ": expected an integer \"",
              key, "\"");
  const int64_t W = commit["world_size"].get<int64_t>();
  const int64_t step = commit["step"].get<int64_t>();
  BLU_CHECK(W >= 1 && W <= (1 << 20) && step >= 0, commit_path.string(), ": world_size ", W, " and step ", step, " must be in [1, 2^20] and >= 0");
  if (version == 1) {
    std::vector<std::string> names{step_dir_name(step) + ".safetensors"};
    for (int q = 0; q < W; ++q) names.push_back(shard_file_name(q, int(W)));
    for (const std::string& n : names)
      BLU_CHECK(fs::exists(d / n), "sharded checkpoint: ", (d / n).string(), " is missing (", commit_path.string(),
                " names ", W, " shards)");
    return;
  }
  BLU_CHECK(commit.contains("files") && commit["files"].is_array() && commit["files"].size() == size_t(W) + 1,
            commit_path.string(), ": expected \"files\" to list the model file and ", W, " shards");
  verify_listed_files(ckpt_dir, commit["files"], "sharded checkpoint");
}

std::string latest_sharded_checkpoint(const std::string& dir, const CheckpointWarning& warn) {
  std::vector<std::pair<int64_t, std::string>> committed;
  for (const auto& [step, d] : step_dirs(dir))
    if (fs::exists(d / kCommit)) committed.emplace_back(step, d.string());
  return newest_verified(committed, [](const std::string& d) { verify_sharded_checkpoint(d); }, warn);
}

TrainState load_sharded_checkpoint(const std::string& ckpt_dir, nn::Module& model, ZeroAdamW& opt,
                                   const nlohmann::json& expected_model_config) {
  const fs::path d(ckpt_dir);
  verify_sharded_checkpoint(ckpt_dir);  // COMMIT, version, every file's size and checksum
  const nlohmann::json commit = io::read_json_file(d / kCommit);
  const int W = commit.at("world_size").get<int>();
  const int64_t step = commit.at("step").get<int64_t>();
  BLU_CHECK(commit.at("total").get<int64_t>() == opt.total_numel(), "load_sharded_checkpoint: ", ckpt_dir,
            " holds ", commit.at("total").get<int64_t>(), " parameter elements, this optimizer has ", opt.total_numel());
  nn::NamedTensors params;
  for (const auto& g : opt.groups())
    for (const auto& np : g.params) params.push_back(np);
  const nlohmann::json layout = layout_json(params);
  // Assemble this rank's shard from every old shard that overlaps it (checks first, then copy). A
  // shard is a list of flat ranges in shard order (older checkpoints: one range, "begin".."end").
  const auto mine = opt.shard_ranges();
  const int64_t n = opt.shard_numel();
  std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  int64_t opt_step = -1, covered = 0;
  for (int q = 0; q < W; ++q) {
    const fs::path f = d / shard_file_name(q, W);
    BLU_CHECK(fs::exists(f), "load_sharded_checkpoint: shard ", f.string(), " is missing (", W, " expected)");
    SafeTensorsFile file = SafeTensorsFile::open(f.string());
    auto it = file.metadata().find(kZeroMeta);
    BLU_CHECK(it != file.metadata().end(), "load_sharded_checkpoint: ", f.string(), " has no '", kZeroMeta, "' metadata");
    const nlohmann::json meta = nlohmann::json::parse(it->second);
    BLU_CHECK(meta.at("layout") == layout, "load_sharded_checkpoint: ", f.string(),
              " was saved for other parameters (names or sizes differ from this model's)");
    std::vector<std::pair<int64_t, int64_t>> theirs;
    if (meta.contains("ranges")) {
      theirs = meta.at("ranges").get<std::vector<std::pair<int64_t, int64_t>>>();
    } else {
      const int64_t qb = meta.at("begin").get<int64_t>(), qe = meta.at("end").get<int64_t>();
      if (qe > qb) theirs.emplace_back(qb, qe - qb);
    }
    int64_t their_numel = 0;
    for (const auto& [off, len] : theirs) {
      BLU_CHECK(off >= 0 && len > 0 && off + len <= opt.total_numel(), "load_sharded_checkpoint: ", f.string(),
                " names the range [", off, ", ", off + len, ") outside the ", opt.total_numel(), " elements");
      their_numel += len;
    }
    const int64_t s = meta.at("step").get<int64_t>();
    BLU_CHECK(opt_step < 0 || opt_step == s, "load_sharded_checkpoint: shards disagree on the step (", opt_step,
              " vs ", s, ")");
    opt_step = s;
    std::vector<std::span<const std::byte>> bytes;
    std::vector<bool> wide;  // f32, else bf16 moments (widened exactly here)
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      const TensorEntry& te = file.at(name);
      BLU_CHECK((te.dtype == DType::f32 || te.dtype == DType::bf16) && te.numel() == uint64_t(their_numel),
                "load_sharded_checkpoint: ", f.string(), " '", name, "' should be f32 or bf16 [", their_numel,
                "], got ", te.dtype, " of ", te.numel(), " elements");
      bytes.push_back(file.bytes(te));
      wide.push_back(te.dtype == DType::f32);
    }
    // Elements [src, src + count) of this shard's moment k into `out`, as f32.
    auto widen = [&](size_t k, float* out, int64_t src, int64_t count) {
      if (wide[k]) {
        std::memcpy(out, bytes[k].data() + src * 4, size_t(count) * 4);
        return;
      }
      for (int64_t i = 0; i < count; ++i) {
        bf16 h;
        std::memcpy(&h.bits, bytes[k].data() + (src + i) * 2, 2);
        out[i] = float(h);
      }
    };
    // Every overlap of one of our ranges with one of theirs (both lists walk their shard in order).
    int64_t my_pos = 0;
    for (const auto& [my_off, my_len] : mine) {
      int64_t their_pos = 0;
      for (const auto& [off, len] : theirs) {
        const int64_t lo = std::max(my_off, off), hi = std::min(my_off + my_len, off + len);
        if (lo < hi) {
          const int64_t dst = my_pos + (lo - my_off), src = their_pos + (lo - off);
          widen(0, m.data() + dst, src, hi - lo);
          widen(1, v.data() + dst, src, hi - lo);
          covered += hi - lo;
        }
        their_pos += len;
      }
      my_pos += my_len;
    }
  }
  BLU_CHECK(covered == n, "load_sharded_checkpoint: the shards cover ", covered, " of this rank's ", n,
            " elements (overlapping or missing ranges)");
  // The model (and TrainState) last: io/checkpoint checks it fully before changing anything.
  const fs::path model_file = d / (step_dir_name(step) + ".safetensors");
  opt.gather_full();  // stage 3: the whole model is written, then each rank keeps its chunks
  TrainState st;
  try {
    st = load_checkpoint(model_file.string(), model, nullptr, expected_model_config);
  } catch (...) {
    opt.release_full();
    throw;
  }
  opt.release_full(/*write_back=*/true);
  std::vector<double> md(m.begin(), m.end()), vd(v.begin(), v.end());
  opt.load_state({{"step", optim::detail::count_tensor(opt_step)},
                  {"exp_avg", from_vector(md, {n})},
                  {"exp_avg_sq", from_vector(vd, {n})}});
  return st;
}

}  // namespace blu::dist
