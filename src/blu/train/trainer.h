// train/trainer: the training loop of any models::CausalLM as a library, shared by `blutrain train` and the tests.
//   One step: zero the gradients; for each of grad_accum micro-batches, forward, scale the loss by
//   1/grad_accum, backward; clip the global gradient norm; set the scheduled learning rate; update.
//   Around the steps: validation loss every val_every steps, a text sample every sample_every
//   steps, a checkpoint every ckpt_every steps and at the end (or on a stop request), a progress
//   line every log_every steps, and <out>/metrics.jsonl. With validation data, the run header and
//   every validation line show the unigram and bigram baselines of the validation tokens
//   (data/ngram_baseline.h); with keep_best, <out>/best.safetensors is the checkpoint of the
//   lowest validation loss so far.
// Data parallel (dp > 1, under `blutrain launch -n dp` or another launcher: dist/env.h): the
// ranks first check that they were started alike (dist/consistency.h: options, model config,
// parameter shapes, world size, build; rank 0's resume checkpoint is the one every rank loads),
// then every rank runs this loop on its slice of the data (batch_size is per rank, so a step trains on
// batch_size·seq_len·grad_accum·dp tokens); gradients are averaged by dist::DistributedDataParallel
// (zero 0, 1) or reduce-scattered by dist::ZeroAdamW (zero 2); only rank 0 prints and writes
// metrics; checkpoints are rank 0's ordinary file (zero 0) or sharded (zero 1, 2; dist/zero.h).
// Parallel layouts (`parallel`, dist/annotations.h) run on a device mesh dp × pp × tp
// (dist/mesh.h: a process group per dimension, created eagerly in one order on every rank):
// split(n[, sp]) rewrites the model into its tensor-parallel shard (dist/tensor_parallel.h),
// pipeline(...) runs the rank's stage (dist/pipeline.h), replicate(n) averages gradients over the
// replicas — nested in any combination. The loader gives each replica its own rows of the global
// batch (batch_size · replicas rows; every TP rank and pipeline stage of a replica the same rows);
// uneven replica weights split those rows in proportion (dist/hetero.h: proportional_split) and
// weight each replica's gradient by its rows, so a step's update is the one of the whole batch on
// one device. Layouts without a checkpoint format (split, dp × pp) refuse --ckpt-every, resuming
// and --keep-best, and write no final checkpoint.
// Depends on models/ (the causal-LM interface and registry), optim/optimizer, data/loader, io/checkpoint, train/metrics, dist/.
// Keep: resuming is exact — `steps` straight and `k` steps + checkpoint + resume give bitwise the
// same weights and losses. Everything a step reads that changes over a run (weights, optimizer
// state, step, the default generator's (seed, offset), the train loader's position) is in the
// checkpoint; samples and validation use their own generator / a loader reset to its start, so
// they never perturb training. A run directory that already holds a run is never touched unless
// `overwrite` (which removes only this trainer's own files), `resume`, or `auto_resume` (which
// continues it, or restarts a run of the same model that has no checkpoint yet). Resuming takes the
// newest checkpoint that verifies (io/checkpoint, dist/zero), warning about each newer one that
// does not.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <limits>
#include <optional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "blu/core/device.h"
#include "blu/core/rng.h"
#include "blu/data/loader.h"
#include "blu/data/ngram_baseline.h"
#include "blu/dist/annotations.h"
#include "blu/dist/env.h"
#include "blu/dist/strategy.h"
#include "blu/models/causal_lm.h"
#include "blu/offload/plan.h"
#include "blu/optim/loss_scaler.h"
#include "blu/optim/optimizer.h"
#include "blu/train/metrics.h"

namespace blu::dist {
class TcpStore;
class DeviceMesh;
}  // namespace blu::dist
namespace blu::compiler {
class CompiledStep;
}  // namespace blu::compiler

namespace blu::train {

// The row pieces --recompute auto tries for the head's loss, in this order (Trainer::
// plan_with_recompute). On an H200 (GPT-2 124M, B=16, T=1024, bf16) 4 pieces cost 1.2% of the step
// and took 1,179 MiB off its peak, 8 cost 3.7% and took 1,332 MiB; 16 took no more than 8
// (docs/performance.md, "The head's loss in row pieces"). Past 4 the weight-gradient GEMM's rows
// per piece get short, and each piece re-reads and re-writes the fp32 gradient.
inline constexpr int64_t kAutoLossChunks[] = {4, 8};

struct TrainOptions {
  // Data: globs of token shards. val_pattern "" means no validation.
  std::string train_pattern, val_pattern;
  // The model's config (CausalLM::config(); models::resolve_model_config turns a --model spec
  // into one). Set init_from to start from the weights of a Hugging Face folder, a checkpoint or
  // a run directory's newest checkpoint (train/model_spec.h) instead of the family's
  // initialisation. Null: GPT-2 d12, as `blutrain train` defaults to.
  nlohmann::json model;
  std::string init_from;
  int64_t batch_size = 8, seq_len = 0, grad_accum = 1, steps = 100;  // seq_len 0: the model's block size
  // The train loader's windows in a permuted order, per epoch from `seed` (data/loader.h): a short
  // run then sees the whole corpus instead of its first files.
  bool shuffle = false;
  double lr = 1e-3, min_lr = 1e-4;
  int64_t warmup = 20;
  std::string schedule = "cosine";  // cosine | linear | constant
  double weight_decay = 0.1, grad_clip = 1.0;  // grad_clip <= 0: no clipping (the norm is still reported)
  std::string optimizer = "adamw";             // adamw | sgd
  double beta1 = 0.9, beta2 = 0.95;             // AdamW's (GPT-2's / llm.c's)
  uint64_t seed = 1337;                         // model init, default generator, sampling
  std::string device = "cpu";
  // fp32 (IEEE matmuls) | tf32 | bf16 | fp16: bf16/fp16 run activations and matmuls in 16 bits
  // over fp32 master weights and optimizer state; fp16 adds dynamic loss scaling.
  std::string precision = "fp32";
  // The device's dense matmul peak in TFLOP/s for the MFU each logged step records (model FLOPs
  // per second per rank over it); 0 looks the GPU up in train/peak_flops.h (none on the CPU).
  double peak_tflops = 0;
  std::string out;  // run directory; "" writes nothing (no metrics, no checkpoints)
  bool overwrite = false, resume = false;
  // Resume when --out holds a checkpoint, else start there — also over a run of the same model that
  // stopped before its first checkpoint (its metrics are dropped). For restarts under
  // `blutrain launch --max-restarts` (dist/launch.h).
  bool auto_resume = false;
  // A resume (or auto-resume) that changes an option the trajectory depends on (train/run_record.h:
  // the data, model, batch, optimizer, schedule, seed, precision, layout) is refused unless this is
  // set. Not in to_json().
  bool allow_changes = false;
  int64_t val_every = 0, val_batches = 20;      // 0: never (a final validation still runs when val data exists)
  int64_t sample_every = 0, sample_tokens = 64;
  double sample_temperature = 1.0;
  int64_t sample_top_k = 40;
  int64_t ckpt_every = 0, keep_last = 3;        // ckpt_every 0: only at the end
  // Also keep <out>/best.safetensors: a copy of the checkpoint at the best validation loss so far
  // (a checkpoint is written at every validation that improves on it). Single-file checkpoints.
  bool keep_best = false;
  // The n-gram baselines beside the validation loss (data/ngram_baseline.h): add-one smoothed over
  // baseline_vocab ids (0: the model's vocab_size), counted on the first baseline_max_tokens of
  // the training shards.
  bool baseline = true;
  int64_t baseline_vocab = 0, baseline_max_tokens = int64_t(1) << 23;
  // The tokenizer spec of the shards (data/text_tokenizer.h: "byte", "gpt2", a path): recorded in
  // run.json and checkpoints so that `blutrain sample` decodes with it. "" = not known.
  std::string tokenizer;
  int64_t log_every = 1;
  int64_t dp = 1;  // data-parallel degree; > 1 must equal the launcher's WORLD_SIZE (CPU, Gloo)
  int zero = 0;    // 0: DDP + optimizer; 1, 2, 3: ZeRO stage (AdamW only, dp > 1)
  bool row_exchange = true;  // the tied embedding's rows exchanged apart (DDP, ZeRO-2: dist/ddp.h, dist/zero.h)
  // Seconds after which the store and the collectives give up on a peer (0: BLU_DIST_TIMEOUT, and
  // without it the store's and Gloo's 30 s, NCCL's 600 s).
  double dist_timeout = 0;
  // Seconds the other ranks wait for work of rank 0 alone (a checkpoint, a sample) or of unbounded
  // length (validation), behind a store barrier instead of in a collective with dist_timeout.
  double dist_work_timeout = 3600;
  // The parallel layout as annotations (dist/annotations.h), e.g. "replicate(2, zero=1)" or
  // "pipeline(2, schedule=1f1b, micro=4)"; "" uses --dp / --zero. Must name the launched world size.
  std::string parallel;
  // What the blocks do with their saved activations (models/activations.h): recompute none |
  // selective | mlp | mlp:N | block | block:N, joined by + (selective+block:N, …) | auto (the budget planner picks:
  // Trainer::plan_with_recompute), and offload to host memory. Not in to_json():
  // like the memory layout below, a policy changes memory, not the numbers.
  std::string recompute = "none";
  bool offload_activations = false;
  // The head's loss in this many row pieces (models/causal_lm.h set_loss_chunks; ops/fused.h Note
  // [Chunked loss]): the logits are never held whole. 0: off, or under --recompute auto the
  // planner's choice (which it writes back here: one of kAutoLossChunks, or 1); 1: whole logits, never in
  // pieces. In to_json(): the w-gradient's sums run in another order, so the numbers move by fp32
  // rounding.
  int64_t loss_chunks = 0;
  // Memory budget and optimizer state offload (offload/plan.h, docs/offload.md): with any of these
  // set, a start-up probe measures one micro-batch's activations and the host AdamW and transfer
  // speeds, the planner decides where AdamW's state lives and prints the plan, and the run fails
  // before its first step when nothing fits. A device pool (--device cpu:N) enforces the device
  // budget. Not in to_json(): a layout changes memory, not the numbers (offload is bitwise equal).
  double gpu_memory_budget = 0, host_memory_budget = 0;  // GiB, 0: none
  // auto (offload only when the budget needs it) | none | optimizer | master (the fp32 parameters
  // too) | master+grads (and their gradients, one rank)
  std::string offload_state = "auto";
  // fp32 | split: in bf16, the fp32 master weights read through compute copies held as those copies
  // and their low 16 bits (optim/master_split.h, Note [Split masters]): 2 bytes a parameter less.
  // In to_json() when split (the copies round ties away from zero).
  std::string master_weights = "fp32";
  // f32 | bf16: AdamW's moments in bf16, rounded stochastically (Note [Stochastic bf16 moments],
  // core/round_stochastic.h): 4 bytes a parameter less, on the device only. Changes the trajectory
  // (train/run_record.h).
  std::string adamw_state = "f32";
  std::string offload_update = "auto";  // auto (the faster by the probe) | cpu | gpu
  bool offload_overlap = false;  // the cpu update's blocks behind the next forward (offload/offload_adamw.h)
  int64_t offload_chunk = int64_t(1) << 22;  // elements per streamed chunk of the offloaded update (moments for gpu, gradients for cpu)
  // Compiled steps (compiler/compile.h): every training step captured at the dispatch point,
  // planned into one arena and replayed (bitwise the eager step). Layouts and modes the compiler
  // does not support are refused at start, by name. compile_log prints the compiler's log (as
  // BLU_COMPILE_LOG=1 does); compile_exclude names ops kept out of compilation (compiler/exclude.h;
  // "" keeps BLU_COMPILE_EXCLUDE's list). compile_fuse: "on" fuses regions (compiler/fusion_plan.h:
  // the fusion pass where the app links MLIR, else only fusion plans found in the kernel cache),
  // "off" runs every op's eager kernel.
  bool compile = false, compile_log = false;
  // compile_check: each fused region's first launch against its eager ops (CompileOptions::check).
  bool compile_check = false;
  std::string compile_exclude;
  std::string compile_fuse = "on";
  // gemm_tune: "on" times cuBLASLt's candidate algorithms per GEMM shape (apply_gemm_tune).
  std::string gemm_tune;
  // compile_remat: the compiler's own save-or-recompute pass (compiler/remat.h).
  bool compile_remat = false;
  // compile_export: a directory where a captured step whose fusion plan is not in the kernel cache is
  // written (compiler/fusion_plan.h, export_graph; rank 0 only), for `blutrain compile --from-graph`.
  std::string compile_export;

  nlohmann::json to_json() const;  // recorded in run.json and in checkpoints
};

struct TrainCallbacks {
  std::ostream* log = nullptr;  // progress lines, tables, samples; nullptr: silent
  // Turns sampled ids into text; without it samples print as ids.
  std::function<std::string(const std::vector<int32_t>&)> decode;
  // Empty: GPT-2's <|endoftext|> (50256) when the vocabulary holds it, else token 0.
  std::vector<int32_t> sample_prompt;
  std::function<void(const StepStats&)> on_step;
  std::function<void(int64_t step, double val_loss)> on_eval;
  // Polled after every step: when it reads true the trainer saves a checkpoint and returns.
  const std::atomic<bool>* stop = nullptr;
};

struct TrainSummary {
  int64_t start_step = 0, end_step = 0;  // steps done before this run / after it
  bool interrupted = false;              // stopped by the stop flag before `steps`
  double final_train_loss = 0, final_val_loss = -1;  // -1: no validation data
  double baseline_unigram = -1, baseline_bigram = -1;  // -1: no baseline (no validation data)
  double best_val_loss = -1;             // the lowest validation loss seen (-1: none)
  int64_t tokens = 0;                    // trained in this run
  double seconds = 0, tokens_per_s = 0;
  int64_t peak_mem_bytes = 0;
  std::string checkpoint;                // the last checkpoint written ("" when out is "")
};

// Mean loss over the first `batches` batches of `loader` (reset to its start first), without
// gradients and in eval mode. `batches` is capped at one epoch of the loader.
double evaluate(models::CausalLM& model, DataLoader& loader, int64_t batches, Device device);

// A checkpoint file as given, or the latest checkpoint in a run directory. BLU_CHECK when none.
std::string resolve_checkpoint(const std::string& file_or_run_dir);
// Sets the model's compute dtype and the matmul precision for a --precision name.
void apply_precision(models::CausalLM& model, const std::string& precision);
// --gemm-tune on|off: cuBLASLt's algorithms timed per GEMM shape (Note [GEMM tuning],
// backend/cuda/gemm.h); "" keeps BLU_GEMM_TUNE's setting. Nothing to tune in a build without CUDA.
void apply_gemm_tune(const std::string& setting);
// What GEMM tuning did in this process, for the run's log: "gemm tuning: 15 plans timed (7 took
// another algorithm than the heuristic's first), 0 taken from FILE"; "" when tuning is off or the
// build has no CUDA.
std::string gemm_tune_summary();

// BLU_CHECK for option values that cannot run (each error names the flag, expected vs got); the
// model's shapes bound some (the sequence length). Before anything is built or touched.
void check_options(const TrainOptions& o, const models::CausalLM& model);
// AdamW's moments' dtype as --adamw-state names it (f32 or bf16, checked by check_options).
inline DType adamw_state_dtype(const TrainOptions& o) { return dtype_from_name(o.adamw_state); }
// Warnings for a schedule that cannot do what its flags say: --min-lr above --lr, a --warmup longer
// than the run.
void warn_about_schedule(const TrainOptions& o, std::ostream& os);

class Trainer {
 public:
  // Checks the options and the run directory (nothing on disk changes when a check fails), builds
  // the model, optimizer and loaders, and, with `resume`, restores the latest checkpoint.
  Trainer(TrainOptions options, TrainCallbacks callbacks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainSummary run();

  models::CausalLM& model() { return *model_; }
  optim::Optimizer& optimizer() { return strategy_->optimizer(); }
  dist::Strategy& strategy() { return *strategy_; }
  int64_t step() const { return step_; }
  const TrainOptions& options() const { return opt_s_; }

 private:
  dist::StepValues train_step();
  dist::Layout resolve_run_layout(const dist::DistEnv& env);  // layout_setup.cpp
  std::string save(int64_t step);
  void keep_best(double val_loss);
  void compute_baseline();
  void print_header();
  void sample(int64_t step);
  // Data parallel: what the ranks are doing, named by a collective that times out.
  void set_phase(const std::string& phase);
  // Every rank waits (up to dist_work_timeout, through the store) for work of rank 0's; `what`
  // names it in the timeout's error.
  void wait_for_rank0(const std::string& what);
  // Runs f with the collectives' timeout raised to dist_work_timeout (work of unbounded length).
  void with_work_timeout(const std::function<void()>& f);

  TrainOptions opt_s_;
  TrainCallbacks cb_;
  Device device_;
  std::unique_ptr<models::CausalLM> model_;
  optim::LRSchedule schedule_;
  std::unique_ptr<DataLoader> train_loader_, val_loader_;
  MetricsLog metrics_;
  int64_t step_ = 0;
  std::string last_checkpoint_;
  std::optional<BaselineLoss> baseline_;
  int64_t baseline_train_tokens_ = 0;
  double best_val_ = std::numeric_limits<double>::infinity();
  // Data parallel: rank 0 serves the store the strategy's process group rendezvoused through.
  int rank_ = 0;
  int world_ = 1;        // ranks of the job
  double peak_tflops_ = 0;  // per rank, for MFU; 0: none recorded
  bool pipelined_ = false;  // a pipeline layout: every stage of a replica reads the same batches
  // --parallel: the resolved layout in words, this rank's rows of a batch (uneven replica weights
  // make them differ between replicas), every replica's rows, whether this rank takes part in
  // sampling (under tensor parallelism rank 0's whole TP group runs the model), and the layout's
  // name when it has no checkpoint yet ("" when it has one).
  std::string layout_text_;
  int64_t local_batch_ = 0;
  std::vector<int64_t> replica_rows_;
  bool samples_here_ = false;
  std::unique_ptr<dist::TcpStore> store_;
  std::unique_ptr<dist::DeviceMesh> mesh_;  // hybrid layouts (tp, dp × pp): a group per mesh dimension
  std::unique_ptr<dist::Strategy> strategy_;
  int64_t work_barriers_ = 0;
  // --parallel auto: the planner's prediction for its pick (layout, step_ms, memory_mib), checked
  // against the second logged line (check_auto_prediction); the logged lines so far.
  std::optional<nlohmann::json> auto_prediction_;
  int auto_reads_ = 0;
  void check_auto_prediction(const StepStats& s);
 public:
  // The memory plan of this run (offload/plan.h); nullopt when no budget or offload option was set.
  const std::optional<offload::MemoryPlan>& memory_plan() const { return memory_plan_; }

 private:
  // `job`: the job's process group (null on one rank), over which --recompute auto agrees and
  // ZeRO-3's probe strategy shards; `pipeline_gradients`: a pipeline's second group (NCCL).
  void plan_memory(dist::StrategyConfig& sc, const dist::Layout& layout, const std::shared_ptr<dist::ProcessGroup>& job,
                   const std::shared_ptr<dist::ProcessGroup>& pipeline_gradients);
  // --recompute auto; all_fit(fits here) says whether a candidate fits on every rank that must agree.
  offload::MemoryPlan plan_with_recompute(offload::PlanInput& in, const std::function<void()>& probe,
                                          const std::function<bool(bool)>& all_fit);
  std::optional<offload::MemoryPlan> memory_plan_;
  // --compile: the compiled step, and the batch tensors it reads (micro-batch i's ids and targets
  // at 2i and 2i+1), refilled before every step so their addresses stay fixed.
  std::unique_ptr<compiler::CompiledStep> compiled_;
  std::vector<Tensor> compile_inputs_;
};

}  // namespace blu::train
