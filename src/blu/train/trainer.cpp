#include "blu/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <ostream>

#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/ddp.h"
#include "blu/dist/env.h"
#include "blu/dist/zero.h"
#include "blu/io/checkpoint.h"
#include "blu/ops/precision.h"
#include "blu/memory/allocator.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#ifdef BLU_HAVE_CUDA
#include "blu/backend/cuda/runtime.h"
#endif

namespace blu::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// [B, T] int32 ids on `device` (a host tensor first; one to_device when the device is not the CPU).
Tensor ids_tensor(const std::vector<int32_t>& ids, int64_t B, int64_t T, Device device) {
  BLU_ASSERT(int64_t(ids.size()) == B * T, "batch holds ", ids.size(), " ids, expected ", B * T);
  Tensor host = empty({B, T}, DType::i32, kCPU);
  std::memcpy(host.data<int32_t>(), ids.data(), ids.size() * sizeof(int32_t));
  return device.is_cpu() ? host : to_device(host, device);  // copy_ stays on one device
}

// The value of a one-element tensor on any device.
double scalar_value(const Tensor& t) {
  return t.device().is_cpu() ? t.item() : to_device(t, kCPU).item();
}

bool is_checkpoint_file(const fs::path& p) {
  const std::string name = p.filename().string();
  return name.starts_with("ckpt_") && name.ends_with(".safetensors");
}

// Files this trainer writes into a run directory (and so the only ones --overwrite removes).
std::vector<fs::path> own_files(const fs::path& dir) {
  std::vector<fs::path> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "metrics.jsonl" || name == "run.json" || is_checkpoint_file(e.path()) ||
        (e.is_directory() && name.starts_with("ckpt_")))  // a sharded checkpoint (dist/zero.h)
      out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Shards for a pattern, with an error that names the flag and the pattern.
std::vector<fs::path> shard_files(const std::string& pattern, const char* what) {
  BLU_CHECK(!pattern.empty(), "no ", what, " data: expected a shard pattern (--data-dir or --", what,
            "-pattern), got none");
  std::vector<fs::path> files;
  try {
    files = expand_shard_pattern(pattern);
  } catch (const Error&) {
  }
  BLU_CHECK(!files.empty(), "no ", what, " shards: expected token shards matching --", what, "-pattern '", pattern,
            "', found none (run `blutrain prepare` first, or check --data-dir)");
  return files;
}

void write_json_file(const fs::path& path, const nlohmann::json& j) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(2) << '\n';
    out.flush();
    BLU_CHECK(out.good(), "cannot write ", tmp.string());
  }
  fs::rename(tmp, path);
}

nlohmann::json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  BLU_CHECK(in.good(), "cannot read ", path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    BLU_CHECK(false, path.string(), " is not valid JSON: ", e.what());
  }
  return {};
}

}  // namespace

nlohmann::json TrainOptions::to_json() const {
  return {{"train_pattern", train_pattern}, {"val_pattern", val_pattern},   {"model", model},
          {"batch_size", batch_size},       {"seq_len", seq_len},           {"grad_accum", grad_accum},
          {"steps", steps},                 {"lr", lr},                     {"min_lr", min_lr},
          {"warmup", warmup},               {"schedule", schedule},         {"weight_decay", weight_decay},
          {"grad_clip", grad_clip},         {"optimizer", optimizer},       {"seed", seed},
          {"device", device},               {"precision", precision},       {"out", out},                   {"val_every", val_every},
          {"val_batches", val_batches},     {"sample_every", sample_every}, {"sample_tokens", sample_tokens},
          {"sample_temperature", sample_temperature}, {"sample_top_k", sample_top_k},
          {"ckpt_every", ckpt_every},       {"keep_last", keep_last},       {"log_every", log_every},
          {"dp", dp},                       {"zero", zero}, {"row_exchange", row_exchange},
          {"auto_resume", auto_resume}, {"init_from", init_from}};
}

bool holds_run(const std::string& dir) {
  if (dir.empty() || !fs::is_directory(dir)) return false;
  for (const auto& p : own_files(dir))
    if (p.filename() == "metrics.jsonl" || p.filename().string().starts_with("ckpt_")) return true;
  return false;
}

std::string resolve_checkpoint(const std::string& path) {
  BLU_CHECK(!path.empty(), "expected a checkpoint file or a run directory, got an empty path");
  if (fs::is_directory(path)) {
    const std::string latest = latest_checkpoint(path);
    BLU_CHECK(!latest.empty(), "expected checkpoints (ckpt_*.safetensors) in the run directory ", path,
              ", found none");
    return latest;
  }
  BLU_CHECK(fs::is_regular_file(path), "checkpoint not found: expected a file or a run directory, got '", path, "'");
  return path;
}

double evaluate(models::CausalLM& model, DataLoader& loader, int64_t batches, Device device) {
  const int64_t n = std::min(batches, loader.batches_per_epoch());
  BLU_CHECK(n > 0, "evaluation needs at least one batch: asked for ", batches, ", the data holds ",
            loader.batches_per_epoch(), " batches of ", loader.B(), "x", loader.T(), " tokens");
  NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  loader.reset();
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Batch b = loader.next();
    const auto out = model.forward(ids_tensor(b.inputs, loader.B(), loader.T(), device),
                                   ids_tensor(b.targets, loader.B(), loader.T(), device));
    sum += scalar_value(out.loss);
  }
  model.train(was_training);
  return sum / double(n);
}

Trainer::Trainer(TrainOptions options, TrainCallbacks callbacks)
    : opt_s_(std::move(options)), cb_(std::move(callbacks)), device_(kCPU) {
  // The shards exist (the cheapest check, and the commonest mistake), then the model (on the CPU;
  // nothing on disk is touched), whose shapes bound the options.
  const std::vector<fs::path> train_files = shard_files(opt_s_.train_pattern, "train");
  const std::vector<fs::path> val_files =
      opt_s_.val_pattern.empty() ? std::vector<fs::path>{} : shard_files(opt_s_.val_pattern, "val");
  manual_seed(opt_s_.seed);
  if (opt_s_.model.is_null()) opt_s_.model = models::resolve_model_config("d12");  // the CLI's default
  model_ = models::build_model(opt_s_.model, opt_s_.seed);
  opt_s_.model = model_->config();
  if (opt_s_.seq_len == 0) opt_s_.seq_len = model_->max_seq_len();
  const TrainOptions& o = opt_s_;
  // 1. Options: every check before anything is built or touched.
  BLU_CHECK(o.batch_size > 0, "--batch-size must be positive, got ", o.batch_size);
  BLU_CHECK(o.seq_len > 0, "--seq-len must be positive, got ", o.seq_len);
  BLU_CHECK(o.seq_len <= model_->max_seq_len(), "--seq-len must be at most the model's longest sequence ",
            model_->max_seq_len(), ", got ", o.seq_len);
  BLU_CHECK(o.grad_accum >= 1, "--grad-accum must be at least 1, got ", o.grad_accum);
  BLU_CHECK(o.steps >= 1, "--steps must be at least 1, got ", o.steps);
  BLU_CHECK(o.lr > 0 && o.min_lr >= 0, "learning rates must be positive: got --lr ", o.lr, ", --min-lr ", o.min_lr);
  BLU_CHECK(o.warmup >= 0, "--warmup must be >= 0, got ", o.warmup);
  BLU_CHECK(o.optimizer == "adamw" || o.optimizer == "sgd", "--optimizer must be adamw or sgd, got '", o.optimizer,
            "'");
  BLU_CHECK(o.val_batches >= 1, "--val-batches must be at least 1, got ", o.val_batches);
  BLU_CHECK(o.log_every >= 1, "--log-every must be at least 1, got ", o.log_every);
  BLU_CHECK(o.keep_last >= 1, "--keep-last must be at least 1, got ", o.keep_last);
  BLU_CHECK(o.val_every >= 0 && o.sample_every >= 0 && o.ckpt_every >= 0,
            "--val-every, --sample-every and --ckpt-every must be >= 0 (0 = off)");
  BLU_CHECK(!(o.resume && o.overwrite), "--resume and --overwrite contradict each other: give one");
  BLU_CHECK(!(o.auto_resume && (o.overwrite || o.resume)), "--auto-resume replaces --resume and contradicts ",
            "--overwrite: give one of the three");
  BLU_CHECK(o.dp >= 1, "--dp must be at least 1, got ", o.dp);
  BLU_CHECK(o.zero >= 0 && o.zero <= 2, "--zero must be 0, 1 or 2 (stage 3 is not implemented), got ", o.zero);
  BLU_CHECK(o.zero == 0 || o.dp > 1, "--zero ", o.zero, " shards over data-parallel ranks: it needs --dp > 1");
  BLU_CHECK(o.zero == 0 || o.optimizer == "adamw", "--zero ", o.zero, " is implemented for adamw, got --optimizer ",
            o.optimizer);
  const dist::DistEnv env = dist::detect_env();
  BLU_CHECK(env.world_size == o.dp, "--dp ", o.dp, " must equal the number of launched processes (WORLD_SIZE=",
            env.world_size, " from ", env.source, "); start with `blutrain launch -n ", o.dp, " -- blutrain train ...`");
  BLU_CHECK(o.dp == 1 || o.device == "cpu" || o.device == "cuda", "--dp ", o.dp,
            " runs on --device cpu (Gloo) or --device cuda (NCCL, each rank on cuda:LOCAL_RANK); got --device ",
            o.device);
  rank_ = env.rank;
  if (rank_ != 0) cb_.log = nullptr;  // rank 0 speaks for the job
  schedule_.kind = optim::LRSchedule::parse(o.schedule);
  schedule_.max_lr = o.lr;
  schedule_.min_lr = o.min_lr;
  schedule_.warmup_steps = o.warmup;
  schedule_.total_steps = o.steps;
  device_ = Device(o.device);
#ifndef BLU_HAVE_CUDA
  BLU_CHECK(device_.is_cpu(), "--device ", o.device, ": this build has no CUDA backend (expected cpu)");
#else
  if (device_.is_cuda() && o.dp > 1) device_ = Device(DeviceType::cuda, env.local_rank);  // one GPU per rank
  if (device_.is_cuda()) cuda::set_device(device_.index);
#endif

  // 2. The run directory.
  std::string resume_from;
  bool restart = false;  // --auto-resume over a run of this model without a checkpoint: from step 0
  if (!o.out.empty()) {
    if (o.resume || o.auto_resume) {
      resume_from = o.zero > 0 ? dist::latest_sharded_checkpoint(o.out) : latest_checkpoint(o.out);
      BLU_CHECK(!o.resume || !resume_from.empty(), "--resume: expected a ",
                o.zero > 0 ? "committed sharded checkpoint (ckpt_*/COMMIT)" : "checkpoint (ckpt_*.safetensors)",
                " in ", o.out, ", found none");
      if (resume_from.empty() && holds_run(o.out)) {
        const fs::path run_json = fs::path(o.out) / "run.json";
        nlohmann::json saved;
        if (fs::exists(run_json)) saved = read_json_file(run_json).value("model_config", nlohmann::json());
        BLU_CHECK(saved == o.model, "--auto-resume: the run directory ", o.out,
                  " holds a run without a checkpoint whose run.json ",
                  saved.is_null() ? std::string("is missing or names no model") : "names another model (" + saved.dump() + ")",
                  "; pass --overwrite to replace it or choose another --out");
        restart = true;
      }
    } else {
      BLU_CHECK(o.overwrite || !holds_run(o.out), "the run directory ", o.out,
                " already holds a run (metrics.jsonl or checkpoints): pass --overwrite to replace it, --resume to "
                "continue it, or choose another --out");
    }
  } else {
    BLU_CHECK(!o.resume && !o.auto_resume, "--resume and --auto-resume need --out (the run directory)");
  }

  // 3. Data (shards are validated here, still before anything is written).
  LoaderOptions lo;
  lo.vocab_size = model_->vocab_size();
  const int world = int(o.dp);
  train_loader_ =
      std::make_unique<DataLoader>(train_files, o.batch_size, o.seq_len, rank_, world, lo);
  if (!o.val_pattern.empty()) {
    LoaderOptions vo = lo;
    vo.prefetch = 0;  // read on demand: evaluation is occasional and resets the loader
    val_loader_ =
        std::make_unique<DataLoader>(val_files, o.batch_size, o.seq_len, rank_, world, vo);
  }

  // 4. Model and optimizer.
  if (!o.init_from.empty()) {
    const auto& fam = models::family(models::family_of(o.model));
    BLU_CHECK(fam.import_hf, "--model ", o.init_from, ": the ", fam.name, " family has no Hugging Face weight import");
    fam.import_hf(*model_, o.init_from);
  }
  if (!device_.is_cpu()) model_->to(device_);
  model_->train();
  apply_precision(*model_, o.precision);
  if (o.precision == "fp16") scaler_ = std::make_unique<optim::LossScaler>();
  auto groups = optim::decay_groups(model_->named_parameters(), o.weight_decay);
  if (o.dp > 1) {  // the job's process group: rendezvous through rank 0's store
    store_ = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, rank_ == 0);
#ifdef BLU_HAVE_CUDA
    if (device_.is_cuda())  // CUDA tensors: NCCL on this rank's device
      pg_ = dist::make_nccl_group(*store_, rank_, world, dist::NcclOptions{.device = device_.index});
    else
#endif
      pg_ = dist::make_gloo_group(*store_, rank_, world);
  }
  if (o.optimizer == "adamw") {
    optim::AdamWOptions a;
    a.lr = o.lr;
    a.beta1 = 0.9;
    a.beta2 = 0.95;  // GPT-2 / llm.c
    if (o.zero > 0) {
      nn::Embedding* tied = model_->tied_embeddings() ? &model_->token_embedding() : nullptr;
      // Stage 2: the tied embedding in a bucket alone — its LM-head part reduced first and its rows
      // exchanged at the end (row exchange), or its whole gradient complete only at the end.
      auto z = std::make_unique<dist::ZeroAdamW>(
          std::move(groups), a, pg_, o.zero,
          dist::zero_options_for(*model_, 25.0, tied, o.zero == 2 && o.row_exchange));
      zero_ = z.get();
      opt_ = std::move(z);
    } else {
      opt_ = optim::make_adamw(std::move(groups), a);
    }
  } else {
    optim::SGDOptions s;
    s.lr = o.lr;
    s.momentum = 0.9;
    opt_ = optim::make_sgd(std::move(groups), s);
  }
  opt_->attach_compute_copies(model_->compute_copies());  // AdamW writes them (bf16/fp16 runs)

  if (pg_) {  // rank 0's weights everywhere; ZeRO-2 reduces gradients itself, the others through DDP
    if (o.zero == 2)
      dist::broadcast_parameters(*model_, *pg_);
    else
      ddp_ = std::make_unique<dist::DistributedDataParallel>(
          *model_, pg_, dist::DDPOptions{.exchange_rows = o.row_exchange && model_->tied_embeddings()
                                                              ? std::vector<nn::Embedding*>{&model_->token_embedding()}
                                                              : std::vector<nn::Embedding*>{}});
  }

  // 5. Only now touch the disk (rank 0's files; every rank has checked the directory by now).
  if (o.out.empty()) return;
  if (pg_) pg_->barrier()->wait();
  if (o.overwrite && rank_ == 0)
    for (const auto& p : own_files(o.out)) fs::remove_all(p);
  if (rank_ == 0) fs::create_directories(o.out);
  const std::string metrics_path = (fs::path(o.out) / "metrics.jsonl").string();
  if (!resume_from.empty()) {
    const TrainState st = zero_ ? dist::load_sharded_checkpoint(resume_from, *model_, *zero_, o.model)
                                : load_checkpoint(resume_from, *model_, opt_.get(), o.model);
    step_ = st.step;
    default_generator().set_state(st.rng_seed, st.rng_offset);
    train_loader_->restore(st.loader.get<LoaderState>());
    last_checkpoint_ = resume_from;
    if (rank_ == 0) MetricsLog::truncate_after(metrics_path, step_);
    if (cb_.log) *cb_.log << "resumed from " << resume_from << " at step " << step_ << "\n";
  } else if (restart) {
    if (rank_ == 0) fs::remove(metrics_path);  // the failed start's events, none of them kept
    if (cb_.log) *cb_.log << "restarting the run in " << o.out << " from step 0 (it has no checkpoint yet)\n";
  }
  if (rank_ != 0) return;
  write_json_file(fs::path(o.out) / "run.json", {{"blutrain_version", BLU_VERSION},
                                                  {"model_config", o.model},
                                                  {"options", o.to_json()}});
  metrics_ = MetricsLog(metrics_path);
}

Trainer::~Trainer() = default;

void Trainer::print_header() {
  if (!cb_.log) return;
  std::ostream& os = *cb_.log;
  const TrainOptions& o = opt_s_;
  os << "config:\n" << o.to_json().dump(2) << "\n\n";
  print_parameter_table(os, model_->named_parameters());
  os << "\ndata: " << train_loader_->files().size() << " train shard(s), " << train_loader_->batches_per_epoch()
     << " batches per epoch";
  if (val_loader_) os << "; " << val_loader_->files().size() << " val shard(s)";
  os << "\ntokens per step: " << format_count(o.batch_size * o.seq_len * o.grad_accum) << " (B " << o.batch_size
     << " x T " << o.seq_len << " x grad_accum " << o.grad_accum << ")\n";
  os << "device: " << device_.str() << ", optimizer: " << o.optimizer << ", schedule: " << o.schedule
     << " (warmup " << o.warmup << ")\n";
  if (o.dp > 1)
    os << "data parallel: " << o.dp << " ranks (" << (pg_ ? pg_->backend() : "gloo") << "), " << (o.zero > 0 ? "ZeRO stage " + std::to_string(o.zero)
                                                                         : std::string("DDP all-reduce"))
       << "; batch per rank " << o.batch_size << ", tokens per step across ranks "
       << format_count(o.batch_size * o.seq_len * o.grad_accum * o.dp) << "\n";
  os << "\n";
  os.flush();
}

void apply_precision(models::CausalLM& model, const std::string& precision) {
  if (precision == "fp32" || precision == "tf32") {
    set_matmul_precision(precision == "tf32" ? "tf32" : "ieee");
  } else if (precision == "bf16") {
    model.set_compute_dtype(DType::bf16);
  } else if (precision == "fp16") {
    model.set_compute_dtype(DType::f16);
  } else {
    BLU_CHECK(false, "unknown precision '", precision, "' (expected fp32, tf32, bf16 or fp16)");
  }
}

double Trainer::train_step(StepStats& s) {
  const TrainOptions& o = opt_s_;
  opt_->zero_grad();
  double loss_sum = 0;
  for (int64_t micro = 0; micro < o.grad_accum; ++micro) {
    // Data parallel: only the last micro-batch's backward communicates.
    std::optional<dist::DistributedDataParallel::NoSync> no_sync;
    if (ddp_ && micro + 1 < o.grad_accum) no_sync.emplace(*ddp_);
    if (zero_ && zero_->stage() == 2) zero_->set_sync(micro + 1 == o.grad_accum);  // ZeRO-2 reduces in backward too
    const Batch b = train_loader_->next();
    // Only the loss is kept: with no handle left on the logits, cross-entropy's backward writes
    // their gradient over them (Note [Donated buffers], ops/dispatch.h).
    const Tensor loss = model_->forward(ids_tensor(b.inputs, o.batch_size, o.seq_len, device_),
                                        ids_tensor(b.targets, o.batch_size, o.seq_len, device_))
                            .loss;
    loss_sum += scalar_value(loss);
    // Gradients of the mean over all micro-batches: each micro-batch's loss scaled by 1/grad_accum
    // (and by the fp16 loss scale).
    const double factor = (scaler_ ? scaler_->scale() : 1.0) / double(o.grad_accum);
    const Tensor scaled = factor != 1.0 ? mul(loss, factor) : loss;
    scaled.backward();
  }
  // DDP first: the averaged gradients are the same on every rank, so unscaling and the overflow
  // check agree everywhere, and nothing touches a bucket while its all-reduce may still run.
  if (ddp_) ddp_->finish();
  // Without DDP (ZeRO-2: each rank holds its shard of the averaged gradient) each rank checks its
  // own gradients: the ranks take the overflow decision together, or one would skip while the
  // others wait.
  std::function<bool(bool)> agree;
  if (pg_ && !ddp_)
    agree = [this](bool finite) {
      const Tensor bad = full({1}, finite ? 0.0 : 1.0, DType::f32, device_);
      pg_->all_reduce(bad, dist::ReduceOp::max)->wait();
      return scalar_value(bad) == 0.0;
    };
  const bool zero2 = zero_ && zero_->stage() == 2;
  if (scaler_ && !(zero2 ? scaler_->unscale_and_check_grads({zero_->shard_gradient()}, agree)
                         : scaler_->unscale_and_check(model_->parameters(), agree))) {
    // fp16 overflow: no update this step; the scale has backed off.
    s.skipped = scaler_->skipped_steps();
    s.lr = schedule_.at(step_);
    s.loss = loss_sum / double(o.grad_accum);
    s.grad_norm = std::numeric_limits<double>::infinity();
    return s.loss;
  }
  if (scaler_) s.skipped = scaler_->skipped_steps();
  const double max_norm = o.grad_clip > 0 ? o.grad_clip : std::numeric_limits<double>::infinity();
  s.grad_norm = zero_ ? zero_->clip_grad_norm(max_norm) : optim::clip_grad_norm(model_->parameters(), max_norm);
  s.lr = schedule_.at(step_);
  opt_->set_lr(s.lr);
  if (std::isfinite(s.grad_norm)) {
    opt_->step();
  } else if (cb_.log) {  // clip_grad_norm leaves non-finite gradients alone: skip the update
    *cb_.log << "warning: gradient norm is " << s.grad_norm << " at step " << step_ + 1 << "; update skipped\n";
  }
  s.loss = mean_over_ranks(loss_sum / double(o.grad_accum));
  return s.loss;
}

double Trainer::mean_over_ranks(double v) {
  if (!pg_) return v;
  Tensor t = full({1}, v, DType::f64, pg_->backend() == "nccl" ? device_ : kCPU);
  pg_->all_reduce(t, dist::ReduceOp::avg)->wait();
  return scalar_value(t);
}

bool Trainer::any_rank(bool v) {
  if (!pg_) return v;
  Tensor t = full({1}, v ? 1.0 : 0.0, DType::f64, pg_->backend() == "nccl" ? device_ : kCPU);
  pg_->all_reduce(t, dist::ReduceOp::max)->wait();
  return scalar_value(t) > 0;
}

void Trainer::sample(int64_t step) {
  const int64_t n = opt_s_.sample_tokens;  // past the block size, generate() slides the window
  // Its own generator, seeded from (seed, step): sampling never moves the training stream.
  Generator gen(opt_s_.seed * 1000003ull + uint64_t(step), 0);
  std::vector<int32_t> ids;
  {
    NoGradGuard no_grad;
    model_->eval();
    std::vector<int32_t> prompt = cb_.sample_prompt;
    if (prompt.empty()) prompt.push_back(model_->vocab_size() > 50256 ? 50256 : 0);
    ids = model_->generate(prompt, n, opt_s_.sample_temperature, opt_s_.sample_top_k, gen);  // new tokens
    model_->train();
  }
  std::string text;
  if (cb_.decode) {
    text = cb_.decode(ids);
  } else {
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) text += ' ';
      text += std::to_string(ids[i]);
    }
  }
  if (cb_.log) *cb_.log << "--- sample at step " << step << " ---\n" << text << "\n---\n";
  metrics_.write({{"event", "sample"}, {"step", step}, {"text", text}});
}

std::string Trainer::save(int64_t step) {
  if (opt_s_.out.empty()) return "";
  TrainState st;
  st.step = step;
  st.rng_seed = default_generator().seed();
  st.rng_offset = default_generator().offset();
  st.loader = train_loader_->state();
  st.model_config = opt_s_.model;
  st.run = opt_s_.to_json();
  if (zero_) {
    last_checkpoint_ = dist::save_sharded_checkpoint(opt_s_.out, *model_, *zero_, st, int(opt_s_.keep_last));
  } else if (rank_ == 0) {
    last_checkpoint_ = save_checkpoint(opt_s_.out, *model_, opt_.get(), st, int(opt_s_.keep_last));
  } else {
    return "";  // the model is replicated: rank 0's file is the checkpoint
  }
  metrics_.write({{"event", "checkpoint"}, {"step", step}, {"path", last_checkpoint_}});
  if (cb_.log) *cb_.log << "checkpoint: " << last_checkpoint_ << "\n";
  return last_checkpoint_;
}

TrainSummary Trainer::run() {
  const TrainOptions& o = opt_s_;
  TrainSummary sum;
  sum.start_step = step_;
  print_header();
  Allocator& alloc = allocator_for(device_);
  const auto t_run = Clock::now();
  int64_t last_eval = -1, last_save = last_checkpoint_.empty() ? -1 : step_;
  const auto run_eval = [&] {
    const double v = mean_over_ranks(evaluate(*model_, *val_loader_, o.val_batches, device_));
    last_eval = step_;
    sum.final_val_loss = v;
    metrics_.write({{"event", "eval"}, {"step", step_}, {"val_loss", v}});
    if (cb_.log) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "val   %lld | val loss %.4f\n", static_cast<long long>(step_), v);
      *cb_.log << buf << std::flush;
    }
    if (cb_.on_eval) cb_.on_eval(step_, v);
  };

  while (step_ < o.steps) {
    StepStats s;
    s.total_steps = o.steps;
    alloc.reset_peak();
    const auto t0 = Clock::now();
    train_step(s);
    s.ms = seconds_since(t0) * 1e3;
    ++step_;
    s.step = step_;
    s.tokens = o.batch_size * o.seq_len * o.grad_accum * o.dp;  // all ranks; mem_bytes is this rank's
    s.tokens_per_s = double(s.tokens) / (s.ms / 1e3);
    s.mem_bytes = alloc.stats().peak_bytes;
    sum.tokens += s.tokens;
    sum.peak_mem_bytes = std::max(sum.peak_mem_bytes, s.mem_bytes);
    sum.final_train_loss = s.loss;
    metrics_.write({{"event", "step"},   {"step", s.step},       {"loss", s.loss},
                    {"lr", s.lr},        {"norm", s.grad_norm},  {"ms", s.ms},
                    {"tok_per_s", s.tokens_per_s}, {"mem_bytes", s.mem_bytes}});
    if (cb_.on_step) cb_.on_step(s);
    const bool stopping = any_rank(cb_.stop && cb_.stop->load());  // ranks stop at the same step
    if (cb_.log && (step_ % o.log_every == 0 || step_ == o.steps || step_ == sum.start_step + 1 || stopping))
      *cb_.log << format_progress_line(s) << "\n" << std::flush;

    if (val_loader_ && o.val_every > 0 && step_ % o.val_every == 0) run_eval();
    if (o.sample_every > 0 && step_ % o.sample_every == 0 && !stopping && rank_ == 0) sample(step_);
    if (o.ckpt_every > 0 && step_ % o.ckpt_every == 0 && step_ < o.steps) {
      save(step_);
      last_save = step_;
    }
    if (stopping && step_ < o.steps) {
      sum.interrupted = true;
      if (cb_.log) *cb_.log << "stop requested: finishing at step " << step_ << "\n";
      break;
    }
  }
  if (val_loader_ && last_eval != step_ && !sum.interrupted) run_eval();
  if (last_save != step_) save(step_);

  sum.end_step = step_;
  sum.seconds = seconds_since(t_run);
  sum.tokens_per_s = sum.seconds > 0 ? double(sum.tokens) / sum.seconds : 0;
  sum.checkpoint = last_checkpoint_;
  metrics_.write({{"event", "summary"},
                  {"step", step_},
                  {"interrupted", sum.interrupted},
                  {"train_loss", sum.final_train_loss},
                  {"val_loss", sum.final_val_loss},
                  {"tokens", sum.tokens},
                  {"seconds", sum.seconds},
                  {"tok_per_s", sum.tokens_per_s},
                  {"peak_mem_bytes", sum.peak_mem_bytes},
                  {"checkpoint", sum.checkpoint}});
  if (cb_.log) {
    std::ostream& os = *cb_.log;
    char buf[160];
    os << "\nsummary" << (sum.interrupted ? " (interrupted)" : "") << ":\n";
    os << "  steps        " << sum.start_step << " -> " << sum.end_step << " of " << o.steps << "\n";
    std::snprintf(buf, sizeof buf, "  train loss   %.4f\n", sum.final_train_loss);
    os << buf;
    if (sum.final_val_loss >= 0) {
      std::snprintf(buf, sizeof buf, "  val loss     %.4f\n", sum.final_val_loss);
      os << buf;
    }
    std::snprintf(buf, sizeof buf, "  tokens       %s in %.1f s (%.0f tok/s)\n", format_count(sum.tokens).c_str(),
                  sum.seconds, sum.tokens_per_s);
    os << buf;
    os << "  peak memory  " << format_bytes(sum.peak_mem_bytes) << " (" << device_.str() << " allocator)\n";
    os << "  checkpoint   " << (sum.checkpoint.empty() ? "(none: no --out)" : sum.checkpoint) << "\n" << std::flush;
  }
  return sum;
}

}  // namespace blu::train
