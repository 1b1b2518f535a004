// dist/zero: ZeRO stages 1, 2 and 3 for AdamW.
// The parameters, in optimizer-group order, are seen as one flat vector of N elements (the
// "flat" offsets below). Each rank owns a W-th of it — its shard — and keeps AdamW's moments for
// the shard only (a W-th of the optimizer state per rank).
//   Stage 1 — use with DistributedDataParallel: gradients arrive averaged (DDP's bucketed
//     all-reduce overlapped with backward). Rank r owns the contiguous slice [r·S, min((r+1)·S, N)),
//     S = ceil(N / W); step() updates it.
//   Stage 2 — use without DDP (call broadcast_parameters once). Gradients are reduced while
//     backward runs (Note [ZeRO-2 buckets]): the parameters are grouped into buckets in the order
//     backward completes their gradients; when a bucket's last gradient arrives, the gradients are
//     copied into a staging buffer and released, and the buffer is reduce-scattered (average), so
//     rank r keeps the r-th chunk of every bucket — its shard — and no rank holds all gradients at
//     once. Gradient accumulation: under set_sync(false) backward accumulates locally as usual; the
//     synced backward (the last micro-batch) reduces. reduce_gradients() (called by step(),
//     clip_grad_norm() and norm_gate()) issues what backward left (a parameter with no gradient
//     contributes zeros) and waits; shard_gradient() is then this rank's averaged gradient.
//   Stage 3 — the parameters sharded too (Note [ZeRO-3], zero3.cpp): the parameters are grouped
//     into units (ZeroOptions::units: a model's blocks, plus one unit of everything else); rank r
//     keeps chunk r of every unit's parameters, gradients and moments, and a unit's parameters have
//     bytes only while it is gathered — around its forward and its backward (before_block /
//     after_block, the block hooks dist::Strategy installs), its gradient reduce-scattered right
//     after its backward.
//   All: AdamW on the shard, each parameter's piece with its group's weight decay and the same
//   fp32 kernel as optim's AdamW (adamw_step_); stages 1 and 2 then all-gather the updated shards
//   so every rank holds the whole new parameters (stage 3 gathers them when they are next used).
// Sharded checkpoints of this state: dist/zero_checkpoint.h.
// Depends on dist/process_group, dist/row_exchange, optim/optimizer, ops/optim,
// autograd/function (stage 3). Keep: the update of
// each element is exactly optim's AdamW given the same averaged gradient; every parameter is
// updated every step (bias correction uses the optimizer's step count: DDP gives unused
// parameters a zero gradient, so plain AdamW steps them every step too); parameters are f32.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/nn/layers.h"
#include "blu/nn/module.h"
#include "blu/offload/transfer.h"
#include "blu/optim/optimizer.h"

namespace blu::dist {

struct ZeroOptions {
  double bucket_mib = 25.0;  // stage 2: gradient bucket capacity (a larger parameter gets a bucket alone)
  // Stage 2: parameter names in the order backward is expected to complete their gradients (the
  // reverse of the model's registration order, say); names not listed follow in reverse flat
  // order. Empty: the reverse flat order. Every rank must give the same order.
  std::vector<std::string> reduce_order;
  // Stage 2: parameters that get a bucket of their own — one whose gradient completes much later
  // than its neighbours' in reduce_order (GPT's tied embedding without row exchange: its LM-head
  // part comes first, its rows last), which would otherwise hold its bucket's staging buffer
  // through all of backward.
  std::vector<std::string> solo;
  // Stage 2: tied embeddings (alive as long as the optimizer) whose gradient is reduced in two
  // parts, as DDP's row exchange (Note [ZeRO-2 row exchange]): the LM head's dense part in a bucket
  // of its own, first in the reduction order, while backward goes on; the embedding's rows after
  // the last bucket.
  std::vector<nn::Embedding*> exchange_rows;
  // Row exchange gathers the rows while world × tokens ≤ this × num_embeddings; above, it
  // reduce-scatters them as a dense gradient.
  double rows_gather_limit = 1.0;
  // Stage 3: the parameter names of each unit gathered at once, in block order (block i is unit
  // i); the parameters named in no unit form one more unit, the last ("the rest": embeddings,
  // final norm, head). Every rank must give the same units.
  std::vector<std::vector<std::string>> units;
  // Stage 3: a block's parameters stay gathered from its forward until its backward (no second
  // all-gather; the whole model's parameters are then live at the end of the forward).
  bool keep_forward = false;
  // Every stage: AdamW's moments (8 bytes per shard element) in host memory (pinned for a GPU;
  // plain host memory beside a pool cpu:N), streamed through the device in chunks of this many
  // elements at each update (two staging buffers: chunk i+1 comes in while chunk i is updated and
  // chunk i-1 goes back; no host wait inside the step). 0: the moments live on the device.
  int64_t offload_chunk_elements = 0;
};
// Options for `model` trained with ZeRO-2: reduce_order the reverse of its registration order (the
// order backward roughly completes gradients in) and the given bucket capacity. `tied`, a tied
// embedding of the model (GPT's wte), gets a bucket of its own (solo) and, with exchange_rows,
// its rows exchanged apart (stage 2 only).
ZeroOptions zero_options_for(const nn::Module& model, double bucket_mib = 25.0, nn::Embedding* tied = nullptr,
                             bool exchange_rows = false);

// Stage 2: the most bytes its gradient staging buffers hold at once (Note [ZeRO-2 buckets]): the
// buckets being reduced and the one filling, each up to bucket_mib of gradients; the largest
// parameter, alone in its bucket, reduces from its own gradient.
double zero2_staging_bytes(double elements, double largest, double bytes_per_element, double bucket_mib = 25.0);

class ZeroAdamW final : public optim::Optimizer {
 public:
  ZeroAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions options, std::shared_ptr<ProcessGroup> pg,
            int stage, ZeroOptions zero = {});
  ~ZeroAdamW() override;

  // Stage 2: completes the reduction of this step's gradients (see the header comment); the
  // parameters' gradients are released. Stage 1: nothing (DDP has averaged them).
  void reduce_gradients();
  // Stage 2: off, backward only accumulates locally (the micro-batches of gradient accumulation
  // before the last); on (the default), backward reduces the buckets as they complete.
  void set_sync(bool on);
  bool sync() const;
  // Stage 2, after reduce_gradients(): this rank's averaged gradient, [shard_numel()] f32 (the
  // fp16 loss scaler unscales and checks it in place).
  Tensor shard_gradient();
  // Global L2 norm of the averaged gradient (the same value on every rank) and clipping to
  // max_norm as optim::clip_grad_norm does; stage 2 reduces first. Reads the norm on the host.
  double clip_grad_norm(double max_norm);
  // The same clipping as a gate for step(gate), decided on the device (Note [Norm gate],
  // ops/optim.h): the averaged gradient's sum of squares — stage 1 over the parameters' gradients
  // (optim::grad_norm_gate), stage 2 over the shard after reducing, all-reduced in f64 on the
  // device — the same total on every rank, no host read. optim::gate_norm reads its norm.
  NormGate norm_gate(double max_norm);
  using optim::Optimizer::step;
  void step(const NormGate& gate) override;

  // This rank's state: "step", "exp_avg" and "exp_avg_sq" (1-d, the owned slice). Loading takes the
  // same layout; a different world size goes through load_sharded_checkpoint.
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;

  // Stage 3 (Note [ZeRO-3], zero3.cpp). Every rank calls these in the same order (they issue
  // collectives). begin_forward(first): before a micro-batch's forward — the rest unit gathered
  // for the embedding, and with first the step's shard gradient zeroed. before_block / after_block:
  // the block hooks, returning x (y) or an identity whose backward node gathers (reduces) the
  // block's parameters (gradients). begin_backward / end_backward: around each backward — the rest
  // unit's gradient buffer, and at the end every reduction completed and every unit released.
  void begin_forward(bool first);
  Tensor before_block(size_t block, const Tensor& x);
  Tensor after_block(size_t block, const Tensor& y);
  void begin_backward();
  void end_backward();
  // Stage 3: every unit gathered (the whole parameters readable and writable) until the matching
  // release_full(write_back); nested calls count. write_back: each rank's chunk of the (changed)
  // parameters goes back into its shard (after loading weights). Stages 1 and 2: nothing.
  void gather_full();
  void release_full(bool write_back = false);
  // Stage 3: the units (block i is unit i, the rest last), and the bytes their parameters and
  // gradient buffers hold now (for tests and logs).
  size_t num_units() const;
  std::vector<std::string> unit_parameter_names(size_t unit) const;
  int64_t unit_numel(size_t unit) const;
  int64_t gathered_bytes() const;
  bool keep_forward() const;

  int stage() const { return stage_; }
  int64_t total_numel() const { return total_; }
  Device device() const { return device_; }  // the parameters' (where the collectives run)
  bool offloads_state() const { return engine_ != nullptr; }
  int64_t shard_numel() const { return shard_numel_; }
  // The shard as flat ranges (offset, length), in shard order: one range in stage 1.
  std::vector<std::pair<int64_t, int64_t>> shard_ranges() const;
  // Stage 2: parameter names per bucket, in reduction order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_layout() const;
  // Stage 2: how the last synced step exchanged each exchange_rows embedding's rows: "gather" or
  // "dense" ("" before the first).
  std::vector<std::string> row_exchange_paths() const;
  ProcessGroup& process_group() { return *pg_; }

 private:
  // A piece of parameter `param` inside this rank's shard.
  struct Segment {
    size_t param;
    int64_t param_offset, shard_offset, length;
    int64_t padded_offset = 0;  // stage 3: in the padded shard (Σ chunks) of parameters and gradient
  };
  struct Reducer;   // stage 2 (zero.cpp)
  struct Gatherer;  // stage 3 (zero3.cpp)
  void build_stage3(const ZeroOptions& zero);
  Tensor stage3_shard_params() const;  // [Σ chunks]: this rank's chunk of every unit
  Tensor stage3_shard_grad();          // the same layout, every reduction completed
  void shutdown_stage3();              // the destructor: the parameters get whole storage back
  void gather_parameters();
  std::vector<Tensor> parameter_tensors() const;
  // Stage 2: reduces, then the averaged gradient's sum of squares over all ranks, [1] f64.
  Tensor shard_sum_squares();
  struct Param {
    std::string name;
    Tensor tensor;
    double weight_decay;
    int64_t offset;  // in the flat vector
  };
  std::vector<Param> params_;
  std::vector<Segment> segments_;
  optim::AdamWOptions options_;
  std::shared_ptr<ProcessGroup> pg_;
  int stage_;
  int64_t total_ = 0, shard_numel_ = 0;
  int64_t chunk_ = 0;            // stage 1: S
  Device device_ = kCPU;         // the parameters' device: shards, state and buffers live there
  Tensor exp_avg_, exp_avg_sq_;  // [shard_numel]; host memory with offload_chunk_elements
  // Offloaded moments (ZeroOptions::offload_chunk_elements): the copies, the two staging buffers
  // of each moment on the device, and the downloads of the last step.
  std::unique_ptr<offload::CopyEngine> engine_;
  Tensor stage_m_[2], stage_v_[2];
  offload::EventPtr pending_out_;  // before the first step: the staging buffers' allocation
  std::shared_ptr<Reducer> reducer_;  // stage 2; its grad hooks hold it weakly
  std::shared_ptr<Gatherer> gatherer_;  // stage 3
};

}  // namespace blu::dist
