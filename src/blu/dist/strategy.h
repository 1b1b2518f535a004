// dist/strategy: one object per parallel layout — a single device, DDP, ZeRO-1, ZeRO-2, ZeRO-3 — that the
// trainer, `blutrain bench` and the tests drive the same way, so the wiring of each mode exists
// once:
//   construction prepares the model (rank 0's weights on every rank; DDP's bucketed all-reduce
//     hooks, or ZeRO-2's reduce-scatter hooks, or ZeRO-3's block hooks on a models::CausalLM) and
//     builds the optimizer (AdamW, or SGD without ZeRO; ZeRO-1/2/3 shard AdamW's state, ZeRO-3 the
//     parameters too: dist/zero.h);
//   step() runs one optimizer step over its micro-batches: each micro-batch's forward (the caller's
//     function, returning the loss), backward of loss / micro_batches (times the fp16 loss scale)
//     with the mode's communication (only the last micro-batch's backward communicates), the
//     gradients completed, unscaled (fp16), clipped to the global norm, and the update — skipped
//     when the norm is not finite, all decided on the device;
//   read() turns a step's device values into host numbers: the one host read of a logged step,
//     the loss averaged over ranks and the stop flags combined in one small collective;
//   tensor parallelism (StrategyConfig::tp): partial gradients summed over the TP group, the
//     global norm over the shards; ZeRO is refused under it;
//   uneven replicas (StrategyConfig::batch_share): each replica's gradient weighted by its rows;
//   save/load/latest_checkpoint: the layout checkpoint (dist/layout_checkpoint.h: each rank's
//     pieces of the global tensors) under TP, ZeRO and pipelines; a single device and DDP write
//     rank 0's single file (io/checkpoint: the whole global tensors under the same names), or the
//     layout checkpoint with StrategyConfig::layout_checkpoints. load reads either under every
//     layout, and the older ZeRO-sharded and pipeline formats under their own layouts (a pipeline
//     checkpoint under every layout).
// A pipeline Strategy (the CausalLM constructor below) runs the same step through a PipelineStage
// (dist/pipeline.h): its optimizer holds only this stage's parameters, the loss lives on the last
// stage, the norm is combined over stages, and each stage checkpoints its own parameters by global
// name; with replicas (StrategyConfig::dp: dp × pp) the owned gradients are averaged over the
// replicas before the norm, and with tensor-parallel stages (StrategyConfig::tp: pp × tp) the norm
// counts each shard once. step(n, batch_of, …) — micro-batch i's (idx, targets) — is the one step
// both the plain and the pipeline paths take.
// dist/ knows no model type: it sees an nn::Module, and exchanges apart the rows of every
// nn::Embedding that declares a row-sparse gradient (Embedding::set_row_sparse_grad; GPT-2's tied
// wte does) when row_exchange is on.
// Depends on dist/ddp, dist/zero, dist/process_group, optim/, io/checkpoint, nn/. Keep: every
// rank calls step(), read() and save() the same number of times in the same order (they hold
// collectives); losses and norms stay on the device until read(); the arithmetic of a step is the
// same as the plain loop's (a single-device Strategy reproduces it bit for bit).
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "blu/dist/ddp.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/process_group.h"
#include "blu/io/checkpoint.h"
#include "blu/nn/module.h"
#include "blu/offload/offload_adamw.h"
#include "blu/optim/loss_scaler.h"
#include "blu/optim/master_split.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"

namespace blu::dist {

class ZeroAdamW;

struct OptimizerConfig {
  std::string name = "adamw";  // adamw | sgd
  double lr = 1e-3, weight_decay = 0.1;  // weight decay on parameters of 2 or more dims (optim::decay_groups)
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;  // AdamW (GPT-2's / llm.c's betas)
  double momentum = 0.9;                         // SGD
  DType state_dtype = DType::f32;  // AdamW's moments (optim::AdamWOptions::state_dtype)
};

struct StrategyConfig {
  int zero = 0;               // 0: DDP when the group has several ranks; 1, 2, 3: ZeRO stage (AdamW)
  bool zero3_keep_forward = false;  // ZeRO-3: blocks stay gathered from forward to backward
  // Row-sparse embeddings' rows exchanged apart (DDP, ZeRO-2), or with no process group added into
  // the weight's gradient in place (Note [Tied rows on one device], strategy.cpp).
  bool row_exchange = true;
  double rows_gather_limit = 1.0;  // rows gathered while world × tokens ≤ this × rows (dist/ddp.h)
  DDPOptions ddp;             // bucket sizes (DDP, ZeRO-1); exchange_rows is filled by the strategy
  double zero_bucket_mib = 25.0;  // ZeRO-2's gradient buckets
  bool fp16_loss_scaling = false;
  bool skip_comm = false;     // DDP without its collectives (ranks diverge): `bench --skip-comm`
  // Tensor parallelism: the TP group of a model already rewritten by apply_tensor_parallel
  // (dist/tensor_parallel.h); the strategy's own group (`pg`) is then the data-parallel group.
  // The gradients of replicated parameters that sequence parallelism leaves partial (norms,
  // row-parallel biases) are summed over it, and the gradient norm counts every shard once.
  std::shared_ptr<ProcessGroup> tp;
  // A pipeline with replicas (dp × pp, the pipeline constructor): the data-parallel group over the
  // replicas of this rank's stage (the owned gradients are averaged over it before the norm), and
  // the job's group, over which read(), mean_over_ranks() and barrier() run (null: the pipeline's).
  std::shared_ptr<ProcessGroup> dp, job;
  // This replica's share of the global batch (0: an even split). Uneven shares (dist/hetero.h:
  // replicate with weights) weight each replica's gradient by its share of the rows before the
  // data-parallel average — the loss is scaled by share × replicas — so the update is the one of
  // the whole batch on one device.
  double batch_share = 0;
  // Optimizer state offload (offload/offload_adamw.h): AdamW's moments in host memory, updated on
  // the host or streamed through the device. Composes with DDP (each rank updates its full copy
  // from the averaged gradients), ZeRO (the device update: dist/zero.h) and tensor and pipeline
  // layouts (each rank's own parameters).
  // offload.masters_on_host moves the fp32 parameters there too (Note [Masters on the host]): the
  // model must be a models::CausalLM in bf16/fp16, and the host runs the update; with
  // offload.grads_on_host their gradients too (one rank, no fp16 loss scaling).
  bool offload_state = false;
  offload::OffloadOptions offload;
  // A single device and DDP write the layout checkpoint (dist/layout_checkpoint.h) too, instead of
  // rank 0's single file; the other layouts always write it. Every layout loads both.
  bool layout_checkpoints = false;
  // bf16: every fp32 master a forward reads through its compute copy is held as that copy and its
  // low 16 bits (Note [Split masters], optim/master_split.h): AdamW without ZeRO, state offload,
  // tensor parallelism or a pipeline.
  bool split_masters = false;
};

// One step's values, on the device until Strategy::read().
struct StepValues {
  Tensor loss_sum;   // 0-d f64: the sum of the micro-batches' losses on this rank
  int64_t micro_batches = 0;
  NormGate gate;     // the global gradient norm's square, which clipped (or skipped) the update
  double lr = 0;
  Tensor fp16_skipped;  // fp16: the loss scaler's count of skipped (overflowed) steps, 0-d f64
};

struct StepReadout {
  double loss = 0;       // mean over micro-batches and ranks
  double grad_norm = 0;  // before clipping; not finite: the update was skipped (fp16: an overflow)
  bool stop = false;     // some rank asked to stop
  int64_t fp16_skipped = -1;  // fp16: the steps skipped so far for overflow (-1: no loss scaling)
};

class Strategy {
 public:
  // `pg` null: a single device. The model is on its device already.
  Strategy(nn::Module& model, std::shared_ptr<ProcessGroup> pg, StrategyConfig config, OptimizerConfig optimizer);
  // Pipeline parallelism over `pp` (stage r on rank r; null or one rank: every stage here). Only
  // DDP-free settings apply (zero must be 0, no fp16 loss scaling: BLU_CHECK).
  Strategy(models::CausalLM& model, std::shared_ptr<ProcessGroup> pp, PipelineOptions pipeline, StrategyConfig config,
           OptimizerConfig optimizer);
  ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // "single", "ddp", "zero1", "zero2" or "zero3".
  const std::string& name() const { return name_; }
  std::string describe() const;  // for the run header: "2 ranks (gloo), ZeRO stage 1"
  int rank() const;
  int world_size() const;
  ProcessGroup* process_group() const { return pg_.get(); }

  // One optimizer step (see the header comment). `loss_of(i)` runs micro-batch i's forward and
  // returns its loss (0-d); it must hold no handle on the logits. max_norm <= 0: no clipping (the
  // norm is still measured). Clipping and the skip of an update whose gradient norm is not finite
  // are decided on the device (Note [Norm gate], ops/optim.h), and so is fp16's loss scale
  // (LossScaler's device side): nothing here reads a device value on the host.
  // `phase`, when given, is called after the last backward was issued (1), once the gradients are
  // complete — reduced, for data parallelism (2) — and after the update (3): `bench` records
  // events there.
  StepValues step(int64_t micro_batches, const std::function<Tensor(int64_t)>& loss_of, double lr, double max_norm,
                  const std::function<void(int)>& phase = {});
  // The same step from batches: micro-batch i is batch_of(i) = (idx, targets), run through the
  // model's forward (the model must be a models::CausalLM) or, under a pipeline, through its
  // stages. The one step API that works for every layout.
  StepValues step(int64_t micro_batches, const BatchFn& batch_of, double lr, double max_norm,
                  const std::function<void(int)>& phase = {});
  // The host numbers of a step: one host read (and, with several ranks, one all-reduce of the loss
  // and the stop flags before it).
  StepReadout read(const StepValues& v, bool stop_requested);
  // Mean of a host value over ranks (v itself on a single device), e.g. a validation loss.
  double mean_over_ranks(double v);
  void barrier();

  optim::Optimizer& optimizer() { return *opt_; }
  optim::LossScaler* loss_scaler() { return scaler_.get(); }
  // Checkpoints (collective for ZeRO: every rank calls it; rank 0 writes the replicated parts).
  // save returns the checkpoint written ("" on ranks that write nothing).
  std::string save(const std::string& dir, const nn::Module& model, const TrainState& st, int keep_last);
  TrainState load(const std::string& path, nn::Module& model, const nlohmann::json& expected_model_config);
  // The newest checkpoint in dir that verifies (io/checkpoint, dist/zero); newer ones that do not
  // are reported through warn.
  std::string latest_checkpoint(const std::string& dir, const CheckpointWarning& warn = {}) const;
  // What --resume looks for, for error messages.
  std::string checkpoint_kind() const;

  // Every parameter whole and current while the returned guard lives — for evaluation, sampling
  // and export outside step(): ZeRO-3 gathers them all, a pipeline broadcasts each stage's trained
  // parameters to the other stages; other layouts hold them already. Collective under ZeRO-3 and
  // pipelines: every rank takes one at the same point.
  class FullParameters {
   public:
    explicit FullParameters(Strategy& s);  // NOLINT
    ~FullParameters();
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;

   private:
    ZeroAdamW* zero_;
    PipelineStage* pipeline_;
  };
  FullParameters full_parameters() { return FullParameters(*this); }
  // Every parameter's value readable and writable while the returned guard lives: with fp32 masters
  // on the host the released parameters view their masters, and split masters view theirs joined,
  // on the CPU (checkpoints take one); otherwise the guard does nothing. Not for a forward: the
  // model's device is where its copies are.
  class ParameterValues {
   public:
    ParameterValues(offload::OffloadAdamW* host, optim::SplitMasters* split) : host_(host), split_(split) {}

   private:
    offload::OffloadAdamW::HostView host_;
    optim::SplitMasters::View split_;
  };
  ParameterValues parameter_values() {
    finish_update();
    return ParameterValues(masters_, split_.get());
  }
  // The offloaded update that runs behind the next forward (Note [Update behind the forward],
  // offload/offload_adamw.h) done, its uploads ordered before the compute stream's next work: for
  // whoever reads parameters or times steps outside step(). save, load, full_parameters and
  // parameter_values call it.
  void finish_update();
  // The parameter elements whose fp32 values live only on the host (0 without masters_on_host).
  int64_t released_elements() const { return released_elements_; }
  // The parameter elements held as split masters (0 without split_masters).
  int64_t split_elements() const { return split_ ? split_->elements() : 0; }

  // The layout's parts, for tests and `bench --comm-timeline`: DDP (null without it), ZeRO (null
  // without it).
  DistributedDataParallel* ddp() { return ddp_.get(); }
  ZeroAdamW* zero() { return zero_; }
  PipelineStage* pipeline() { return pipeline_.get(); }

 private:
  nn::Module& model_;
  std::shared_ptr<ProcessGroup> pg_;
  StrategyConfig config_;
  std::string name_;
  std::vector<Tensor> params_;
  std::unique_ptr<optim::Optimizer> opt_;
  ZeroAdamW* zero_ = nullptr;  // points into opt_ under ZeRO
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<optim::LossScaler> scaler_;
  int block_hooks_ = -1;  // ZeRO-3's or the offloaded update's, on the model
  std::vector<nn::Embedding*> local_rows_;  // the embeddings given a local row sink (removed at the end)
  std::unique_ptr<PipelineStage> pipeline_;
  // Tensor parallelism: parameters split over config_.tp, and replicated ones with partial gradients.
  std::vector<Tensor> tp_sharded_, tp_replicated_, tp_partial_;
  NormGate tp_norm_gate(double max_norm);
  NormGate host_gradients_gate(double max_norm);
  // The layout checkpoint's writers and this rank's parameters with their global places
  // (layout_checkpoint.h).
  CheckpointRanks checkpoint_ranks() const;
  std::vector<HeldParameter> held_parameters();
  nlohmann::json layout_json() const;
  // The factor of this rank's loss (batch_share × replicas; 1 for an even split).
  double share_factor_ = 1;
  // Note [Compute copies laid out first] (strategy.cpp): one token's forward before the first step.
  void lay_out_compute_copies();
  // offload.masters_on_host: the optimizer that holds the released parameters' values.
  void release_masters();
  offload::OffloadAdamW* masters_ = nullptr;
  // split_masters: made after the compute copies are laid out.
  void split_masters();
  std::shared_ptr<optim::SplitMasters> split_;
  // The host-run offloaded AdamW whose blocks' update runs behind the next forward (null: none).
  offload::OffloadAdamW* offload_ = nullptr;
  int64_t released_elements_ = 0;
};

// All-reduces `grads` in place over `pg`: runs of small ones of one dtype (up to 32 MiB) packed
// into a flat buffer and reduced as one collective, large ones where they are (each collective
// pays its latency: on two CPU ranks about a millisecond).
void all_reduce_packed(ProcessGroup& pg, const std::vector<Tensor>& grads, ReduceOp op);

// Every nn::Embedding of `model` that declares a row-sparse gradient, in module order.
std::vector<nn::Embedding*> row_sparse_embeddings(nn::Module& model);
// The storages of every nn::Embedding's weight of `model`: looked up in their own dtype, they stay
// fp32 on the device when the masters go to the host or are split.
std::set<const Storage*> embedding_weight_storages(nn::Module& model);

}  // namespace blu::dist
