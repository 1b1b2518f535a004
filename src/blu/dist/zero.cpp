// dist/zero: the flat layout and its slices, ZeRO-1/2 AdamW steps, sharded checkpoints.
#include "blu/dist/zero.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>

#include "blu/core/grad_mode.h"
#include "blu/io/safetensors.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/optim.h"
#include "blu/ops/reduce.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace fs = std::filesystem;

namespace blu::dist {

namespace {

Tensor flat(const Tensor& t) { return view(t, {t.numel()}); }

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

}  // namespace

ZeroAdamW::ZeroAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions options,
                     std::shared_ptr<ProcessGroup> pg, int stage)
    : options_(options), pg_(std::move(pg)), stage_(stage) {
  BLU_CHECK(pg_, "ZeroAdamW: null process group");
  BLU_CHECK(stage == 1 || stage == 2, "ZeroAdamW: stage must be 1 or 2 (stage 3 is not implemented), got ", stage);
  // The same option checks as optim's AdamW (which this must match).
  optim::make_adamw({}, options);
  groups_ = std::move(groups);
  lr_ = options.lr;
  for (const auto& ref : optim::detail::flatten_groups(groups_, "ZeroAdamW")) {
    BLU_CHECK(ref.param.is_contiguous(), "ZeroAdamW: parameter '", ref.name, "' is not contiguous");
    params_.push_back({ref.name, ref.param, ref.weight_decay, total_});
    total_ += ref.param.numel();
  }
  const int W = pg_->size(), r = pg_->rank();
  chunk_ = std::max<int64_t>(1, (total_ + W - 1) / W);
  begin_ = std::min(total_, int64_t(r) * chunk_);
  end_ = std::min(total_, int64_t(r + 1) * chunk_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(begin_, params_[i].offset);
    const int64_t hi = std::min(end_, params_[i].offset + params_[i].tensor.numel());
    if (lo < hi) segments_.push_back({i, lo - params_[i].offset, lo - begin_, hi - lo});
  }
  // Shards, state and staging buffers live on the parameters' device (NCCL for CUDA tensors).
  device_ = params_.empty() ? kCPU : params_[0].tensor.device();
  for (const Param& p : params_)
    BLU_CHECK(p.tensor.device() == device_, "ZeroAdamW: parameter '", p.name, "' is on ", p.tensor.device(),
              ", the first one on ", device_, " (one device per rank)");
  exp_avg_ = zeros({end_ - begin_}, DType::f32, device_);
  exp_avg_sq_ = zeros({end_ - begin_}, DType::f32, device_);
}

void ZeroAdamW::reduce_gradients() {
  if (stage_ != 2 || reduced_) return;
  NoGradGuard no_grad;
  Tensor all = zeros({chunk_ * pg_->size()}, DType::f32, device_);
  for (Param& p : params_) {
    const Tensor g = p.tensor.grad();
    if (!g.defined()) continue;  // unused on this rank: contributes zeros
    BLU_CHECK(g.shape() == p.tensor.shape() && g.dtype() == DType::f32, "ZeroAdamW: gradient of '", p.name,
              "' is ", g.str(), ", expected ", p.tensor.str());
    copy_(narrow(all, 0, p.offset, p.tensor.numel()), reshape(g, {g.numel()}));
  }
  shard_grad_ = empty({chunk_}, DType::f32, device_);
  pg_->reduce_scatter(shard_grad_, all, ReduceOp::avg)->wait();
  for (Param& p : params_) p.tensor.zero_grad();  // stage 2 keeps only the slice
  reduced_ = true;
}

double ZeroAdamW::clip_grad_norm(double max_norm) {
  if (stage_ == 1) {
    std::vector<Tensor> ts;
    for (const Param& p : params_) ts.push_back(p.tensor);
    return optim::clip_grad_norm(ts, max_norm);
  }
  BLU_CHECK(max_norm > 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  reduce_gradients();
  NoGradGuard no_grad;
  const Tensor mine = to_dtype(narrow(shard_grad_, 0, 0, end_ - begin_), DType::f64);
  Tensor sumsq = end_ > begin_ ? reshape(sum(mul(mine, mine)), {1}) : zeros({1}, DType::f64, device_);
  pg_->all_reduce(sumsq, ReduceOp::sum)->wait();
  const double norm = std::sqrt(to_device(sumsq, kCPU).item());
  if (!std::isfinite(norm)) return norm;
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) mul_(shard_grad_, scale);
  return norm;
}

void ZeroAdamW::step() {
  NoGradGuard no_grad;
  reduce_gradients();
  const int64_t t = steps_ + 1;
  std::map<double, std::vector<AdamWTensors>> by_decay;  // one adamw_step op per weight decay
  for (const Segment& s : segments_) {
    const Param& p = params_[s.param];
    Tensor g;
    if (stage_ == 2) {
      g = narrow(shard_grad_, 0, s.shard_offset, s.length);
    } else {
      const Tensor full_grad = p.tensor.grad();
      BLU_CHECK(full_grad.defined(), "ZeroAdamW (stage 1): parameter '", p.name, "' has no gradient; ",
                "call DistributedDataParallel::finish() before step()");
      g = narrow(reshape(full_grad, {full_grad.numel()}), 0, s.param_offset, s.length);
    }
    by_decay[p.weight_decay].push_back({narrow(flat(p.tensor), 0, s.param_offset, s.length), g,
                                        narrow(exp_avg_, 0, s.shard_offset, s.length),
                                        narrow(exp_avg_sq_, 0, s.shard_offset, s.length), Tensor()});
  }
  for (const auto& [wd, tensors] : by_decay)
    adamw_step_(tensors, {.lr = lr_, .beta1 = options_.beta1, .beta2 = options_.beta2, .eps = options_.eps,
                          .weight_decay = wd, .step = t});
  // Every rank contributes its updated slice; all receive the whole vector.
  Tensor send = zeros({chunk_}, DType::f32, device_), recv = empty({chunk_ * pg_->size()}, DType::f32, device_);
  for (const Segment& s : segments_)
    copy_(narrow(send, 0, s.shard_offset, s.length), narrow(flat(params_[s.param].tensor), 0, s.param_offset, s.length));
  pg_->all_gather(recv, send)->wait();
  for (const Param& p : params_) copy_(flat(p.tensor), narrow(recv, 0, p.offset, p.tensor.numel()));
  ++steps_;
  reduced_ = false;
  shard_grad_ = Tensor();
}

nn::NamedTensors ZeroAdamW::state() const {
  return {{"step", optim::detail::count_tensor(steps_)}, {"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
}

void ZeroAdamW::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
  BLU_CHECK(m.size() == 3 && m.count("step") && m.count("exp_avg") && m.count("exp_avg_sq"),
            "ZeroAdamW state: expected exactly 'step', 'exp_avg', 'exp_avg_sq' (", state.size(), " entries given)");
  for (const char* k : {"exp_avg", "exp_avg_sq"})
    BLU_CHECK(m[k].shape() == Shape{end_ - begin_}, "ZeroAdamW state: '", k, "' has shape ", m[k].shape(),
              ", this rank's slice is [", end_ - begin_, "] (another world size? use load_sharded_checkpoint)");
  const int64_t step = optim::detail::read_count(m["step"], "step");
  NoGradGuard no_grad;
  copy_(exp_avg_, to_device(m["exp_avg"], exp_avg_.device()));  // loaded on the host; the state may be on a GPU
  copy_(exp_avg_sq_, to_device(m["exp_avg_sq"], exp_avg_sq_.device()));
  steps_ = step;
}

std::string save_sharded_checkpoint(const std::string& dir, const nn::Module& model, ZeroAdamW& opt,
                                    const TrainState& st, int keep_last) {
  ProcessGroup& pg = opt.process_group();
  const fs::path step_dir = fs::path(dir) / step_dir_name(st.step);
  fs::create_directories(step_dir);
  if (pg.rank() == 0) fs::remove(step_dir / kCommit);  // re-saving a step: not committed until done
  pg.barrier()->wait();
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
  const nlohmann::json meta = {{"rank", pg.rank()},       {"world_size", pg.size()}, {"begin", opt.shard_begin()},
                               {"end", opt.shard_end()},  {"total", opt.total_numel()}, {"step", opt.steps()},
                               {"stage", opt.stage()},    {"layout", layout_json(params)}};
  w.set_metadata(kZeroMeta, meta.dump());
  w.write((step_dir / shard_file_name(pg.rank(), pg.size())).string());
  pg.barrier()->wait();  // every shard is on disk
  if (pg.rank() == 0) {
    const fs::path tmp = step_dir / "COMMIT.tmp";
    {
      std::ofstream f(tmp);
      f << nlohmann::json{{"world_size", pg.size()}, {"step", st.step}, {"total", opt.total_numel()}}.dump() << "\n";
      BLU_CHECK(f.good(), "save_sharded_checkpoint: cannot write ", tmp.string());
    }
    fs::rename(tmp, step_dir / kCommit);
    if (keep_last > 0) {  // prune only after the new checkpoint is committed
      std::vector<fs::path> committed;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_directory() && e.path().filename().string().rfind("ckpt_", 0) == 0 && fs::exists(e.path() / kCommit))
          committed.push_back(e.path());
      std::sort(committed.begin(), committed.end());
      for (size_t i = 0; i + size_t(keep_last) < committed.size(); ++i)
        if (committed[i] != step_dir) fs::remove_all(committed[i]);
    }
  }
  pg.barrier()->wait();  // nobody reads the checkpoint before it is committed
  return step_dir.string();
}

std::string latest_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";
  std::string best;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("ckpt_", 0) != 0 || !fs::exists(e.path() / kCommit)) continue;
    if (best.empty() || name > fs::path(best).filename().string()) best = e.path().string();
  }
  return best;
}

TrainState load_sharded_checkpoint(const std::string& ckpt_dir, nn::Module& model, ZeroAdamW& opt,
                                   const nlohmann::json& expected_model_config) {
  const fs::path d(ckpt_dir);
  std::ifstream cf(d / kCommit);
  BLU_CHECK(cf.good(), "load_sharded_checkpoint: ", (d / kCommit).string(),
            " is missing: the checkpoint was not committed (a save was interrupted?)");
  const nlohmann::json commit = nlohmann::json::parse(cf);
  const int W = commit.at("world_size").get<int>();
  const int64_t step = commit.at("step").get<int64_t>();
  BLU_CHECK(commit.at("total").get<int64_t>() == opt.total_numel(), "load_sharded_checkpoint: ", ckpt_dir,
            " holds ", commit.at("total").get<int64_t>(), " parameter elements, this optimizer has ", opt.total_numel());
  nn::NamedTensors params;
  for (const auto& g : opt.groups())
    for (const auto& np : g.params) params.push_back(np);
  const nlohmann::json layout = layout_json(params);
  // Assemble this rank's slice from every old shard that overlaps it (checks first, then copy).
  const int64_t b = opt.shard_begin(), e = opt.shard_end();
  std::vector<float> m(size_t(e - b)), v(size_t(e - b));
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
    const int64_t qb = meta.at("begin").get<int64_t>(), qe = meta.at("end").get<int64_t>();
    const int64_t s = meta.at("step").get<int64_t>();
    BLU_CHECK(opt_step < 0 || opt_step == s, "load_sharded_checkpoint: shards disagree on the step (", opt_step,
              " vs ", s, ")");
    opt_step = s;
    const int64_t lo = std::max(b, qb), hi = std::min(e, qe);
    if (lo >= hi) continue;
    for (auto [name, dst] : {std::pair{"exp_avg", &m}, std::pair{"exp_avg_sq", &v}}) {
      const TensorEntry& te = file.at(name);
      BLU_CHECK(te.dtype == DType::f32 && te.numel() == uint64_t(qe - qb), "load_sharded_checkpoint: ", f.string(),
                " '", name, "' should be f32 [", qe - qb, "]");
      std::memcpy(dst->data() + (lo - b), file.bytes(te).data() + (lo - qb) * 4, size_t(hi - lo) * 4);
    }
    covered += hi - lo;
  }
  BLU_CHECK(covered == e - b, "load_sharded_checkpoint: the shards cover ", covered, " of this rank's ", e - b,
            " elements");
  // The model (and TrainState) last: io/checkpoint checks it fully before changing anything.
  const fs::path model_file = d / (step_dir_name(step) + ".safetensors");
  TrainState st = load_checkpoint(model_file.string(), model, nullptr, expected_model_config);
  std::vector<double> md(m.begin(), m.end()), vd(v.begin(), v.end());
  opt.load_state({{"step", optim::detail::count_tensor(opt_step)},
                  {"exp_avg", from_vector(md, {e - b})},
                  {"exp_avg_sq", from_vector(vd, {e - b})}});
  return st;
}

}  // namespace blu::dist
