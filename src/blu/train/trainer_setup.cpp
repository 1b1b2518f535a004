// train/trainer_setup: Trainer's constructor — the job built from its options before the first
// step, in order: every option checked, the process group and this rank's place on the mesh, the
// run directory and what a resume starts from, the data, the model with its layout, strategy and
// memory plan, and only then the run's files on disk. Running the job is trainer.cpp.
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
#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/runtime.h"
#endif

namespace blu::train {

namespace fs = std::filesystem;

std::string gemm_tune_summary() {
#ifdef BLU_HAVE_CUDA
  const cuda::GemmTuning t = cuda::gemm_tuning();
  if (!t.on) return "";
  const cuda::GemmTuneStats s = cuda::gemm_tune_stats();
  return "gemm tuning: " + std::to_string(s.timed) + " plans timed (" + std::to_string(s.changed) +
         " took another algorithm than the heuristic's first), " + std::to_string(s.from_table) + " taken from " +
         (t.file.empty() ? std::string("this process's choices") : t.file) +
         (s.skipped ? ", " + std::to_string(s.skipped) + " left untimed (no memory to copy D aside)" : "");
#else
  return "";
#endif
}

void apply_gemm_tune(const std::string& setting) {
  BLU_CHECK(setting.empty() || setting == "on" || setting == "off", "--gemm-tune: expected on or off, got '", setting,
            "'");
  if (setting.empty()) return;
#ifdef BLU_HAVE_CUDA
  cuda::GemmTuning t = cuda::gemm_tuning();
  t.on = setting == "on";
  cuda::set_gemm_tuning(t);
#endif
}


namespace {

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

}  // namespace

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
    if (!o.compile_exclude.empty()) compiler::set_excluded_ops(compiler::checked_op_list(o.compile_exclude, "--compile-exclude"));
  } else {
    BLU_CHECK(!o.compile_log && o.compile_exclude.empty() && !o.compile_remat && !o.compile_check,
              "--compile-log, --compile-exclude, --compile-remat and --compile-check need --compile");
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
  apply_gemm_tune(o.gemm_tune);
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
  sc.split_masters = o.master_weights == "split";
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
  const dist::OptimizerConfig oc{
      .name = o.optimizer, .lr = o.lr, .weight_decay = o.weight_decay, .beta1 = o.beta1, .beta2 = o.beta2,
      .state_dtype = adamw_state_dtype(o)};
  strategy_ = make_layout_strategy(*model_, layout, mesh_.get(), pg, sc, oc, o.precision, pipeline_gradients);
  if (strategy_->split_elements() > 0 && cb_.log)
    *cb_.log << "split master weights: " << strategy_->split_elements() << " of the model's " << model_params
             << " parameters held as their bf16 copy and 16 low bits (" << strategy_->split_elements() * 2 / (1 << 20)
             << " MiB less on the device)\n";
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
    co.check = o.compile_check;
    co.epilogues = o.compile_fuse == "on";  // off: every op's eager kernel, GEMMs as written
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

}  // namespace blu::train
