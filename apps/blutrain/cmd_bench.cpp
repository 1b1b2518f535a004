// `blutrain bench`: times training steps of any registered model (--model gpt2:d12,
// llama:llama-250m, ...) on random tokens the way ../shared/peers/torch_gpt2.py and torch_llama.py
// do (forward, backward, clip at 1.0, AdamW, zero grads; the step ends when its loss is on the
// host) and prints one JSON line: tok/s and ms of the median step after warm-up, MFU against a
// given peak, and the allocator's peak memory.
// Data parallel: `blutrain launch -n N -- blutrain bench --dp N ...` runs one rank per GPU
// (cuda:LOCAL_RANK), NCCL through rank 0's TCP store (MASTER_ADDR/MASTER_PORT), the model under
// DistributedDataParallel (--zero 1: ZeRO-1 AdamW; --bucket-mib, --first-bucket-mib,
// --comm-priority and --no-row-exchange to compare DDP settings), or with --zero 2 under ZeRO-2
// alone (gradients reduce-scattered during backward in --bucket-mib buckets; the tied embedding's
// rows exchanged apart unless --no-row-exchange), or with --zero 3 under ZeRO-3 (parameters
// sharded too, gathered block by block: dist/zero.h); every rank draws its own batches of B rows;
// rank 0 prints the line with the global tok/s (world·B·T per median step) and its own memory.
// --compile: every step after the first runs through compiler::CompiledStep (captured, planned,
// replayed; on CUDA a CUDA graph), on the same two batch tensors refilled each step; the line adds
// the graph's size, the plan's peak, the compile time and how the steps ran. The per-phase times,
// --profile and --comm-timeline observe eager steps and are not taken with it.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <functional>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>
#ifdef BLU_HAVE_CUDA
#include "blu/backend/cuda/gemm.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/core/cuda/runtime.h"
#include "blu/memory/cuda_allocator.h"
#endif

#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/dist/consistency.h"
#include "blu/dist/env.h"
#include "blu/dist/hetero.h"
#include "blu/dist/mesh.h"
#include "blu/dist/planner.h"
#include "blu/dist/strategy.h"
#include "blu/dist/zero.h"
#include "blu/io/json_file.h"
#include "blu/models/registry.h"
#include "blu/ops/dispatch.h"
#include "blu/optim/loss_scaler.h"
#include "blu/optim/optimizer.h"
#include "blu/memory/device_pool.h"
#include "blu/offload/plan.h"
#include "blu/offload/transfer.h"
#include "blu/train/layout_setup.h"
#include "blu/train/trainer.h"
#include "commands.h"
#include "host_heap.h"

namespace blu::cli {

namespace {

struct BenchOptions {
  std::string model = "d12", device = "cuda", precision = "bf16";
  int64_t batch = 16, seq = 1024, steps = 24;
  double peak_tflops = 0;  // the GPU's measured bf16 (or tf32/fp32) matmul peak, for MFU
  // Optimizer state offload (docs/offload.md) and micro-batches per optimizer step.
  int64_t grad_accum = 1;
  std::string offload_state = "none", offload_update = "cpu";
  std::string master_weights = "fp32";  // or split (optim/master_split.h)
  std::string adamw_state = "f32";      // or bf16 (Note [Stochastic bf16 moments])
  int64_t offload_chunk = int64_t(1) << 22;
  bool offload_overlap = false;
  double gpu_memory_budget = 0;
  double lr = 6e-4, beta2 = 0.999;  // AdamW's (torch_gpt2.py's); torch_llama.py takes 3e-4 and 0.95
  bool profile = false;    // time each op of one extra step (device time by op name)
  int dp = 1, zero = 0;    // data-parallel ranks (launched processes), ZeRO stage (0 to 3)
  dist::DDPOptions ddp;    // bucket sizes, to compare settings on the same machine
  std::string comm_priority = "high";  // the NCCL stream's priority: high | default
  bool row_exchange = true;  // DDP exchanges the tied embedding's rows apart (dist/ddp.h)
  bool comm_timeline = false;  // one extra DDP step: when each bucket's all-reduce completes
  bool skip_comm = false;      // DDP without its collectives (ranks diverge): the compute of a DDP step
  bool compile = false, compile_log = false;  // compiled steps (compiler/compile.h), the compiler's log
  bool compile_check = false;                 // each fused region against its eager ops (CompileOptions::check)
  std::string compile_exclude;                // ops kept out of compilation ("" = BLU_COMPILE_EXCLUDE)
  // Activations (models/activations.h): --recompute none|selective|mlp|block[:N] (joined by +), --offload-activations.
  std::string recompute = "none";
  int64_t loss_chunks = 0;  // the head's loss in row pieces (ops/fused.h, Note [Chunked loss])
  bool offload_activations = false;
  std::string compile_fuse = "on";            // fused regions (compiler/fusion_plan.h): on | off
  std::string gemm_tune;                      // on | off: train::apply_gemm_tune ("" = BLU_GEMM_TUNE)
  bool compile_remat = false;                 // the compiler's save-or-recompute pass (compiler/remat.h)
  std::string compile_export;                 // where a step without a cached plan is exported
  // A parallel layout (dist/annotations.h) or "auto" (the planner's pick): run_bench_layout.
  std::string parallel;
  double dist_timeout = 0;  // seconds; 0: NCCL's 600, Gloo's 30 (or BLU_DIST_TIMEOUT)
};

void device_sync(Device dev) {
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda()) BLU_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

// Where one step's time goes, by op name.
// CPU: wall time since the previous op ended is charged to each op.
// CUDA: an event is recorded on the current stream after every op, with no synchronisation. The
// device is first handed ~0.2 s of queued matrix products, so the host enqueues the whole step
// before the device reaches it and the gap between consecutive events is the device time of
// that op's kernels (not launch overhead). The step's own wall time is reported beside the sum.
nlohmann::json profile_step(const std::function<void()>& step, Device dev) {
  std::vector<std::pair<std::string, double>> marks;  // op name, host ms (CPU)
  std::map<std::string, std::pair<double, int64_t>> by_op;
  double busy_ms = 0;
#ifdef BLU_HAVE_CUDA
  std::vector<cuda::Event> events;
  if (dev.is_cuda()) {
    device_sync(dev);
    const Tensor a = randn({8192, 8192}, DType::bf16, dev);
    for (int i = 0; i < 150; ++i) (void)matmul(a, a);  // ~1.4 ms each on an H100/H200
    events.emplace_back(true);
    events.back().record(cuda::current_stream());
  }
#endif
  device_sync(dev);
  auto last = std::chrono::steady_clock::now();
  const int h = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
    double ms = 0;
#ifdef BLU_HAVE_CUDA
    if (dev.is_cuda()) {
      events.emplace_back(true);
      events.back().record(cuda::current_stream());
    }
#endif
    if (!dev.is_cuda()) {
      const auto now = std::chrono::steady_clock::now();
      ms = std::chrono::duration<double, std::milli>(now - last).count();
      last = now;
    }
    marks.emplace_back(op.name, ms);
  });
  step();
  remove_op_observer(h);
  device_sync(dev);
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda())
    for (size_t i = 0; i < marks.size(); ++i) marks[i].second = events[i + 1].elapsed_ms(events[i]);
#endif
  for (auto& [name, ms] : marks) {
    auto& e = by_op[name];
    e.first += ms;
    e.second += 1;
    busy_ms += ms;
  }
  std::vector<std::pair<double, std::string>> rows;
  for (auto& [name, e] : by_op) rows.emplace_back(e.first, name);
  std::sort(rows.rbegin(), rows.rend());
  nlohmann::json ops = nlohmann::json::array();
  for (auto& [ms, name] : rows)
    ops.push_back({{"op", name}, {"ms", std::round(ms * 1000) / 1000}, {"calls", by_op[name].second},
                   {"share", std::round(ms / busy_ms * 1000) / 1000}});
  return {{"sum_ms", std::round(busy_ms * 1000) / 1000}, {"ops", ops}};
}

// The bench's device exists here: --device cuda on a machine or a build without one says what to
// run instead.
Device bench_device(const std::string& flag) {
  const Device dev(flag);
#ifdef BLU_HAVE_CUDA
  BLU_CHECK(!dev.is_cuda() || cuda::device_count() > 0, "bench --device ", flag,
            ": this machine has no CUDA device; time the CPU with --device cpu");
#else
  BLU_CHECK(dev.is_cpu(), "bench --device ", flag, ": this build has no CUDA backend; use --device cpu");
#endif
  return dev;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `bench --parallel TEXT|auto` under `blutrain launch -n N`: the layout built as the trainer builds
// it (train/layout_setup.h) on random tokens. Before the layout is built every rank probes the
// model on its device as `train --parallel auto` does (train::probe_layout_costs: measure_model at
// micro-batches of max(1, B/2) and B rows on every rank in lockstep, measure_split for each
// admitted tensor-parallel degree, the slowest rank's times, the link over a group of the whole
// job): the costs predict the layout's step time and memory per rank, printed beside what the
// steps then measure, with the error. "auto" takes the planner's fastest layout that fits --gpu-memory-budget for the
// global batch B · N (the tokens of `--dp N`), agreed through the store; replicate(n,
// weights=probe) splits the rows by each replica's measured speed (dist/hetero.h).
// -B is the rows of one micro-batch of one replica (a pipeline runs micro of them per step), so a
// step trains on B · replicas · micro · T tokens; every TP rank and stage of a replica reads the
// same rows, drawn from the replica's own generator (replica 0 draws what a single process draws).
int run_bench_layout(const BenchOptions& o) {
  const dist::DistEnv env = dist::detect_env();
  const int rank = env.rank, world = env.world_size;
  BLU_CHECK(o.dp == 1 && o.zero == 0, "--parallel '", o.parallel, "' states the layout: drop --dp ", o.dp,
            " and --zero ", o.zero, " (replicate(n, zero=k) says both)");
  BLU_CHECK(!o.compile && !o.profile && !o.comm_timeline && o.offload_state == "none" && o.recompute == "none" &&
                !o.offload_activations && o.grad_accum == 1 && o.loss_chunks == 0 && o.master_weights == "fp32",
            "--parallel: --compile, --profile, --comm-timeline, --offload-state, --recompute, --offload-activations, ",
            "--loss-chunks, --master-weights and --grad-accum run without a layout (a pipeline's micro=M is its ",
            "accumulation)");
  BLU_CHECK(o.precision != "fp16", "--parallel: --precision fp16 is not supported (the loss scaler's skip is per rank)");
  BLU_CHECK(world == 1 || o.device == "cuda" || o.device == "cpu", "--parallel over ", world,
            " ranks runs on --device cuda (NCCL, one GPU per rank) or cpu (Gloo), got ", o.device);
  Device dev = bench_device(o.device);
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda() && world > 1) dev = Device(DeviceType::cuda, env.local_rank);
  if (dev.is_cuda()) cuda::set_device(dev.index);
#endif
  const double timeout_s = o.dist_timeout > 0 ? o.dist_timeout : env.dist_timeout_s;
  nlohmann::json cfg = models::resolve_model_config(o.model);
  if (cfg.contains("block_size") && cfg["block_size"].get<int64_t>() < o.seq) cfg["block_size"] = o.seq;
  const std::unique_ptr<models::CausalLM> model_ptr = models::build_model(cfg, 0);
  models::CausalLM& model = *model_ptr;
  BLU_CHECK(o.seq <= model.max_seq_len(), "--seq-len ", o.seq, " is longer than the model's ", model.max_seq_len());
  std::vector<std::string> names;
  for (const models::BlockRef& b : model.blocks()) names.push_back(b.name);
  const int64_t vocab = model.vocab_size();
  // The units every tensor-parallel degree must divide (heads, kv heads, MLP width, vocabulary rows).
  int64_t tp_units = 0;
  for (const models::ShardSpec& spec : model.tensor_parallel_plan())
    if (spec.units > 0) tp_units = std::gcd(tp_units, spec.units);
  if (tp_units == 0) tp_units = 1;  // no tensor-parallel plan: one rank per shard only
  const double flops_tok = model.flops_per_token(o.seq);
  int64_t n_params = 0;
  for (const Tensor& p : model.parameters()) n_params += p.numel();
  model.to(dev);
  model.train();
  train::apply_precision(model, o.precision);
  train::apply_gemm_tune(o.gemm_tune);

  // The probes: this rank's model costs, the link over the whole job.
  std::unique_ptr<dist::TcpStore> store;
  std::shared_ptr<dist::ProcessGroup> probe_pg;
  if (world > 1) {
    store = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, rank == 0,
                                             dist::Milliseconds(int64_t((timeout_s > 0 ? timeout_s : 60) * 1000)));
#ifdef BLU_HAVE_CUDA
    if (dev.is_cuda())
      probe_pg = dist::make_nccl_group(*store, rank, world, dist::NcclOptions{.device = dev.index, .prefix = "probe"});
    else
#endif
      probe_pg = dist::make_gloo_group(*store, rank, world, dist::GlooOptions{.prefix = "probe"});
  }
  const train::LayoutCosts probed =
      train::probe_layout_costs(model, cfg, o.precision, std::max<int64_t>(1, o.batch / 2), o.seq, dev, probe_pg.get(),
                                world, o.parallel.find("sp=true") != std::string::npos);
  const dist::ModelCosts& costs = probed.model;
  const dist::LinkCosts& link = probed.link;

  // auto and weights=probe decided on the probes (train/layout_setup.h), as the trainer decides them.
  const train::LayoutDecision decision =
      train::decide_layout(o.parallel, model, costs, link, probe_pg.get(), store.get(), rank, world, o.batch, o.seq,
                           o.gpu_memory_budget * double(int64_t(1) << 30));
  const std::string& text = decision.text;
  const nlohmann::json plan_json = o.parallel == "auto" ? decision.plan : nlohmann::json();
  const std::vector<double>& probe_ms = decision.probe_ms;
  dist::Layout layout = dist::resolve_layout(dist::parse_annotation(text), names, world);
  train::check_layout_supported(layout, text, o.seq);
  const int64_t micro = train::is_pipelined(layout) ? layout.micro_batches : 1;
  const int64_t rows_micro = decision.rows;
  const bool uneven = std::any_of(layout.replica_weights.begin(), layout.replica_weights.end(),
                                  [&](double w) { return std::abs(w - 1.0 / layout.dp) > 1e-12; });
  const std::vector<int64_t> rows = uneven ? dist::proportional_split(rows_micro * layout.dp, layout.replica_weights)
                                           : std::vector<int64_t>(size_t(layout.dp), rows_micro);
  const dist::DeviceMesh grid(rank, world, {{"dp", layout.dp}, {"pp", layout.pp}, {"tp", layout.tp}});
  const int replica = grid.coordinate("dp");
  const int64_t my_rows = rows[size_t(replica)];

  dist::PlanJob job;
  job.world = world;
  job.batch = rows_micro * layout.dp * micro;
  job.rank_speeds = decision.rank_speeds;  // as auto predicted it (each replica at its pace)
  const dist::Prediction pred = dist::predict(layout, costs, link, job);

  train::LayoutGroups groups;
  if (world > 1) groups = train::make_layout_groups(*store, rank, world, layout, dev, timeout_s);
  dist::StrategyConfig sc;
  sc.zero = layout.zero;
  if (uneven) {
    sc.batch_share = double(my_rows) / double(rows_micro * layout.dp);
    sc.row_exchange = false;  // replicas of unequal rows reduce the tied embedding's gradient densely
  }
  const std::unique_ptr<dist::Strategy> strategy = train::make_layout_strategy(
      model, layout, groups.mesh.get(), groups.job, sc,
      dist::OptimizerConfig{.lr = o.lr, .weight_decay = 0.1, .beta2 = o.beta2,
                            .state_dtype = dtype_from_name(o.adamw_state)},
      o.precision,
      groups.pipeline_gradients);

  Generator gen(1 + uint64_t(replica));  // each replica its own batches; its TP ranks and stages the same
  allocator_for(dev).reset_peak();
  std::vector<double> ms;
  double first_loss = 0, last_loss = 0;
  for (int64_t i = 0; i < o.steps; ++i) {
    const Tensor x = randint(0, vocab, {my_rows, o.seq}, DType::i64, dev, &gen);
    const Tensor y = randint(0, vocab, {my_rows, o.seq}, DType::i64, dev, &gen);
    (void)to_vector(sum(x));  // the batch is ready before the clock starts
    if (groups.job) groups.job->barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    const dist::StepValues v = strategy->step(micro, [&](int64_t) { return std::make_pair(x, y); }, o.lr, 1.0);
    const double loss = strategy->read(v, false).loss;  // the mean over ranks, on the host: the step is done
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (i == 0) first_loss = loss;
    last_loss = loss;
  }
  std::vector<double> warm(ms.begin() + std::min<int64_t>(std::max<int64_t>(3, o.steps / 4), int64_t(ms.size()) - 1),
                           ms.end());
  // The slowest rank's median step and the largest peak over the ranks.
  std::vector<double> measured = {median_of(warm), double(allocator_for(dev).stats().peak_bytes),
                                  double(allocator_for(dev).stats().peak_reserved_bytes)};
  if (groups.job) {
    Tensor t = from_vector(measured, {3}, DType::f64);
    if (!dev.is_cpu()) t = to_device(t, dev);
    groups.job->all_reduce(t, dist::ReduceOp::max)->wait();
    measured = to_vector(t);
  }
  const double med = measured[0];
  int64_t rows_total = 0;
  for (int64_t r : rows) rows_total += r;
  const double tok_s = double(rows_total * micro * o.seq) / (med / 1e3);
  nlohmann::json j = {{"impl", "blutrain-" BLU_VERSION}, {"host_heap", host_heap()},
                      {"model", o.model},
                      {"mode", o.precision},
                      {"parallel", text},
                      {"layout", layout.describe()},
                      {"world", world},
                      {"B", o.batch},
                      {"T", o.seq},
                      {"micro", micro},
                      {"rows_per_replica", rows},
                      {"steps", o.steps},
                      {"step_ms", med},
                      {"tok_s", std::round(tok_s)},
                      {"peak_alloc_mib", int64_t(measured[1]) >> 20},
                      {"peak_reserved_mib", int64_t(measured[2]) >> 20},
                      {"first_loss", first_loss},
                      {"last_loss", last_loss},
                      {"params", n_params},
                      {"predicted",
                       {{"step_ms", pred.step_s * 1e3},
                        {"memory_mib", pred.memory_bytes / double(1 << 20)},
                        {"compute_ms", pred.compute_s * 1e3},
                        {"tp_comm_ms", pred.tp_comm_s * 1e3},
                        {"pp_comm_ms", pred.pp_comm_s * 1e3},
                        {"bubble_ms", pred.bubble_s * 1e3},
                        {"dp_comm_ms", pred.dp_comm_s * 1e3},
                        {"update_ms", pred.update_s * 1e3}}},
                      {"error",
                       {{"step", (pred.step_s * 1e3 - med) / med}, {"memory", (pred.memory_bytes - measured[1]) / measured[1]}}},
                      {"link", {{"latency_us", link.latency_s * 1e6}, {"gb_s", link.bytes_per_s / 1e9}}}};
  if (world > 1) j["backend"] = groups.job->backend();
  if (!plan_json.is_null()) j["plan"] = plan_json;
  if (!probe_ms.empty()) {
    j["probe_ms"] = probe_ms;
    j["probe_weights"] = layout.replica_weights;
  }
  if (o.peak_tflops > 0) j["mfu"] = tok_s * flops_tok / (o.peak_tflops * 1e12 * world);  // per GPU
  if (rank == 0) std::cout << j.dump() << std::endl;
  if (groups.job) groups.job->barrier()->wait();
  return 0;
}

int run_bench(const BenchOptions& o) {
  if (!o.parallel.empty()) return run_bench_layout(o);
  const dist::DistEnv env = dist::detect_env();
  BLU_CHECK(env.world_size == o.dp, "--dp ", o.dp, " must equal the number of launched processes (WORLD_SIZE=",
            env.world_size, "); start with `blutrain launch -n ", o.dp, " -- blutrain bench --dp ", o.dp, " ...`");
  BLU_CHECK(o.zero >= 0 && o.zero <= 3, "--zero must be 0, 1, 2 or 3 in bench, got ", o.zero);
  BLU_CHECK(o.zero == 0 || o.dp > 1, "--zero ", o.zero, " needs --dp > 1");
  BLU_CHECK(!o.compile || (!o.profile && !o.comm_timeline),
            "--compile: --profile and --comm-timeline time eager steps; run them without --compile");
  BLU_CHECK(!o.compile || !o.offload_activations, "--compile: --offload-activations is not supported by the compiler ",
            "yet (its copies to the host run outside dispatch); drop one of the two");
  BLU_CHECK(!o.compile || o.zero != 3, "--compile: ZeRO-3 (--zero 3) is not supported by the compiler yet (its block ",
            "hooks swap the parameters' storages outside dispatch); use --zero 0, 1 or 2");
  BLU_CHECK(!o.compile || o.offload_state == "none", "--compile: optimizer state offload (--offload-state ",
            o.offload_state, ") is not supported by the compiler yet (its host side runs outside dispatch); drop one of the two");
  BLU_CHECK(o.compile || (!o.compile_log && o.compile_exclude.empty() && !o.compile_remat && !o.compile_check),
            "--compile-log, --compile-exclude, --compile-remat and --compile-check need --compile");
  Device dev = bench_device(o.device);
  BLU_CHECK(o.dp == 1 || o.device == "cuda" || o.device == "cpu", "--dp ", o.dp,
            " runs on --device cuda (NCCL, one GPU per rank) or cpu (Gloo), got ", o.device);
  std::unique_ptr<dist::TcpStore> store;
  std::shared_ptr<dist::ProcessGroup> pg;
  if (o.dp > 1) {
    store = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, env.rank == 0);
    if (dev.is_cpu()) {
      pg = dist::make_gloo_group(*store, env.rank, env.world_size);
    } else {
#ifdef BLU_HAVE_CUDA
      dev = Device(DeviceType::cuda, env.local_rank);
      cuda::set_device(dev.index);
      dist::NcclOptions no;
      no.device = dev.index;
      no.high_priority_stream = o.comm_priority == "high";
      pg = dist::make_nccl_group(*store, env.rank, env.world_size, no);
#else
      BLU_CHECK(false, "--dp on --device cuda needs a CUDA build (NCCL)");
#endif
    }
  }
  if (o.compile) pg = compiler::capturable(std::move(pg));  // collectives recorded into the captured step
  nlohmann::json cfg = models::resolve_model_config(o.model);
  if (cfg.contains("block_size") && cfg["block_size"].get<int64_t>() < o.seq) cfg["block_size"] = o.seq;
  const std::unique_ptr<models::CausalLM> model_ptr = models::build_model(cfg, 0);
  models::CausalLM& model = *model_ptr;
  BLU_CHECK(o.seq <= model.max_seq_len(), "--seq ", o.seq, " is longer than the model's ", model.max_seq_len());
  const int64_t vocab = model.vocab_size();
  model.to(dev);
  model.train();
  train::apply_precision(model, o.precision);
  train::apply_gemm_tune(o.gemm_tune);
  // The memory planner that resolves `auto` probes and plans beside the optimizer state and its
  // offload (train/memory_probe.cpp); bench times one given setting.
  BLU_CHECK(o.recompute != "auto", "bench --recompute auto: bench times one setting; `blutrain train --recompute auto ",
            "--gpu-memory-budget GIB` logs the planner's choice (\"recompute auto: ...\"), which bench takes as ",
            "--recompute and --loss-chunks");
  const models::ActivationPolicy activations = models::ActivationPolicy::parse(o.recompute, o.offload_activations);
  model.set_activation_policy(activations);
  model.set_loss_chunks(o.loss_chunks);
  const bool fp16 = o.precision == "fp16";
  BLU_CHECK(!fp16 || o.dp == 1, "--precision fp16 with --dp is not supported (the loss scaler's skip is per rank)");
  dist::StrategyConfig sc;
  sc.zero = o.zero;
  sc.row_exchange = o.row_exchange;
  sc.ddp = o.ddp;
  sc.zero_bucket_mib = o.ddp.bucket_mib;
  sc.fp16_loss_scaling = fp16;
  sc.skip_comm = o.skip_comm;
  sc.offload_state = o.offload_state != "none";
  sc.offload.masters_on_host = o.offload_state.starts_with("master");
  sc.offload.grads_on_host = o.offload_state == "master+grads";
  sc.offload.update = offload::parse_update(o.offload_update);
  sc.offload.chunk_elements = o.offload_chunk;
  sc.offload.overlap_forward = o.offload_overlap;
  BLU_CHECK(o.master_weights == "fp32" || o.precision == "bf16", "--master-weights split needs --precision bf16, got ",
            o.precision);
  sc.split_masters = o.master_weights == "split";
  if (dev.is_cpu() && dev.index >= 1) device_pool(dev.index).set_budget(offload::gib_to_bytes(o.gpu_memory_budget));
  BLU_CHECK(o.adamw_state == "f32" || o.offload_state == "none", "--adamw-state bf16 holds AdamW's moments on the ",
            "device: it needs --offload-state none, got ", o.offload_state);
  dist::Strategy strategy(
      model, pg, sc,
      dist::OptimizerConfig{
          .lr = o.lr, .weight_decay = 0.1, .beta2 = o.beta2, .state_dtype = dtype_from_name(o.adamw_state)});
  dist::DistributedDataParallel* ddp = strategy.ddp();
  Generator gen(1 + uint64_t(env.rank));  // each rank its own batches
  allocator_for(dev).reset_peak();
  std::vector<double> ms;
  double first_loss = 0, last_loss = 0;
  Tensor loss_t;
  // CUDA: device-time phases of each step from events on the compute stream — forward+backward,
  // the wait for the gradient all-reduces after backward (DDP's exposed communication), and the
  // optimizer — to tell a communication tail from kernels slowed down by the overlap.
  std::vector<std::array<double, 3>> phases;
  // The host's time to issue forward+backward (nothing synchronises in there: when it is as long
  // as the device's fwd_bwd, the host is what limits the step) and the whole step (clip_grad_norm
  // reads the norm, so this one includes waiting for the device).
  std::vector<double> host_ms, host_bwd_ms;
  std::chrono::steady_clock::time_point step_t0;
#ifdef BLU_HAVE_CUDA
  std::vector<cuda::Event> marks;
  if (dev.is_cuda())
    for (int i = 0; i < 4; ++i) marks.emplace_back(true);
#endif
  auto mark = [&](int i) {
#ifdef BLU_HAVE_CUDA
    if (dev.is_cuda()) marks[size_t(i)].record(cuda::current_stream());
#endif
    (void)i;
  };
  std::unique_ptr<compiler::CompiledStep> compiled;
  Tensor cx, cy;  // --compile: the step's inputs, refilled every step (fixed addresses)
  if (o.compile) {
    if (!o.compile_exclude.empty()) compiler::set_excluded_ops(compiler::checked_op_list(o.compile_exclude, "--compile-exclude"));
    compiler::CompileOptions co;
    co.log = o.compile_log && env.rank == 0;
    co.config = o.precision + ", " + strategy.describe();
    co.remat = o.compile_remat;
    co.check = o.compile_check;
    co.epilogues = o.compile_fuse == "on";  // off: every op's eager kernel, GEMMs as written
    co.fusion = compiler::fusion_for(o.compile_fuse, [log = co.log](const std::string& line) {
      if (log) std::cerr << "compile: " << line << "\n" << std::flush;
    }, env.rank == 0 ? o.compile_export : "");
    compiled = std::make_unique<compiler::CompiledStep>(co);
    compiled->set_named(compiler::BufferKind::parameter, model.named_parameters());
    cx = empty({o.batch, o.seq}, DType::i64, dev);
    cy = empty({o.batch, o.seq}, DType::i64, dev);
  }
  auto compiled_step = [&](const Tensor& x, const Tensor& y) {
    {
      NoGradGuard no_grad;
      copy_(cx, x);
      copy_(cy, y);
    }
    // Note [The warm-up step recomputes every block] (models/activations.h).
    const models::WarmupPolicy warmup(model, compiled->warming_up() && o.compile_remat);
    compiled->run({cx, cy}, [&] {
      loss_t = strategy.step(1, [&](int64_t) { return model.forward(cx, cy).loss; }, o.lr, 1.0).loss_sum;
      strategy.optimizer().zero_grad();  // as train --compile does: the gradients are the step's temporaries
    });
  };
  auto step = [&](const Tensor& x, const Tensor& y) {
    if (compiled) return compiled_step(x, y);
    step_t0 = std::chrono::steady_clock::now();
    mark(0);
    const auto loss_of = [&](int64_t) {
      // Only the loss is kept: cross-entropy's backward writes over the logits (Note [Donated buffers]).
      return model.forward(x, y).loss;
    };
    const dist::StepValues v = strategy.step(o.grad_accum, loss_of, o.lr, 1.0, [&](int phase) {
      mark(phase);
      if (phase == 1)
        host_bwd_ms.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_t0).count());
    });
    loss_t = v.loss_sum;
  };
  for (int64_t i = 0; i < o.steps; ++i) {
    Tensor x = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    Tensor y = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    (void)to_vector(sum(x));  // the previous step and the batch are done before the clock starts
    const auto t0 = std::chrono::steady_clock::now();
    step(x, y);
    host_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    const double loss = to_vector(to_dtype(loss_t, DType::f32))[0];  // synchronises
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
#ifdef BLU_HAVE_CUDA
    if (dev.is_cuda() && !compiled)  // a compiled step runs as one graph: no phase marks
      phases.push_back({marks[1].elapsed_ms(marks[0]), marks[2].elapsed_ms(marks[1]), marks[3].elapsed_ms(marks[2])});
#endif
    if (i == 0) first_loss = loss;
    last_loss = loss;
  }
  {  // the last step's offloaded update may still run behind (Note [Update behind the forward]): its time is the step's
    const auto t0 = std::chrono::steady_clock::now();
    strategy.finish_update();
    device_sync(dev);
    if (!ms.empty()) ms.back() += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  // --comm-timeline: when each bucket's all-reduce completes, in ms after backward's start on the
  // device (host polling, ~0.01 ms resolution), beside backward's end: buckets done before the end
  // were hidden by backward.
  nlohmann::json timeline;
#ifdef BLU_HAVE_CUDA
  if (o.comm_timeline && ddp && dev.is_cuda()) {
    Tensor x = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    Tensor y = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    (void)to_vector(sum(x));
    cuda::Event fwd_end, bwd_end;
    models::LMOutput out = model.forward(x, y);
    fwd_end.record(cuda::current_stream());
    out.loss.backward();
    bwd_end.record(cuda::current_stream());
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    auto now_ms = [&] { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
    double t_fwd = -1, t_bwd = -1;
    std::vector<double> done(ddp->bucket_layout().size(), -1.0);
    while (now_ms() < 5000) {
      if (t_fwd < 0 && fwd_end.query()) t_fwd = now_ms();
      if (t_bwd < 0 && bwd_end.query()) t_bwd = now_ms();
      const std::vector<int> st = ddp->bucket_states();
      bool all = t_bwd >= 0;
      for (size_t b = 0; b < st.size(); ++b) {
        if (done[b] < 0 && st[b] == 2) done[b] = now_ms();
        all &= st[b] != 1;
      }
      if (all) break;
    }
    ddp->finish();
    strategy.optimizer().zero_grad();
    device_sync(dev);
    timeline["backward_ms"] = t_bwd - t_fwd;
    for (size_t b = 0; b < done.size(); ++b)
      timeline["buckets"].push_back({{"mib", double(ddp->bucket_buffer(b).nbytes()) / (1 << 20)},
                                     {"done_ms", done[b] < 0 ? -1.0 : done[b] - t_fwd}});
  }
#endif
  std::vector<double> warm(ms.begin() + std::min<int64_t>(std::max<int64_t>(3, o.steps / 4), int64_t(ms.size()) - 1),
                           ms.end());
  std::sort(warm.begin(), warm.end());
  const double med = warm[warm.size() / 2];
  const double tok_s = double(o.dp) * double(o.batch * o.seq * o.grad_accum) / (med / 1e3);  // global
  // Training FLOPs per token: 6 per parameter (embeddings included, as the tied head is a matmul)
  // plus attention's 12·L·C·T (PaLM's estimate; causal masking is not subtracted).
  const double flops_tok = model.flops_per_token(o.seq);
  const AllocatorStats st = allocator_for(dev).stats();
  nlohmann::json j = {{"impl", "blutrain-" BLU_VERSION}, {"host_heap", host_heap()}, {"model", o.model}, {"mode", o.precision},  {"B", o.batch},
                      {"T", o.seq},                       {"steps", o.steps},     {"step_ms", med},
                      {"tok_s", std::round(tok_s)},       {"peak_alloc_mib", st.peak_bytes >> 20},
                      {"peak_reserved_mib", st.peak_reserved_bytes >> 20},
                      {"first_loss", first_loss},         {"last_loss", last_loss}};
  if (o.loss_chunks > 1) j["loss_chunks"] = o.loss_chunks;
  if (activations.any()) {  // the policy and what it keeps per block (models/activations.h)
    j["recompute"] = activations.recompute_name();
    j["offload_activations"] = activations.offload;
    if (const auto* off = model.activation_offloader())
      j["activation_offload_mib_per_step"] = double(off->bytes_offloaded()) / double(1 << 20) / double(o.steps);
  }
  {  // activation bytes of all blocks at this B, T: kept on the device / offloaded / recomputed
    double kept = 0, off = 0, rec = 0;
    for (const models::ActivationBytes& a : models::activation_bytes(model, o.batch, o.seq, activations))
      kept += double(a.kept), off += double(a.offloaded), rec += double(a.recomputed);
    j["activation_mib"] = {{"kept", kept / (1 << 20)}, {"offloaded", off / (1 << 20)}, {"recomputed", rec / (1 << 20)}};
  }
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda()) {  // what the caching allocator holds at the end beyond the live tensors
    const CachingAllocatorStats cs = cuda::memory_stats(dev.index);
    j["allocator"] = {{"reserved_mib", cs.reserved_bytes >> 20},
                      {"cached_free_mib", cs.free_bytes >> 20},
                      {"largest_free_mib", cs.largest_free_block >> 20},
                      {"segments", cs.segments}};
    // Every segment and block, for a look at what the cache holds (docs/cuda.md).
    if (const char* path = std::getenv("BLU_MEMORY_SNAPSHOT"); path && *path) io::write_file_atomic(path, cuda::memory_snapshot());
  }
#endif
  {  // offload: what the device holds per parameter after a step (parameters, gradients, copies, state)
    int64_t n = 0;
    for (const Tensor& p : model.parameters()) n += p.numel();
    j["params"] = n;
    j["grad_accum"] = o.grad_accum;
    j["device_bytes_per_param"] = std::round(double(st.current_bytes) / double(n) * 100) / 100;
    if (sc.split_masters) j["split_master_params"] = strategy.split_elements();
    if (o.adamw_state != "f32") j["adamw_state"] = o.adamw_state;
    if (sc.offload_state) {
      j["offload"] = o.offload_update;
      j["offload_state"] = o.offload_state;
      j["offload_chunk"] = o.offload_chunk;
      if (o.offload_update == "cpu") j["offload_overlap"] = o.offload_overlap;
      if (dev.is_cuda()) {  // pinned host memory: the offloaded state and the transfer rings
        const AllocatorStats h = offload::host_allocator_for(dev).stats();
        j["host_bytes_per_param"] = std::round(double(h.current_bytes) / double(n) * 100) / 100;
        j["host_reserved_gib"] = std::round(double(h.reserved_bytes) / double(1 << 30) * 100) / 100;
      }
    }
  }
  if (o.dp > 1) {
    j["world"] = o.dp;
    if (o.skip_comm) j["skip_comm"] = true;
    j["backend"] = pg->backend();
    if (o.zero) j["zero"] = o.zero;
    j["bucket_mib"] = o.ddp.bucket_mib;
    if (ddp) j["reduce_dtype"] = ddp->reduce_dtype() ? std::string(dtype_name(*ddp->reduce_dtype())) : "bucket";
    j["first_bucket_mib"] = o.ddp.first_bucket_mib;
    j["comm_priority"] = o.comm_priority;
    if (o.zero == 3) {  // units gathered at once (a block each, and the rest); no row exchange
      j["units"] = strategy.zero()->num_units();
      j["row_exchange"] = "off";
    } else {
      j["buckets"] = ddp ? ddp->bucket_layout().size() : strategy.zero()->bucket_layout().size();
      j["row_exchange"] = !o.row_exchange ? "off" : ddp ? ddp->row_exchange_paths().at(0) : strategy.zero()->row_exchange_paths().at(0);
    }
    if (!timeline.is_null()) j["comm_timeline"] = timeline;
  }
  if (!phases.empty()) {  // medians over the warm steps
    const size_t skip = ms.size() - warm.size();
    auto median = [&](int k) {
      std::vector<double> v;
      for (size_t i = skip; i < phases.size(); ++i) v.push_back(phases[i][size_t(k)]);
      std::sort(v.begin(), v.end());
      return std::round(v[v.size() / 2] * 1000) / 1000;
    };
    auto host_median = [&](std::vector<double> v) {
      v.erase(v.begin(), v.begin() + std::ptrdiff_t(skip));
      std::sort(v.begin(), v.end());
      return std::round(v[v.size() / 2] * 1000) / 1000;
    };
    j["phases_ms"] = {{"fwd_bwd", median(0)}, {"comm_wait", median(1)}, {"optimizer", median(2)},
                      {"host_fwd_bwd", host_median(host_bwd_ms)}, {"host_step", host_median(host_ms)}};
  }
  if (o.peak_tflops > 0) j["mfu"] = tok_s * flops_tok / (o.peak_tflops * 1e12 * o.dp);  // per GPU
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda() && cuda::gemm_tuning().on) {
    const cuda::GemmTuneStats t = cuda::gemm_tune_stats();
    j["gemm_tune"] = {{"timed", t.timed}, {"changed", t.changed}, {"from_table", t.from_table}, {"skipped", t.skipped}};
  }
#endif
  if (fp16) j["skipped_steps"] = strategy.loss_scaler()->skipped_steps();
  if (compiled) {
    const auto& c = compiled->counts();
    nlohmann::json cj = {{"compiled", c.compiled}, {"eager", c.eager}, {"fallback", c.fallback}, {"streamed", c.streamed},
                         {"guard_failures", c.guard_failures}, {"variants", compiled->variants().size()}};
    if (c.compiled > 0) {  // host time per compiled step
      cj["capture_ms_per_step"] = c.capture_ms / double(c.compiled);
      cj["replay_ms_per_step"] = c.replay_ms / double(c.compiled);
    }
    if (!compiled->variants().empty()) {
      const compiler::Variant& v = *compiled->variants()[0];
      const compiler::MemoryPlan& plan = v.runtime->plan();
      cj["graph_ops"] = v.graph.ops.size();
      cj["plan_peak_mib"] = double(plan.peak_bytes()) / (1 << 20);
      cj["plan_arena_mib"] = double(plan.arena_bytes()) / (1 << 20);
      if (o.compile_remat) {
        cj["remat_buffers"] = v.remat_buffers;
        cj["remat_mib"] = double(v.remat_bytes) / (1 << 20);
      }
      cj["fused_regions"] = v.regions - v.epilogues;
      cj["gemm_epilogues"] = v.epilogues;
      cj["compile_ms"] = v.capture_ms + v.plan_ms;
      cj["graph_captures"] = v.runtime->stats().graph_captures;
      cj["graph_launches"] = v.runtime->stats().graph_launches;
      cj["graph_memsets_lowered"] = v.runtime->stats().memsets_lowered;
      cj["direct_launches"] = v.runtime->stats().direct_launches;
      cj["graph_segments"] = v.runtime->stats().segments;
      cj["steps_recorded"] = v.runtime->stats().steps_recorded;
      cj["speculated_steps"] = v.runtime->stats().speculated_steps;  // Note [Speculative start]
      cj["speculated_segments"] = v.runtime->stats().speculated_segments;
      cj["speculation_misses"] = v.runtime->stats().speculation_misses;
    }
    j["compile"] = cj;
  }
  if (o.profile) {
    Tensor x = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    Tensor y = randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen);
    j["profile"] = profile_step([&] { step(x, y); }, dev);
  }
  if (env.rank == 0) std::cout << j.dump() << std::endl;
  if (pg) pg->barrier()->wait();
  return 0;
}

}  // namespace

Command add_bench(CLI::App& root) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* app = root.add_subcommand("bench", "Time training steps of a model on random tokens (one JSON line)");
  app->add_option("--model", o->model, "Model: FAMILY:PRESET (gpt2:d12 = GPT-2 124M, llama:llama-250m, ...) or a bare GPT-2 preset")->capture_default_str();
  app->add_option("-B,--batch-size", o->batch, "Batch size")->capture_default_str();
  app->add_option("-T,--seq-len", o->seq, "Sequence length")->capture_default_str();
  app->add_option("--steps", o->steps, "Steps (the first quarter, at least 3, are warm-up)")->capture_default_str();
  app->add_option("--device", o->device, "cpu or cuda[:N]")->capture_default_str();
  app->add_option("--precision", o->precision, "fp32 | tf32 | bf16 | fp16")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}))
      ->capture_default_str();
  app->add_option("--parallel", o->parallel,
                  "A parallel layout (replicate/pipeline/stage/split, docs/distributed.md) or auto (the planner's "
                  "pick): run under `blutrain launch -n N`; prints the planner's prediction beside the measurement");
  app->add_option("--dist-timeout", o->dist_timeout, "With --parallel: seconds before a collective gives up (0: default)")
      ->capture_default_str();
  app->add_option("--dp", o->dp, "Data-parallel ranks: run under `blutrain launch -n N` (NCCL, GPU = LOCAL_RANK)")
      ->capture_default_str();
  app->add_option("--zero", o->zero,
                  "ZeRO stage with --dp: 0 (DDP + AdamW), 1 (optimizer state sharded), 2 (and gradients, reduced "
                  "during backward in --bucket-mib buckets), 3 (and parameters, gathered block by block)")
      ->capture_default_str();
  app->add_option("--bucket-mib", o->ddp.bucket_mib, "With --dp: DDP (or ZeRO-2) bucket capacity (MiB)")->capture_default_str();
  app->add_option("--first-bucket-mib", o->ddp.first_bucket_mib,
                  "With --dp: capacity of DDP's first bucket (MiB; >= --bucket-mib: no special first bucket)")
      ->capture_default_str();
  app->add_option("--comm-priority", o->comm_priority, "With --dp: priority of the NCCL stream, high or default")
      ->check(CLI::IsMember({"high", "default"}))
      ->capture_default_str();
  app->add_flag("!--no-row-exchange", o->row_exchange,
                 "With --dp: reduce the tied embedding's whole gradient at the end of backward instead of its "
                 "LM-head part early and its rows apart");
  app->add_flag("--comm-timeline", o->comm_timeline,
                "With --dp on CUDA: one extra step that polls when each DDP bucket's all-reduce completes, against "
                "the start and end of backward on the device");
  app->add_flag("--skip-comm", o->skip_comm,
                "With --dp: no gradient all-reduce (backward as under no_sync; the ranks' weights diverge), to "
                "measure what overlapping the communication costs the compute");
  app->add_flag("--profile", o->profile, "Also time each op of one extra step (by op name)");
  app->add_option("--recompute", o->recompute,
                  "Activation recompute: none, selective (attention core, MLP activation), mlp (the MLP's input "
                  "projection and activation), mlp:N (that on every N-th block), block (every block), block:N (every "
                  "N-th), or parts joined by + in that order (selective+block:N, mlp:N+block:M, selective+mlp)")
      ->capture_default_str();
  app->add_option("--loss-chunks", o->loss_chunks,
                  "The LM head and its loss in this many row pieces: the logits never held whole (train --loss-chunks)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app->add_flag("--offload-activations", o->offload_activations,
                "Copy the blocks' saved activations to host memory as they are saved, fetched back ahead of backward");
  app->add_option("--grad-accum", o->grad_accum, "Micro-batches per optimizer step (the same batch each)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app->add_option("--offload-state", o->offload_state,
                  "none, optimizer (AdamW's state in pinned host memory), or master (its state and the fp32 master "
                  "weights; bf16/fp16, --offload-update cpu), or master+grads (and their gradients; one rank, bf16)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "optimizer", "master", "master+grads"}));
  app->add_option("--master-weights", o->master_weights,
                  "fp32, or split: each bf16-read fp32 master held as its bf16 compute copy and 16 low bits (2 bytes "
                  "a parameter less; --precision bf16, AdamW without --zero or offload)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "split"}));
  app->add_option("--adamw-state", o->adamw_state,
                  "f32, or bf16: AdamW's moments held in bf16, stored rounded stochastically (on the device)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  app->add_option("--offload-update", o->offload_update, "cpu (host AdamW) or gpu (state streamed in chunks)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "gpu"}));
  app->add_option("--offload-chunk", o->offload_chunk, "Elements per streamed chunk of the offloaded update (gpu: staged moments; cpu: staged gradients)")
      ->capture_default_str();
  app->add_flag("--offload-overlap", o->offload_overlap,
                "With --offload-update cpu: the blocks' update on a worker thread behind the next step's forward "
                "(train --offload-overlap)");
  app->add_option("--gpu-memory-budget", o->gpu_memory_budget, "GiB a device pool (--device cpu:N) may hold");
  app->add_option("--peak-tflops", o->peak_tflops, "The GPU's measured matmul peak for this precision (MFU)");
  app->add_option("--lr", o->lr, "AdamW's learning rate (constant)")->capture_default_str();
  app->add_option("--beta2", o->beta2, "AdamW's beta2")->capture_default_str();
  app->add_flag("--compile", o->compile,
                "Run the steps compiled (captured, memory-planned, replayed; a CUDA graph on the GPU): docs/compiler.md");
  app->add_flag("--compile-log", o->compile_log, "With --compile: print the compiler's log (as BLU_COMPILE_LOG=1)");
  app->add_flag("--compile-check", o->compile_check,
                "With --compile: run each fused region's first launch against its ops run eagerly on the same "
                "inputs and print the largest difference (as BLU_COMPILE_CHECK=1; replays without CUDA graphs)");
  app->add_option("--compile-exclude", o->compile_exclude,
                  "With --compile: comma-separated op names kept out of compilation (default BLU_COMPILE_EXCLUDE)");
  app->add_flag("--compile-remat", o->compile_remat,
                "With --compile: recompute saved activations whose cheap producer's inputs are held anyway "
                "(compiler/remat.h; docs/compiler.md, \"Recompute chosen by the compiler\")");
  app->add_option("--gemm-tune", o->gemm_tune,
                  "on: time cuBLASLt's candidate algorithms for each GEMM shape and keep the fastest "
                  "(docs/performance.md, \"GEMM tuning\"); off: the heuristic's first choice (default BLU_GEMM_TUNE, "
                  "else off)")
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option("--compile-fuse", o->compile_fuse,
                  "With --compile: on fuses regions into generated kernels (the MLIR fusion pass, or the kernel "
                  "cache's fusion plan in a build without MLIR) and chooses GEMM epilogues, off runs every op's eager "
                  "kernel")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app->add_option("--compile-export", o->compile_export,
                  "With --compile: a directory where the captured step is written when its fusion plan is not in "
                  "the kernel cache (the GPU machine, no MLIR); `blutrain compile --from-graph` fuses it where "
                  "MLIR is installed (docs/compiler_mlir.md)");
  return {app, [o] { return run_bench(*o); }};
}

}  // namespace blu::cli
