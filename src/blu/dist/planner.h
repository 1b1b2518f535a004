// dist/planner: the cost model of a parallel layout and the search behind `--parallel auto`.
//   measure_model: a short probe of the model on this device — one block's forward + backward time
//     at two micro-batch sizes (a fixed cost per call plus a cost per sequence, so small models,
//     whose time is mostly per-op overhead, are predicted as well as large ones), the same for what
//     lies outside the blocks (embedding, head, loss), the optimizer's time per parameter, and the
//     bytes each part keeps for backward, read from the allocator;
//   measure_split: the same probe of one rank's share of split(tp), on a copy of the model split
//     over a stand-in group whose collectives move no data;
//   measure_link: latency and bandwidth of a process group's all-reduce at two sizes;
//   predict: a layout's step time — compute of the slowest stage per micro-batch, tensor-parallel
//     all-reduces per block, point-to-point sends between stages, the pipeline bubble of its
//     schedule, the data-parallel gradient exchange (and ZeRO's gathers), the update — and its
//     memory per rank (parameters, gradients and optimizer state as sharded, activations for the
//     micro-batches its schedule keeps in flight);
//   plan: every layout of the world size that resolves for the model, ranked by predicted step
//     time among those that fit the memory budget.
// The model is linear in the measured quantities and says what it leaves out (docs/distributed.md:
// "Planner"); how far it is off is measured, not assumed: `bench --parallel auto` prints the
// prediction and, after the steps, the measured values and the error.
// Depends on dist/annotations, dist/process_group, models/causal_lm. Keep: predict is a pure
// function of its inputs (tests and the docs' table rely on it).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "blu/dist/annotations.h"
#include "blu/dist/process_group.h"
#include "blu/models/causal_lm.h"

namespace blu::dist {

struct ModelCosts {
  int64_t blocks = 0, seq_len = 0, width = 0;
  double block_params = 0;  // parameters per block (the mean)
  double other_params = 0;  // outside the blocks (embeddings, final norm, head)
  double first_params = 0, last_params = 0;  // of those, on a pipeline's first and last stage
  // A weight tied between the embedding and the head (GPT-2's wte): a pipeline's first and last
  // stage each receive the other's part of its gradient at the end of the step, one more
  // gradient's bytes once the activations are gone (dist/pipeline.h).
  double tied_params = 0;
  double largest_param = 0;  // elements of the largest parameter (ZeRO-2 reduces it from its own gradient)
  // Forward + backward seconds for a micro-batch of b sequences: fixed + per_seq · b.
  double block_fixed_s = 0, block_per_seq_s = 0;  // one block
  double other_fixed_s = 0, other_per_seq_s = 0;  // embedding, head and loss
  double embed_fixed_s = 0, embed_per_seq_s = 0;  // of those, the embedding (a pipeline's first stage)
  double update_per_param_s = 0;  // the optimizer step (with clipping), per parameter (two sizes' slope)
  // Bytes kept for backward: per sequence, and per micro-batch whatever its size (tensors a forward
  // makes from the weights alone: without compute copies, the concatenated sibling weights of Note
  // [Sibling linears]).
  double block_act_bytes = 0, other_act_bytes = 0;
  double block_act_fixed_bytes = 0, other_act_fixed_bytes = 0;
  // Bytes per parameter of the training state: the parameter, its gradient, AdamW's two moments
  // (and under mixed precision the 16-bit compute copies, averaged over all parameters: those the
  // probe found kept).
  double param_bytes = 4, grad_bytes = 4, optim_bytes = 8, compute_copy_bytes = 0;
  double activation_elem_bytes = 4;  // an activation element (TP all-reduces, pipeline sends)
  // One rank's part of split(tp[, sp]) where measure_split probed it: its compute (the sharded
  // matrices and attention heads, what every rank repeats — norms, residuals, biases — and the
  // vocabulary-parallel embedding and loss) and the bytes it keeps. Without an entry, predict
  // divides the whole model's costs by tp.
  struct Split {
    int tp = 1;
    bool sequence_parallel = false;
    double block_fixed_s = 0, block_per_seq_s = 0, other_fixed_s = 0, other_per_seq_s = 0;
    double embed_fixed_s = 0, embed_per_seq_s = 0;
    double block_act_bytes = 0, other_act_bytes = 0;
    double block_act_fixed_bytes = 0, other_act_fixed_bytes = 0;
    double partial_grad_bytes = 0;  // replicated parameters with partial gradients (sequence parallel)
    // Per block and forward + backward: input-gradient collectives started inside a column
    // linear's backward (Note [Early input gradients], ops/early_grad.h), counted in the probe.
    double early_per_block = 0;
  };
  std::vector<Split> splits;
};

struct LinkCosts {
  double latency_s = 0;      // per collective step
  double bytes_per_s = 1e9;  // per direction, per rank
  // Whether a collective runs beside compute without taking its time (GPUs: the link and the
  // communication stream; not CPU ranks, whose Gloo threads share the cores with the compute).
  bool overlaps_compute = false;
};

struct PlanJob {
  int world = 1;
  int64_t batch = 1;        // sequences per optimizer step, over all replicas
  int64_t grad_accum = 1;   // micro-batches per replica when not pipelined
  double memory_budget = 0; // bytes per rank (0: no limit)
  // Each rank's relative speed (dist::speeds_from_times of a probe of the whole model on every
  // rank; row-major dp × pp × tp), whose slowest rank the ModelCosts describe; empty: all alike.
  // A replica runs at its slowest rank's pace, a split rank at its share of the work over its
  // speed. Where the fastest replica is at least kUnequalSpeeds times the slowest, plan() adds each
  // layout with replicas weighted by their speeds; where the fastest tensor-parallel position (rank
  // % tp, its slowest rank over the replicas and stages) is, each split with widths by their speeds.
  std::vector<double> rank_speeds;
};
// Below this ratio of replica speeds the replicas stay even: a probe's spread on shared CPU cores
// is noise (two ranks beside other work measured 1.25× apart), and a smaller difference gains
// little (at 1.5× the weighted compute is 0.8× the even one).
inline constexpr double kUnequalSpeeds = 1.5;

struct Prediction {
  Layout layout;
  std::string text;  // the layout's annotation
  double step_s = 0, compute_s = 0, tp_comm_s = 0, pp_comm_s = 0, bubble_s = 0, dp_comm_s = 0, update_s = 0;
  double memory_bytes = 0;      // the most loaded rank
  std::vector<double> stage_memory_bytes;  // each pipeline rank's (one entry without a pipeline)
  double state_bytes = 0, activation_bytes = 0;
  bool fits = true;
  std::string describe() const;  // "step 0.412 s (compute 0.301, bubble 0.05, …), 1.9 GiB per rank"
};

// Probes `model` (on its device, in its compute dtype) at micro-batch sizes b and 2b of length T,
// `reps` timed repetitions each after a warm-up; leaves the model's gradients cleared. With
// `lockstep`, its every rank probes at once and starts each repetition together (a barrier): ranks
// that share a machine's cores are measured sharing them, as they will train. Collective then.
ModelCosts measure_model(models::CausalLM& model, int64_t b, int64_t T, int reps = 3, ProcessGroup* lockstep = nullptr);
// Adds split(tp[, sp])'s costs to m (measure_model's, same T): `copy` — a fresh model of the same
// configuration on the same device, which this call rewrites — is split by apply_tensor_parallel
// over a stand-in group of tp ranks seen from rank 0, whose collectives move nothing, and its
// forward + backward probed at b and 2b as measure_model probes the whole model. The collectives'
// time is predict's, from LinkCosts.
void measure_split(ModelCosts& m, models::CausalLM& copy, int tp, bool sequence_parallel, int64_t b, int reps = 3,
                   ProcessGroup* lockstep = nullptr);
// Every rank's probed times replaced by the slowest rank's (collective over pg, whose tensors live
// on `device`; the bytes are the same everywhere): an even layout runs at its slowest rank's pace.
void take_slowest(ModelCosts& m, ProcessGroup& pg, Device device);
// All-reduces of 4 KiB and 4 MiB (64 MiB on a GPU) (f32, on `device`: the group's) on `pg`, `reps` each: latency
// and bandwidth of a ring through the mean time of each size. Collective: every rank of pg calls it.
LinkCosts measure_link(ProcessGroup& pg, Device device, int reps = 21);

Prediction predict(const Layout& layout, const ModelCosts& m, const LinkCosts& link, const PlanJob& job);

// The annotation text of a layout (what `--parallel` takes).
std::string layout_text(const Layout& layout, const std::vector<std::string>& block_names);

// Every layout of job.world ranks that the model admits (dp × pp × tp, ZeRO 0–3, each schedule, a
// few micro-batch counts; with unequal job.rank_speeds each one with replicas also with weights
// in proportion to its replicas' speeds, and each split also with widths in proportion to its
// positions' speeds), predicted and sorted: fitting ones by step time first, then the rest.
std::vector<Prediction> plan(const ModelCosts& m, const LinkCosts& link, const PlanJob& job,
                             const std::vector<std::string>& block_names, int64_t heads, int64_t kv_heads,
                             int64_t vocab);

}  // namespace blu::dist
