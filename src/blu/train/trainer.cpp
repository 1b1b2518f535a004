#include "blu/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <ostream>
#include <thread>

#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/core/error.h"
#include "blu/core/grad_mode.h"
#include "blu/dist/annotations.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/planner.h"
#include "blu/core/rng.h"
#include "blu/dist/strategy.h"
#include "blu/dist/consistency.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/env.h"
#include "blu/dist/hetero.h"
#include "blu/dist/mesh.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/zero.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/train/layout_setup.h"
#include "blu/io/checkpoint.h"
#include "blu/io/json_file.h"
#include "blu/offload/plan.h"
#include "blu/ops/precision.h"
#include "blu/memory/allocator.h"
#include "blu/memory/caching_allocator.h"
#include "blu/memory/device_pool.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/models/registry.h"
#include "blu/train/model_spec.h"
#include "blu/train/peak_flops.h"
#include "blu/train/run_dir.h"
#include "blu/train/run_record.h"
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
  return device == kCPU ? host : to_device(host, device);  // copy_ stays on one device
}

// The value of a one-element tensor on any device.
double scalar_value(const Tensor& t) {
  return t.device().is_cpu() ? t.item() : to_device(t, kCPU).item();
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

}  // namespace

namespace {

// What every rank of a job must agree on (dist/consistency.h): the options that shape a step or
// the order of the collectives (paths excluded: they may differ between machines), the model's
// config and parameter shapes, the world size and the build; and, advisory (rank 0 decides), the
// checkpoint the rank would resume from.
dist::Fingerprint fingerprint(const TrainOptions& o, const models::CausalLM& model, int world_size,
                              const std::string& resume_from, bool restart) {
  dist::Fingerprint fp;
  fp.push_back({"world_size", std::to_string(world_size)});
  fp.push_back({"blutrain_version", BLU_VERSION});
  for (const auto& [k, v] : o.model.items()) fp.push_back({"model." + k, v.dump()});
  const nlohmann::json options = o.to_json();  // items() refers into it
  for (const auto& [k, v] : options.items()) {
    if (k == "model" || k == "train_pattern" || k == "val_pattern" || k == "out" || k == "init_from") continue;
    fp.push_back({k, v.dump()});
  }
  fp.push_back({"resume", o.resume ? "true" : "false"});
  fp.push_back({"overwrite", o.overwrite ? "true" : "false"});
  const auto params = model.named_parameters();
  fp.push_back({"parameter count", std::to_string(params.size())});
  for (const auto& [name, t] : params) {
    std::string shape = "[";
    for (size_t i = 0; i < t.shape().size(); ++i) shape += (i ? ", " : "") + std::to_string(t.shape()[i]);
    fp.push_back({"parameter " + name, shape + "] " + std::string(dtype_name(t.dtype()))});
  }
  fp.push_back({"resume from", resume_from.empty() ? (restart ? "(restart from step 0)" : "(none)")
                                                   : fs::path(resume_from).filename().string(),
                false});
  return fp;
}

// A delay (ms, from BLU_TEST_RANK0_DELAY_MS) that rank 0 adds to its checkpoints and samples:
// tests use it to make rank 0 slower than the collectives' timeout.
void test_delay_on_rank0(int rank) {
  static const char* v = std::getenv("BLU_TEST_RANK0_DELAY_MS");
  if (rank == 0 && v && *v) std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(v)));
}

// A rank that stops answering: BLU_TEST_STALL="RANK:STEP" makes that rank sleep (an hour, not
// interrupted by signals) before training step STEP, as a hung rank would. Tests of the collectives'
// timeout and the flight recorder use it.
void test_stall(int rank, int64_t step) {
  static const char* v = std::getenv("BLU_TEST_STALL");
  if (!v || !*v) return;
  int r = -1;
  long long s = -1;
  if (std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step)
    std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  BLU_CHECK(!path.empty(), "expected a checkpoint file or a run directory, got an empty path");
  if (fs::is_directory(path)) {
    std::string reasons;
    const std::string latest = latest_valid_checkpoint(path, [&](const std::string& w) {
      reasons += "\n  " + w;
      std::cerr << w << "\n";
    });
    BLU_CHECK(!latest.empty(), "expected checkpoints (ckpt_*.safetensors) in the run directory ", path,
              reasons.empty() ? std::string(", found none") : ", none verifies:" + reasons);
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
  check_options(o, *model_);
  const dist::DistEnv env = dist::detect_env();
  const dist::Layout layout = resolve_run_layout(env);  // on a dp × pp × tp mesh; --dp replicas without --parallel
  // Each replica's rows of the global batch (batch_size · replicas rows), in proportion to the
  // replica weights; every TP rank and stage of a replica reads its replica's rows.
  const ReplicaRows split = replica_rows(layout, o.batch_size * layout.dp);
  const bool uneven = split.uneven;
  replica_rows_ = split.rows;
  BLU_CHECK(!uneven || !o.shuffle, "--parallel '", o.parallel, "': uneven replica weights read contiguous rows of "
            "one global batch; --shuffle is not supported with them");
  world_ = !o.parallel.empty() ? env.world_size : int(o.dp);
  BLU_CHECK(!o.parallel.empty() || env.world_size == o.dp, "--dp ", o.dp,
            " must equal the number of launched processes (WORLD_SIZE=", env.world_size, " from ", env.source,
            "); ",
            env.world_size > 1 ? "add --dp " + std::to_string(env.world_size) +
                                     " (or a --parallel layout of as many ranks) to the train command, or launch " +
                                     std::to_string(o.dp) + " process(es)"
                               : "start with `blutrain launch -n " + std::to_string(o.dp) + " -- blutrain train ...`");
  // cpu:N: each rank's own device pool N (memory/device_pool.h), over Gloo like cpu.
  BLU_CHECK(world_ == 1 || o.device == "cuda" || Device(o.device).is_cpu(), "a job of ", world_,
            " ranks runs on --device cpu (Gloo; cpu:N, each rank its own device pool N) or --device cuda (NCCL, each "
            "rank on cuda:LOCAL_RANK); got --device ", o.device);
  // This rank's place on the mesh (row-major dp × pp × tp: dist/mesh.h).
  const dist::DeviceMesh grid(env.rank, world_, {{"dp", layout.dp}, {"pp", layout.pp}, {"tp", layout.tp}});
  const int replica = grid.coordinate("dp");
  local_batch_ = replica_rows_[size_t(replica)];
  samples_here_ = env.rank == 0 || (layout.tp > 1 && replica == 0 && grid.coordinate("pp") == 0);
  if (o.compile) {
    // What the compiler does not capture yet, refused before anything runs (never half-compiled).
    BLU_CHECK(!pipelined_, "--compile: pipeline layouts (--parallel '", o.parallel,
              "') are not supported by the compiler yet; drop --compile or use --dp/--zero");
    BLU_CHECK(o.parallel.empty() || (layout.tp == 1 && !is_pipelined(layout) && !uneven), "--compile: the layout '",
              o.parallel, "' (tensor parallelism, a pipeline or uneven replica weights) is not supported by the ",
              "compiler yet; drop --compile or use --dp/--zero");
    // A budget is honoured by the plan with the state on the device (memory_probe.cpp): the
    // compiler does not capture the offloaded update's host side.
    BLU_CHECK(o.offload_state == "auto" || o.offload_state == "none",
              "--compile: optimizer state offload (--offload-state ", o.offload_state, ") is not supported by the ",
              "compiler yet; drop --compile or --offload-state (a --gpu-memory-budget is planned with the state on the ",
              "device under --compile)");
    BLU_CHECK(!o.offload_activations, "--compile: --offload-activations is not supported by the compiler yet (its ",
              "copies to the host run outside dispatch); drop one of the two");
    BLU_CHECK(opt_s_.zero != 3, "--compile: ZeRO-3 (--zero 3) is not supported by the compiler yet (its block hooks ",
              "swap the parameters' storages outside dispatch, which capture does not see); use --zero 0, 1 or 2");
    // Before the memory probe, which plans a capture with the same list (memory_probe.cpp).
    if (!o.compile_exclude.empty()) compiler::set_excluded_ops(compiler::parse_op_list(o.compile_exclude));
  } else {
    BLU_CHECK(!o.compile_log && o.compile_exclude.empty() && !o.compile_remat,
              "--compile-log, --compile-exclude and --compile-remat need --compile");
  }
  BLU_CHECK(o.compile_fuse == "on" || o.compile_fuse == "off", "--compile-fuse: expected on or off, got '", o.compile_fuse,
            "'");
  rank_ = env.rank;
  if (rank_ != 0) cb_.log = nullptr;  // rank 0 speaks for the job
  if (cb_.log) warn_about_schedule(o, *cb_.log);
  schedule_.kind = optim::LRSchedule::parse(o.schedule);
  schedule_.max_lr = o.lr;
  schedule_.min_lr = o.min_lr;
  schedule_.warmup_steps = o.warmup;
  schedule_.total_steps = o.steps;
  device_ = Device(o.device);
#ifndef BLU_HAVE_CUDA
  BLU_CHECK(device_.is_cpu(), "--device ", o.device, ": this build has no CUDA backend (expected cpu)");
#else
  if (device_.is_cuda() && world_ > 1) device_ = Device(DeviceType::cuda, env.local_rank);  // one GPU per rank
  if (device_.is_cuda()) cuda::set_device(device_.index);
#endif
  BLU_CHECK(o.peak_tflops >= 0, "--peak-tflops must be >= 0 (0: the GPU's datasheet peak), got ", o.peak_tflops);
  peak_tflops_ = o.peak_tflops;
#ifdef BLU_HAVE_CUDA
  if (peak_tflops_ == 0 && device_.is_cuda()) peak_tflops_ = dense_peak_tflops(cuda::device_name(device_.index), o.precision);
#endif

  // 2. The run directory: what a resume starts from (every refusal before anything is written).
  const ResumePoint resume_point = find_resume_point(o, cb_.log);
  std::string resume_from = resume_point.from;
  bool restart = resume_point.restart;  // --auto-resume over a run of this model without a checkpoint

  // 3. Data (shards are validated here, still before anything is written).
  LoaderOptions lo;
  lo.vocab_size = model_->vocab_size();
  lo.shuffle = o.shuffle;
  lo.seed = o.seed;
  // Replicas read apart; a replica's pipeline stages and TP ranks all read the same batches (the
  // first stage's ids, the last stage's targets).
  const int world = world_;
  const int data_rank = replica, data_world = layout.dp;
  LoaderOptions train_lo = lo;
  if (uneven) train_lo.rows = replica_rows_;
  train_loader_ =
      std::make_unique<DataLoader>(train_files, local_batch_, o.seq_len, data_rank, data_world, train_lo);
  if (!o.val_pattern.empty()) {
    LoaderOptions vo = lo;
    vo.shuffle = false;  // validation reads the same batches every time
    vo.prefetch = 0;  // read on demand: evaluation is occasional and resets the loader
    val_loader_ =
        std::make_unique<DataLoader>(val_files, o.batch_size, o.seq_len, data_rank, data_world, vo);
  }

  // 4. Model and optimizer.
  int64_t model_params = 0;  // the whole model's, before any split
  for (const Tensor& p : model_->parameters()) model_params += p.numel();
  // The starting weights of --init-from; a resume takes them (and everything else) from its checkpoint.
  if (!o.init_from.empty() && resume_from.empty()) {
    init_weights(*model_, o.init_from, o.model);
    if (cb_.log) *cb_.log << "initialised from " << o.init_from << "\n";
  }
  // A rank's device gets only what it trains, never the whole model: a pipeline stage's own
  // parameters (the others arrive byte-less, as the stage keeps them), a tensor-parallel rank's
  // shard. The split needs the tp group, so under tensor parallelism the model stays on the CPU
  // until the groups exist (below).
  std::set<std::string> stage_names;  // a pipeline stage's parameters, found on the whole model
  int64_t whole_bytes = 0;
  for (const Tensor& p : model_->parameters()) whole_bytes += int64_t(p.nbytes());
  if (pipelined_) {
    const dist::PipelineOptions po = pipeline_options(layout);
    const dist::StageLayout sl = dist::split_blocks(int64_t(model_->num_blocks()), layout.pp, po.chunks, po.layers);
    stage_names = dist::stage_parameter_names(*model_, sl, grid.coordinate("pp"));
  }
  const auto place = [&] {
    std::set<std::string> mine = stage_names;
    if (!pipelined_)
      for (const auto& [name, p] : model_->named_parameters()) mine.insert(name);
    const int64_t placed = dist::place_stage_parameters(*model_, mine, device_);
    if (cb_.log && device_ != kCPU && (pipelined_ || layout.tp > 1))
      *cb_.log << (pipelined_ ? "pipeline stage 0" : "tensor parallel rank 0")
               << (pipelined_ && layout.tp > 1 ? " (a tensor-parallel shard)" : "") << ": " << placed
               << " of the model's " << whole_bytes << " parameter bytes placed on " << device_.str() << " ("
               << format_bytes(placed) << ")\n";
  };
  if (layout.tp == 1) place();
  model_->train();
  apply_precision(*model_, o.precision);
  // auto: the budget planner picks the policy (memory_probe.cpp); until then, none.
  BLU_CHECK(o.recompute != "auto" || o.gpu_memory_budget > 0, "--recompute auto picks the least recompute that fits a ",
            "--gpu-memory-budget; give one, or name the setting (none, selective, block:N, block)");
  model_->set_activation_policy(
      models::ActivationPolicy::parse(o.recompute == "auto" ? "none" : o.recompute, o.offload_activations));
  std::shared_ptr<dist::ProcessGroup> pg, pipeline_gradients;
  if (world > 1) {  // the job's process group: rendezvous through rank 0's store
    const double timeout_s = o.dist_timeout > 0 ? o.dist_timeout : env.dist_timeout_s;  // 0: each one's default
    const auto ms = [&](double fallback_s) {
      return dist::Milliseconds(int64_t((timeout_s > 0 ? timeout_s : fallback_s) * 1000));
    };
    if (!store_)  // made already when --parallel was decided
      store_ = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, rank_ == 0,
                                                dist::StoreOptions::from_env(ms(30)));
    // Before any collective: the ranks were started alike (else every rank fails here, naming the
    // keys), and every rank resumes from rank 0's choice.
    const std::vector<std::string> notes =
        dist::check_consistency(*store_, rank_, world, fingerprint(o, *model_, world, resume_from, restart), ms(30));
    for (const std::string& n : notes)
      if (cb_.log) *cb_.log << "note: the ranks differ on " << n << "; every rank follows rank 0\n";
    const auto agreed = nlohmann::json::parse(
        dist::agree_on(*store_, rank_, "resume", nlohmann::json{{"from", resume_from}, {"restart", restart}}.dump()));
    resume_from = agreed["from"].get<std::string>();
    restart = agreed["restart"].get<bool>();
    // Every group of the layout (for a hybrid the mesh's, created in one order on every rank).
    LayoutGroups groups = make_layout_groups(*store_, rank_, world, layout, device_, timeout_s);
    mesh_ = std::move(groups.mesh);
    pg = groups.job;
    pipeline_gradients = groups.pipeline_gradients;
    pg->set_phase("start-up");
    // On a collective's timeout, a fatal error or SIGTERM each rank dumps its last collectives
    // here (dist/flight_recorder.h).
    if (!o.out.empty())
      dist::FlightRecorder::global().set_dump_target((fs::path(o.out) / "flight_recorder").string(), rank_, world);
  }
  if (layout.tp > 1) {  // this rank's shard, cut on the CPU, then placed (a stage's part of it)
    split_tensor_parallel(*model_, layout, *mesh_, o.precision);
    place();
  }
  model_->set_loss_chunks(o.loss_chunks);  // after the split: refused under tensor parallelism, by name
  if (o.compile) pg = compiler::capturable(std::move(pg));  // collectives recorded into the captured step
  dist::StrategyConfig sc;
  sc.zero = o.zero;
  sc.row_exchange = o.row_exchange;
  sc.fp16_loss_scaling = o.precision == "fp16";
  if (uneven) {
    sc.batch_share = double(local_batch_) / double(o.batch_size * layout.dp);
    // The tied embedding's row exchange gathers the same number of token ids from every rank:
    // replicas of unequal rows reduce its gradient densely instead.
    sc.row_exchange = false;
  }
  const bool split_model = layout.tp > 1 || is_pipelined(layout);  // checked with the layout (step 1)
  const bool budgets = o.gpu_memory_budget > 0 || o.host_memory_budget > 0;
  if ((o.zero > 2 || split_model) && o.offload_state == "optimizer" && !budgets) {
    // ZeRO-3 shards the moments and streams their shard through the device (dist/zero.h); tensor
    // and pipeline layouts offload the state of each rank's own parameters. Without a budget the
    // state is offloaded as asked, the update on the faster side by the probes.
    BLU_CHECK(o.zero <= 1 || o.offload_update != "cpu", "--zero ", o.zero,
              " --offload-state optimizer: the moments stream through the device (--offload-update gpu or auto, got ",
              o.offload_update, ")");
    sc.offload_state = true;
    sc.offload.chunk_elements = o.offload_chunk;
    sc.offload.overlap_forward = o.offload_overlap && !is_pipelined(layout);
    if (o.zero > 1) {
      sc.offload.update = offload::UpdateOn::device;
    } else if (o.offload_update != "auto") {
      sc.offload.update = offload::parse_update(o.offload_update);
    } else {  // the faster by the planner's probes, for this rank's share of the parameters
      offload::PlanInput in;
      for (const Tensor& p : model_->parameters()) in.param_elements += p.numel();
      in.param_elements /= int64_t(layout.tp) * layout.pp;
      in.offload = sc.offload;
      in.host_adamw_elements_per_s = offload::probe_host_adamw(0);
      if (device_ != kCPU) in.transfer_bytes_per_s = offload::probe_transfer(*offload::make_copy_engine(device_));
      sc.offload.update = offload::faster_update(in);
    }
    if (cb_.log)
      *cb_.log << "optimizer state on the host (each rank's own parameters), update on the "
               << offload::update_name(sc.offload.update) << "\n";
  } else if (budgets || o.offload_state != "auto" || o.offload_update != "auto") {
    plan_memory(sc, layout, pg, pipeline_gradients);
  }
  const dist::OptimizerConfig oc{.name = o.optimizer, .lr = o.lr, .weight_decay = o.weight_decay};
  strategy_ = make_layout_strategy(*model_, layout, mesh_.get(), pg, sc, oc, o.precision, pipeline_gradients);
  if (layout.tp > 1 && cb_.log) {
    int64_t shard = 0;
    for (const Tensor& p : model_->parameters()) shard += p.numel();
    *cb_.log << "tensor parallel: this rank's shard holds " << shard << " of the model's " << model_params
             << " parameters\n";
  }
  if (o.compile) {
    compiler::CompileOptions co;
    co.log = o.compile_log && rank_ == 0;  // guard failures are printed on every rank
    co.log_stream = cb_.log;
    co.config = o.precision + ", grad_accum " + std::to_string(o.grad_accum) + ", " + strategy_->describe();
    co.remat = o.compile_remat;
    co.fusion = compiler::fusion_for(o.compile_fuse, [log = co.log, stream = cb_.log](const std::string& line) {
      if (log) (stream ? *stream : std::cerr) << "compile: " << line << "\n" << std::flush;
    }, rank_ == 0 ? o.compile_export : "");
    compiled_ = std::make_unique<compiler::CompiledStep>(co);
    compiled_->set_named(compiler::BufferKind::parameter, model_->named_parameters());
    for (int64_t i = 0; i < 2 * o.grad_accum; ++i) compile_inputs_.push_back(empty({o.batch_size, o.seq_len}, DType::i32, device_));
  }

  // 5. Only now touch the disk (rank 0's files; every rank has checked the directory by now).
  if (o.out.empty()) return;
  if (mesh_) mesh_->world().barrier()->wait();
  else strategy_->barrier();
  if (o.overwrite && rank_ == 0)
    for (const auto& p : own_files(o.out)) fs::remove_all(p);
  if (rank_ == 0) fs::create_directories(o.out);
  const std::string metrics_path = (fs::path(o.out) / "metrics.jsonl").string();
  if (!resume_from.empty()) {
    const TrainState st = strategy_->load(resume_from, *model_, o.model);
    step_ = st.step;
    default_generator().set_state(st.rng_seed, st.rng_offset);
    train_loader_->restore(st.loader.get<LoaderState>());
    last_checkpoint_ = resume_from;
    if (rank_ == 0) MetricsLog::truncate_after(metrics_path, step_);
    if (o.keep_best && fs::exists(fs::path(o.out) / kBestCheckpoint) && fs::exists(metrics_path)) {
      // The best validation loss so far: the lowest of the kept eval events.
      std::ifstream in(metrics_path);
      std::string line;
      while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.value("event", "") == "eval" && j.contains("val_loss") && j["val_loss"].is_number())
          best_val_ = std::min(best_val_, j["val_loss"].get<double>());
      }
    }
    if (cb_.log) *cb_.log << "resumed from " << resume_from << " at step " << step_ << "\n";
  } else if (restart) {
    if (rank_ == 0) fs::remove(metrics_path);  // the failed start's events, none of them kept
    if (cb_.log) *cb_.log << "restarting the run in " << o.out << " from step 0 (it has no checkpoint yet)\n";
  }
  if (rank_ != 0) return;
  // run.json: this invocation's options on top, every invocation of the run in "invocations"; a
  // resume names the options that changed since the last one.
  const bool continued = !resume_from.empty() || restart;
  const nlohmann::json now = o.to_json();
  if (continued && cb_.log) {
    std::string changed;
    for (const OptionChange& c : changed_options(recorded_options(o.out), now))
      if (c.key != "out" && c.key != "steps") changed += (changed.empty() ? "" : ", ") + c.str();
    if (!changed.empty()) *cb_.log << "note: changed since the run's last invocation: " << changed << "\n";
  }
  write_run_record(o.out, now, o.model, world_, step_, continued);
  metrics_ = MetricsLog(metrics_path);
}

Trainer::~Trainer() = default;

void Trainer::compute_baseline() {
  const TrainOptions& o = opt_s_;
  if (!o.baseline || !val_loader_) return;
  const int64_t V = o.baseline_vocab > 0 ? o.baseline_vocab : model_->vocab_size();
  const NgramCounts counts(train_loader_->files(), int32_t(V), o.baseline_max_tokens);
  BaselineLoss b = baseline_loss(counts, *val_loader_, o.val_batches);
  b.unigram = strategy_->mean_over_ranks(b.unigram);
  b.bigram = strategy_->mean_over_ranks(b.bigram);
  baseline_ = b;
  baseline_train_tokens_ = counts.tokens();
  metrics_.write({{"event", "baseline"},
                  {"step", step_},
                  {"unigram_loss", b.unigram},
                  {"bigram_loss", b.bigram},
                  {"smoothing", "add-one"},
                  {"vocab", V},
                  {"train_tokens", counts.tokens()},
                  {"val_tokens", b.tokens}});
}

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
  if (baseline_) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "baseline: val loss of n-gram counts: unigram %.4f, bigram %.4f", baseline_->unigram,
                  baseline_->bigram);
    os << buf << " (add-one smoothing, " << format_count(baseline_train_tokens_) << " train tokens counted, "
       << format_count(baseline_->tokens) << " val tokens scored)\n";
  }
  if (!layout_text_.empty()) {  // every --parallel run says what it runs
    os << "parallel layout: " << layout_text_ << " over " << world_ << " ranks: " << strategy_->describe() << "\n";
    os << "rows per replica:";
    for (int64_t r : replica_rows_) os << " " << r;
    os << " (a global batch of " << o.batch_size * int64_t(replica_rows_.size()) << " rows; tokens per step "
       << format_count(o.batch_size * o.seq_len * o.grad_accum * o.dp) << ")\n";
  }
  if (pipelined_ && !mesh_)
    os << "pipeline parallel: " << strategy_->describe() << " over " << world_ << " ranks\n";
  else if (o.dp > 1 && !mesh_)
    os << "data parallel: " << strategy_->describe()
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

// --parallel auto, after the first steps: the planner's prediction for the layout it picked against
// the step time of the second logged line (the steps after the first: set-up and warm-up stay
// out) and the largest allocator peak over the ranks since the line before (gathered through the
// store; every rank reads the same steps, so every rank gets here), with the errors as bench
// --parallel reports them: (predicted − measured) / measured.
void Trainer::check_auto_prediction(const StepStats& s) {
  double peak = double(s.mem_bytes);
  if (store_ && world_ > 1) {
    const std::string key = "parallel_auto_peak/" + std::to_string(rank_);
    store_->set(key, std::to_string(s.mem_bytes));
    if (rank_ == 0)
      for (int r = 1; r < world_; ++r) peak = std::max(peak, std::stod(store_->get("parallel_auto_peak/" + std::to_string(r))));
  }
  if (rank_ != 0) return;
  const double pred_ms = (*auto_prediction_)["step_ms"].get<double>();
  const double pred_mib = (*auto_prediction_)["memory_mib"].get<double>(), mib = peak / double(1 << 20);
  const double e_step = (pred_ms - s.ms) / s.ms, e_mem = (pred_mib - mib) / mib;
  metrics_.write({{"event", "parallel_auto"}, {"step", s.step}, {"layout", (*auto_prediction_)["layout"]},
                  {"predicted_ms", pred_ms}, {"predicted_mib", pred_mib}, {"ms", s.ms}, {"mib", mib},
                  {"error_step", e_step}, {"error_memory", e_mem}});
  if (cb_.log) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "parallel auto: measured %.2f ms a step and %.1f MiB on the most loaded rank; predicted %.2f ms "
                  "and %.1f MiB (error %+.1f%% and %+.1f%%)\n",
                  s.ms, mib, pred_ms, pred_mib, 100 * e_step, 100 * e_mem);
    *cb_.log << buf;
  }
}

dist::StepValues Trainer::train_step() {
  const TrainOptions& o = opt_s_;
  // Only the loss is kept: with no handle left on the logits, cross-entropy's backward writes
  // their gradient over them (Note [Donated buffers], ops/dispatch.h).
  const auto loss_of = [&](int64_t) {
    const Batch b = train_loader_->next();
    return model_->forward(ids_tensor(b.inputs, local_batch_, o.seq_len, device_),
                           ids_tensor(b.targets, local_batch_, o.seq_len, device_))
        .loss;
  };
  if (pipelined_) {  // the stages run the micro-batches' forwards and backwards by the schedule
    // The step's batches are read once, in order; the stage may ask for micro-batch i more than
    // once (its shape first, then its ids or targets).
    std::vector<std::pair<Tensor, Tensor>> batches;
    for (int64_t i = 0; i < o.grad_accum; ++i) {
      const Batch b = train_loader_->next();
      batches.emplace_back(ids_tensor(b.inputs, local_batch_, o.seq_len, device_),
                           ids_tensor(b.targets, local_batch_, o.seq_len, device_));
    }
    return strategy_->step(o.grad_accum, [&](int64_t i) { return batches.at(size_t(i)); }, schedule_.at(step_),
                           o.grad_clip);
  }
  if (compiled_) {
    // The batches are read before the capture, into the same tensors every step (step inputs of
    // the compiled step); the step itself is Strategy::step, compiled.
    for (int64_t i = 0; i < o.grad_accum; ++i) {
      const Batch b = train_loader_->next();
      NoGradGuard no_grad;
      copy_(compile_inputs_[size_t(2 * i)], ids_tensor(b.inputs, o.batch_size, o.seq_len, device_));
      copy_(compile_inputs_[size_t(2 * i + 1)], ids_tensor(b.targets, o.batch_size, o.seq_len, device_));
    }
    dist::StepValues v;
    const double lr = schedule_.at(step_);
    compiled_->run(compile_inputs_, [&] {
      v = strategy_->step(o.grad_accum, [&](int64_t i) {
        return std::pair<Tensor, Tensor>{compile_inputs_[size_t(2 * i)], compile_inputs_[size_t(2 * i + 1)]};
      }, lr, o.grad_clip);
      // The next step drops the gradients before its forward anyway; dropped inside the captured
      // step they are its temporaries, which the plan packs into the bytes the activations free
      // in backward, instead of step outputs beside the arena.
      strategy_->optimizer().zero_grad();
    });
    return v;
  }
  return strategy_->step(o.grad_accum, loss_of, schedule_.at(step_), o.grad_clip);
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
  std::string written;
  // Writing takes as long as the disk does: the collectives inside a sharded save get the work
  // timeout, and the other ranks wait for rank 0's file behind a store barrier.
  set_phase("the checkpoint at step " + std::to_string(step));
  with_work_timeout([&] {
    written = strategy_->save(opt_s_.out, *model_, st, int(opt_s_.keep_last));
    test_delay_on_rank0(rank_);
  });
  wait_for_rank0("rank 0's checkpoint at step " + std::to_string(step));
  if (written.empty()) return "";  // the model is replicated: rank 0's file is the checkpoint
  last_checkpoint_ = written;
  metrics_.write({{"event", "checkpoint"}, {"step", step}, {"path", last_checkpoint_}});
  if (cb_.log) *cb_.log << "checkpoint: " << last_checkpoint_ << "\n";
  return last_checkpoint_;
}

void Trainer::set_phase(const std::string& phase) {
  if (dist::ProcessGroup* pg = strategy_->process_group()) pg->set_phase(phase);
}

void Trainer::wait_for_rank0(const std::string& what) {
  if (!store_) return;
  dist::store_barrier(*store_, "trainer/work/" + std::to_string(++work_barriers_), world_,
                      dist::Milliseconds(int64_t(opt_s_.dist_work_timeout * 1000)), what);
}

void Trainer::with_work_timeout(const std::function<void()>& f) {
  dist::ProcessGroup* pg = strategy_->process_group();
  if (!pg) return f();
  const auto saved = pg->timeout();
  pg->set_timeout(std::max(saved, dist::Milliseconds(int64_t(opt_s_.dist_work_timeout * 1000))));
  try {
    f();
  } catch (...) {
    pg->set_timeout(saved);
    throw;
  }
  pg->set_timeout(saved);
}

void Trainer::keep_best(double val_loss) {
  if (opt_s_.out.empty() || rank_ != 0 || last_checkpoint_.empty()) return;
  // Copy, then rename: a reader never sees half a file under the final name.
  const fs::path best = fs::path(opt_s_.out) / kBestCheckpoint;
  const fs::path tmp = fs::path(opt_s_.out) / (std::string(".") + kBestCheckpoint + ".tmp");
  fs::copy_file(last_checkpoint_, tmp, fs::copy_options::overwrite_existing);
  fs::rename(tmp, best);
  metrics_.write({{"event", "best"}, {"step", step_}, {"val_loss", val_loss}, {"path", best.string()}});
}

TrainSummary Trainer::run() {
  const TrainOptions& o = opt_s_;
  TrainSummary sum;
  sum.start_step = step_;
  if (step_ >= o.steps && cb_.log)
    *cb_.log << "the run in " << o.out << " finished at step " << step_ << " of --steps " << o.steps
             << ": nothing left to train; pass a larger --steps to continue it\n";
  compute_baseline();
  if (baseline_) {
    sum.baseline_unigram = baseline_->unigram;
    sum.baseline_bigram = baseline_->bigram;
  }
  print_header();
  Allocator& alloc = allocator_for(device_);
  const auto t_run = Clock::now();
  int64_t last_eval = -1, last_save = last_checkpoint_.empty() ? -1 : step_;
  const auto run_eval = [&] {
    set_phase("validation at step " + std::to_string(step_));
    double v = 0;
    {
      const auto full = strategy_->full_parameters();  // ZeRO-3: the whole model for the evaluation
      v = evaluate(*model_, *val_loader_, o.val_batches, device_);
    }
    with_work_timeout([&] { v = strategy_->mean_over_ranks(v); });  // the ranks may finish apart
    last_eval = step_;
    sum.final_val_loss = v;
    nlohmann::json ev = {{"event", "eval"}, {"step", step_}, {"val_loss", v}};
    if (baseline_) {
      ev["bigram_loss"] = baseline_->bigram;
      ev["unigram_loss"] = baseline_->unigram;
    }
    metrics_.write(ev);
    if (cb_.log) {
      char buf[160];
      const int w = std::snprintf(buf, sizeof buf, "val   %lld | val loss %.4f", static_cast<long long>(step_), v);
      if (baseline_ && w > 0)
        std::snprintf(buf + w, sizeof buf - size_t(w), " | bigram %.4f (%+.4f) | unigram %.4f", baseline_->bigram,
                      v - baseline_->bigram, baseline_->unigram);
      *cb_.log << buf << "\n" << std::flush;
    }
    if (o.keep_best && v < best_val_) {
      best_val_ = v;
      if (last_save != step_) {
        save(step_);
        last_save = step_;
      }
      keep_best(v);
    }
    if (cb_.on_eval) cb_.on_eval(step_, v);
  };

  // A step's loss and norm stay on the device until a logged step reads them (Strategy::read: one
  // host read, and with several ranks one small collective that also combines the stop flags).
  // Steps that evaluate, sample or checkpoint, the first and the last are logged steps too; the
  // time and tokens of a logged step's line are the averages since the previous one.
  auto t_read = Clock::now();
  int64_t since_read = 0;
  alloc.reset_peak();
  while (step_ < o.steps) {
    if (store_) set_phase("training step " + std::to_string(step_ + 1));
    test_stall(rank_, step_ + 1);
    const dist::StepValues v = train_step();
    ++step_;
    ++since_read;
    const bool local_stop = cb_.stop && cb_.stop->load();
    const bool read = step_ % o.log_every == 0 || step_ == o.steps || step_ == sum.start_step + 1 ||
                      (o.val_every > 0 && step_ % o.val_every == 0) ||
                      (o.sample_every > 0 && step_ % o.sample_every == 0) ||
                      (o.ckpt_every > 0 && step_ % o.ckpt_every == 0) || (local_stop && !strategy_->process_group());
    const int64_t step_tokens = o.batch_size * o.seq_len * o.grad_accum * o.dp;  // all replicas
    sum.tokens += step_tokens;
    if (!read) continue;
    const dist::StepReadout r = strategy_->read(v, local_stop);
    if (!std::isfinite(r.grad_norm) && cb_.log) {  // the gate skipped the update on the device
      if (r.fp16_skipped >= 0)
        *cb_.log << "fp16: gradient overflow at step " << step_ << "; update skipped (" << r.fp16_skipped
                 << " so far), the loss scale backed off\n";
      else
        *cb_.log << "warning: gradient norm is " << r.grad_norm << " at step " << step_ << "; update skipped\n";
    }
    StepStats s;
    s.total_steps = o.steps;
    s.step = step_;
    s.loss = r.loss;
    s.grad_norm = r.grad_norm;
    s.lr = v.lr;
    if (r.fp16_skipped >= 0) s.skipped = r.fp16_skipped;
    s.ms = seconds_since(t_read) * 1e3 / double(since_read);
    s.tokens = step_tokens;  // mem_bytes is this rank's
    s.tokens_per_s = double(s.tokens) / (s.ms / 1e3);
    s.mem_bytes = alloc.stats().peak_bytes;
    s.elapsed_s = seconds_since(t_run);
    if (step_ < o.steps) s.eta_s = s.elapsed_s / double(step_ - sum.start_step) * double(o.steps - step_);
    if (peak_tflops_ > 0)
      s.mfu = s.tokens_per_s / double(world_) * model_->flops_per_token(o.seq_len) / (peak_tflops_ * 1e12);
    alloc.reset_peak();
    since_read = 0;
    sum.peak_mem_bytes = std::max(sum.peak_mem_bytes, s.mem_bytes);
    sum.final_train_loss = s.loss;
    nlohmann::json step_ev = {{"event", "step"},   {"step", s.step},       {"loss", s.loss},
                              {"lr", s.lr},        {"norm", s.grad_norm},  {"ms", s.ms},
                              {"tok_per_s", s.tokens_per_s}, {"mem_bytes", s.mem_bytes}};
    if (s.mfu > 0) step_ev["mfu"] = s.mfu;
    metrics_.write(step_ev);
    if (cb_.on_step) cb_.on_step(s);
    // Every rank saw the same flags in read(), so the ranks stop at the same step; alone, a stop
    // asked for during on_step counts at once.
    const bool stopping = r.stop || (!strategy_->process_group() && cb_.stop && cb_.stop->load());
    if (cb_.log) *cb_.log << format_progress_line(s) << "\n" << std::flush;
    if (auto_prediction_ && ++auto_reads_ == 2) check_auto_prediction(s);

    if (val_loader_ && o.val_every > 0 && step_ % o.val_every == 0) run_eval();
    if (o.sample_every > 0 && step_ % o.sample_every == 0 && !stopping) {
      {
        const auto full = strategy_->full_parameters();  // every rank takes part under ZeRO-3
        if (samples_here_) {  // rank 0, and under tensor parallelism the rest of its TP group
          sample(step_);
          test_delay_on_rank0(rank_);
        }
      }
      wait_for_rank0("rank 0's sample at step " + std::to_string(step_));
    }
    if (o.ckpt_every > 0 && step_ % o.ckpt_every == 0 && step_ < o.steps) {
      save(step_);
      last_save = step_;
    }
    // The next line's time per step starts here: validation, samples and checkpoints stay out of
    // its tok/s (they are in the elapsed time).
    t_read = Clock::now();
    if (stopping && step_ < o.steps) {
      sum.interrupted = true;
      if (cb_.log) *cb_.log << "stop requested: finishing at step " << step_ << "\n";
      break;
    }
  }
  strategy_->finish_update();  // the last update, when it runs behind the forward (offload/offload_adamw.h)
  if (val_loader_ && last_eval != step_ && !sum.interrupted) run_eval();
  if (last_save != step_) save(step_);
  if (compiled_) {  // how the steps ran: compiled, eager (warm-up, past the variant limit), fallback
    const auto& c = compiled_->counts();
    nlohmann::json ev = {{"event", "compile"}, {"step", step_},           {"compiled", c.compiled},
                         {"eager", c.eager},   {"fallback", c.fallback}, {"guard_failures", c.guard_failures},
                         {"streamed", c.streamed},
                         {"variants", compiled_->variants().size()}};
    if (!compiled_->variants().empty()) {
      const compiler::Variant& v = *compiled_->variants()[0];
      ev["graph_ops"] = v.graph.ops.size();
      ev["collectives"] = std::count_if(v.graph.ops.begin(), v.graph.ops.end(),
                                        [](const compiler::Op& op) { return op.kind == compiler::OpKind::collective; });
      ev["plan_peak_bytes"] = v.runtime->plan().peak_bytes();
      if (opt_s_.compile_remat) {
        ev["remat_buffers"] = v.remat_buffers;
        ev["remat_bytes"] = v.remat_bytes;
      }
      ev["compile_ms"] = v.capture_ms + v.plan_ms;
    }
    metrics_.write(ev);
    if (cb_.log)
      *cb_.log << "compiled steps: " << c.compiled << " compiled, " << c.eager << " eager, " << c.fallback
               << " fallback, " << c.guard_failures << " guard failures\n";
  }

  sum.end_step = step_;
  if (std::isfinite(best_val_)) sum.best_val_loss = best_val_;
  sum.seconds = seconds_since(t_run);
  sum.tokens_per_s = sum.seconds > 0 ? double(sum.tokens) / sum.seconds : 0;
  sum.checkpoint = last_checkpoint_;
  metrics_.write({{"event", "summary"},
                  {"step", step_},
                  {"interrupted", sum.interrupted},
                  {"train_loss", sum.final_train_loss},
                  {"val_loss", sum.final_val_loss},
                  {"best_val_loss", sum.best_val_loss},
                  {"unigram_loss", sum.baseline_unigram},
                  {"bigram_loss", sum.baseline_bigram},
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
    if (baseline_) {
      std::snprintf(buf, sizeof buf, "  baseline     bigram %.4f, unigram %.4f (val loss %+.4f vs bigram)\n",
                    baseline_->bigram, baseline_->unigram, sum.final_val_loss - baseline_->bigram);
      os << buf;
    }
    if (o.keep_best && sum.best_val_loss >= 0) {
      std::snprintf(buf, sizeof buf, "  best val     %.4f in %s\n", sum.best_val_loss,
                    (fs::path(o.out) / kBestCheckpoint).string().c_str());
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
