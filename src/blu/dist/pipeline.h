// dist/pipeline: pipeline parallelism over a causal LM's blocks — this rank's stage of the model
// (models::CausalLM's embed / block / head parts), the execution of a checked schedule
// (dist/pipeline_schedule.h) with point-to-point sends of activations and gradients over the
// pipeline's process group, and the pieces of a training step that differ from the plain one: the
// tied embedding's gradient summed between the first and the last stage, the global gradient norm
// from every stage's sum of squares, the loss on the last stage, checkpoints by global name.
//   Ownership: rank r owns the blocks of its virtual stages (chunk·stages + r), the embedding's
//     parameters when it holds virtual stage 0 and the head's when it holds the last one (found
//     once at construction by running embed and head on one token: whatever gets a gradient). A
//     tied embedding/head weight is owned by both ends; its gradient is exchanged by send/recv and
//     summed in one order (first stage's part + last stage's part) on both, so the copies stay
//     bit-identical through every update. The optimizer sees only the owned parameters.
//   Execution (PipelineExecution): `scheduled` runs each rank's list in order, blocking on each
//     receive; `message_driven` (Myelin, AxoNN) keeps the next forward receive and the next
//     backward receive posted and runs whichever arrives first, a backward first when both have,
//     within the schedule's in-flight bound. Forwards still run in the list's forward order and
//     backwards in its backward order, so results are the same bits whatever the timing.
// Depends on dist/process_group, dist/pipeline_schedule, models/causal_lm (the interface only),
// optim/, io/safetensors. Keep: every rank of the pipeline group calls step() with the same
// micro-batch count (it holds point-to-point traffic and one all-reduce); a lost peer is an error
// naming it within the group's timeout; nothing silently changes a requested split or schedule.
#pragma once
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "blu/dist/pipeline_schedule.h"
#include "blu/dist/process_group.h"
#include "blu/io/checkpoint.h"
#include "blu/models/causal_lm.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"

namespace blu::dist {

enum class PipelineExecution { scheduled, message_driven };

// Micro-batch i's token ids and targets, both [B, T] (every micro-batch of a step the same shape).
// A pure function of i within a step: a stage may ask for the same micro-batch more than once.
using BatchFn = std::function<std::pair<Tensor, Tensor>(int64_t)>;

struct PipelineOptions {
  PipelineScheduleKind schedule = PipelineScheduleKind::one_f_one_b;
  int chunks = 1;                // model chunks per rank (interleaved: ≥ 2)
  int64_t micro_batches = 1;
  std::vector<int64_t> layers;   // blocks per virtual stage (empty: an even split)
  PipelineExecution execution = PipelineExecution::message_driven;
  // A replacement for the generated schedule (tests: a hand-made one); checked like the others.
  std::shared_ptr<const PipelineSchedule> schedule_override;
  // Called before each action on this rank (tests: an injected delay).
  std::function<void(const PipelineAction&)> before_action;
  // Tensor parallelism inside the stages (pp × tp; the model already rewritten by
  // apply_tensor_parallel over this group): the gradient norm counts each shard once — the
  // sharded parameters' squares summed over the group, the replicated ones' taken once. Sequence
  // parallelism is not supported inside a pipeline (the stages send [B, T, C] activations).
  std::shared_ptr<ProcessGroup> tp;
  // The group the gradients travel on, up the pipeline (null: the stages' own group, which always
  // carries the activations down). NCCL runs a communicator's operations in enqueue order on one
  // stream, so on one communicator a receive posted ahead (the next backward's gradient) holds up
  // the sends queued behind it while the peer's matching send waits behind its own early receive:
  // a deadlock. With each direction on its own communicator, every stream's order is the
  // micro-batch order on both ends of it. Gloo's tagged sends need no second group.
  std::shared_ptr<ProcessGroup> gradients;
  // Called once the stage's gradients are complete (the tied weight's parts summed), before the
  // norm: the data-parallel average over replicas of the pipeline (dp × pp).
  std::function<void()> reduce_gradients;
};

// What one step of a stage gives back, on the device.
struct PipelineStepValues {
  Tensor loss_sum;  // 0-d f64: the sum of the micro-batches' losses (zero except on the last stage)
  NormGate gate;    // the global gradient norm's square (every stage's part, all-reduced)
};

// The global names of the parameters rank `rank` trains under `layout` (its blocks, the
// embedding's on the first stage, the head's on the last) — what PipelineStage owns. Runs one
// token's embed / head (eval mode, no dropout draw) on whichever device the model is.
std::set<std::string> stage_parameter_names(models::CausalLM& model, const StageLayout& layout, int rank);
// Moves the model (on another device) to `device` with only `owned`'s parameters' bytes (and any
// storage one of them shares): the others arrive byte-less, as PipelineStage leaves them, so a
// stage never holds the whole model. Returns the parameter bytes moved.
int64_t place_stage_parameters(models::CausalLM& model, const std::set<std::string>& owned, Device device);

class PipelineStage {
 public:
  // `pg`: the pipeline dimension's group (rank r runs stage r). The whole model is built on every
  // rank; only the owned parameters are trained, and the others give their bytes back here (their
  // shapes, dtypes and devices stay; share_parameters() fills them again for a while), unless they
  // never had them (place_stage_parameters). Builds and checks the schedule (BLU_CHECK).
  PipelineStage(models::CausalLM& model, std::shared_ptr<ProcessGroup> pg, PipelineOptions options);
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  int rank() const { return rank_; }
  int stages() const { return layout_.stages; }
  const StageLayout& layout() const { return layout_; }
  const PipelineSchedule& schedule() const { return schedule_; }
  const PipelineOptions& options() const { return options_; }
  // The parameters this rank trains, with their global names, in the model's order.
  const nn::NamedTensors& owned_parameters() const { return owned_; }
  // Blocks this rank runs, ascending.
  std::vector<int64_t> owned_blocks() const;
  bool owns_first() const { return rank_ == 0; }
  bool owns_last() const { return layout_.rank_of(layout_.virtual_stages() - 1) == rank_; }
  std::string describe() const;  // "pipeline 1f1b, 2 stages × 1 chunk, 4 micro-batches, blocks [2,2]"

  // The forward and backward of every micro-batch (loss / micro_batches on the last stage), then
  // the tied gradient's exchange and the gradient norm (all-reduced). Gradients accumulate into the
  // owned parameters' .grad (the caller zeroes them before and updates after).
  PipelineStepValues forward_backward(int64_t micro_batches, const BatchFn& batch_of, double max_norm);
  // The actions this rank ran in the last forward_backward, in the order it ran them.
  const std::vector<PipelineAction>& last_order() const { return order_; }

  // Checkpoints: <dir>/ckpt_<step>/stage_<r>_of_<p>.safetensors holds this rank's parameters
  // ("model.<global name>") and optimizer state ("optim.<name>"), COMMIT written by rank 0 once all
  // are on disk (collective). load reads every stage file of the checkpoint and takes the names it
  // owns, so a checkpoint loads under another split or stage count. Both check before they change
  // anything.
  std::string save(const std::string& dir, const optim::Optimizer& opt, const TrainState& st, int keep_last);
  TrainState load(const std::string& ckpt_dir, optim::Optimizer& opt, const nlohmann::json& expected_model_config);
  // The newest committed checkpoint (by step number) that verifies; each newer one that does not is
  // passed to `warn` and skipped.
  static std::string latest_checkpoint(const std::string& dir, const CheckpointWarning& warn = {});
  // COMMIT (written atomically, format version 2: every stage file's size and xxHash checksum)
  // and the files it names; BLU_CHECK naming the file, expected and got.
  static void verify_checkpoint(const std::string& ckpt_dir);
  static constexpr int kPipelineFormatVersion = 2;
  // Every parameter of the model made current on every rank until release_parameters(): the ones
  // this rank does not train get bytes again and each parameter is broadcast from a rank that
  // trains it (evaluation and sampling run the whole model). Collective over the pipeline group;
  // nested calls count, and only the outermost pair moves data.
  void share_parameters();
  void release_parameters();
  // Bytes the model's parameters hold on this rank now (each storage once): the owned ones alone
  // outside share_parameters().
  int64_t resident_parameter_bytes() const;

 private:
  struct InFlight;
  class Mailbox;
  void run_forward(const PipelineAction& a, int64_t n, const BatchFn& batch_of, Mailbox& box);
  void run_backward(const PipelineAction& a, int64_t n, Mailbox& box);
  void sync_tied();

  models::CausalLM& model_;
  std::shared_ptr<ProcessGroup> pg_;
  PipelineOptions options_;
  int rank_ = 0;
  StageLayout layout_;
  PipelineSchedule schedule_;
  int64_t send_slots_ = 0;
  nn::NamedTensors owned_;
  std::vector<bool> owned_sharded_;  // per owned parameter: a tensor-parallel shard (options_.tp)
  Tensor tied_;  // the tied embedding/head weight when the first and last stage are different ranks
  std::vector<PipelineAction> order_;
  std::vector<std::unique_ptr<InFlight>> in_flight_;  // indexed by chunk · micro_batches + micro
  Tensor loss_sum_;
  std::vector<int> owners_;  // per model parameter, a rank that trains it (share_parameters)
  struct Unowned {
    std::shared_ptr<Storage> storage;
    size_t bytes;
  };
  std::vector<Unowned> unowned_;  // the storages of the parameters this rank does not train
  int shared_ = 0;                // share_parameters() depth
  void drop_unowned();
};

}  // namespace blu::dist
