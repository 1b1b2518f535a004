// dist/tensor_parallel: tensor parallelism (Whale's `split`, Megatron-LM's layout) and sequence
// parallelism over one process group, the TP group (Gloo on CPUs, NCCL on GPUs).
//   The rewrite: apply_tensor_parallel(model, tp, options) takes the split the model declares
//     (CausalLM::tensor_parallel_plan, models/causal_lm.h) and replaces each named submodule by its
//     sharded version, holding this rank's slice of the full weights (identical on every rank):
//     attention's q/k/v (GPT-2's fused c_attn, Llama's q/k/v_proj with their kv heads) and the
//     MLP's first linears column-parallel, the output projections row-parallel, the token
//     embedding vocabulary-parallel (each rank owns a row range of the padded vocabulary; a tied
//     head uses the same shard, an untied one is split alike), and the loss the
//     vocabulary-parallel cross-entropy, which never gathers the logits.
//   The collectives inside autograd (autograd/function.h): Megatron's f (copy_to_tp: identity
//     forward, all-reduce backward) and g (reduce_from_tp: all-reduce forward, identity backward);
//     for sequence parallelism gather_sequence (all-gather along the sequence forward,
//     reduce-scatter backward), reduce_scatter_sequence (the reverse) and split_sequence (this
//     rank's sequence chunk forward, all-gather backward). With sequence parallelism on, the norms,
//     dropout and residual adds between the parallel regions run on a sequence shard [B, T/tp, C]:
//     column-parallel inputs are all-gathered, row-parallel outputs reduce-scattered.
//   The inverse, for checkpoints and tests: every parameter's place in the full tensor
//     (shard_info: dim, segments, offset and length, the full shape), and gather_full_state, the
//     full (unsharded) state dict assembled on every rank.
// Overlap: a column-parallel linear's input-gradient collective (f's all-reduce, or gather's
//   reduce-scatter under SP) starts inside the linear's backward as soon as the input gradient
//   exists and runs beside the weight-gradient GEMM (Note [Early input gradients],
//   ops/early_grad.h); the f / gather node then only waits for it. Column linears fed the same
//   tensor (Llama's q/k/v and gate/up projections) share one f / gather: one collective over their
//   summed input gradients instead of one each (not started early: the sum exists only after the
//   last of them). A row-parallel linear's forward collective feeds the next op, so it is waited
//   for where it is issued — unless TPOptions::row_chunks cuts the GEMM into row pieces, each
//   piece's collective then running beside the next piece's GEMM. BLU_TP_OVERLAP=0 in the
//   environment turns all of it off (every column linear its own f / gather, one GEMM and one
//   collective per row linear), for measuring what they save.
// Depends on dist/process_group, autograd/function, models/causal_lm (the interface only: dist/
// knows no model type), nn/. Keep: every rank of the group applies the same rewrite and runs the
// same forward and backward (the collectives pair up by order); the single-device model is
// untouched by this file's existence (nothing changes until apply_tensor_parallel); sharded
// parameters' full tensors are recoverable exactly from shard_info.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/models/causal_lm.h"
#include "blu/nn/layers.h"
#include "blu/nn/norms.h"

namespace blu::dist {

struct TPOptions {
  bool sequence_parallel = false;  // norms and dropout on sequence shards (T must divide by tp)
  // Each rank's share of every split (empty: equal shares; otherwise one positive weight per rank,
  // summing to 1). Each split's units — heads, MLP columns, vocabulary rows — are apportioned by
  // largest remainder, in the spec's groups (ShardSpec::group), at least one group per rank.
  std::vector<double> widths{};
  // The row-parallel linears' forward in this many row pieces, each piece's collective started as
  // soon as its GEMM is queued and run beside the next piece's GEMM (Note [Row chunks],
  // tensor_parallel.cpp); 1: one GEMM and one collective, waited for where it is issued. Under
  // sequence parallelism the pieces are batch rows (at most B of them).
  int64_t row_chunks = 1;
};

// Units per rank of `units` in groups of `group` under `widths` (largest remainder, ties to the
// lower rank; at least one group each). BLU_CHECK when units do not divide into groups or there
// are fewer groups than ranks.
std::vector<int64_t> apportion_units(int64_t units, int64_t group, const std::vector<double>& widths);

// A parameter's place in its full tensor. dim -1: replicated (every rank holds the full tensor).
// Otherwise the full tensor's dim `dim` is `parts` equal segments (GPT-2's fused q|k|v: 3), and in
// each this rank holds rows [offset, offset + length); the local tensor is those pieces
// concatenated along dim, in segment order.
struct ShardInfo {
  int64_t dim = -1;
  int64_t parts = 1;
  int64_t offset = 0, length = 0;  // within each segment
  Shape full_shape;
  // Replicated, but each rank's gradient covers its sequence shard only (sequence parallelism:
  // norms, row-parallel biases): the gradient is the sum over the TP group.
  bool partial_grad = false;
  bool sharded() const { return dim >= 0; }
  // The pieces this rank holds along dim, as (start, length) in the full tensor, one per segment
  // in the order the local tensor holds them (a checkpoint's boxes); empty when replicated (the
  // whole tensor).
  std::vector<std::pair<int64_t, int64_t>> ranges() const {
    if (!sharded()) return {};
    std::vector<std::pair<int64_t, int64_t>> out;
    const int64_t seg = full_shape[size_t(dim)] / parts;
    for (int64_t p = 0; p < parts; ++p) out.emplace_back(p * seg + offset, length);
    return out;
  }
};

// This rank's piece of `full` under `info` (a copy, contiguous); `full` itself when replicated.
Tensor shard_of_full(const Tensor& full, const ShardInfo& info);

// A module whose parameters are shards (or replicated with partial gradients).
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  virtual ShardInfo shard_of(const Tensor& param) const = 0;
};

// A sharded nn::Linear. column: weight rows (and bias) split, the input passed through f (or
// all-gathered along the sequence); row: weight columns split, the GEMM's partial output summed by
// g (or reduce-scattered along the sequence) before the replicated bias; head: weight rows split,
// the input already prepared by the model's enter_head step (a plain linear over the shard).
// The column input a model's column-parallel linears last made (f or gather over the tensor they
// were fed), so that the next column linear fed the same tensor reuses it; a row-parallel linear's
// forward clears it. One per model, shared by its ParallelLinears; forwards of one model run on one
// thread.
struct ColumnInputs;

// What the column inputs did in this process so far: input-gradient collectives started early
// (inside the linear's backward) and column linears that reused another's input.
struct ColumnInputStats {
  int64_t early = 0, shared = 0;
};
ColumnInputStats column_input_stats();
// Row-parallel forward collectives issued per row piece in this process so far (row_chunks > 1).
int64_t row_chunk_collectives();

class ParallelLinear : public nn::Linear, public ShardedModule {
 public:
  enum class Kind { column, row, head };
  // `counts`: the split units each rank holds (apportion_units; empty: equal shares). `inputs`:
  // the model's shared column inputs (null: this linear shares with none).
  ParallelLinear(const nn::Linear& full, Kind kind, std::shared_ptr<ProcessGroup> tp, bool sequence_parallel,
                 int64_t parts = 1, std::vector<int64_t> counts = {}, std::shared_ptr<ColumnInputs> inputs = nullptr);
  Tensor forward(const Tensor& x) const override;
  Tensor forward(const Tensor& x, const Tensor& residual) const override;
  bool fusable() const override { return kind == Kind::head; }
  ShardInfo shard_of(const Tensor& param) const override;
  const Kind kind;

 private:
  std::shared_ptr<ProcessGroup> tp_;
  bool sp_;
  std::shared_ptr<ColumnInputs> inputs_;
  ShardInfo weight_info_, bias_info_;
};

// Rows [offset, offset + rows) of the (padded) vocabulary: ids outside give zero rows, then the
// output is all-reduced over the group (g).
class VocabParallelEmbedding : public nn::Embedding, public ShardedModule {
 public:
  VocabParallelEmbedding(const nn::Embedding& full, std::shared_ptr<ProcessGroup> tp, std::vector<int64_t> counts = {});
  Tensor forward(const Tensor& idx) const override;
  ShardInfo shard_of(const Tensor& param) const override;
  int64_t offset() const { return info_.offset; }

 private:
  std::shared_ptr<ProcessGroup> tp_;
  ShardInfo info_;
};

// A norm of the model run on sequence shards: its parameters' gradients are partial.
class SequenceParallelLayerNorm : public nn::LayerNorm, public ShardedModule {
 public:
  explicit SequenceParallelLayerNorm(const nn::LayerNorm& full);
  ShardInfo shard_of(const Tensor& param) const override;
};
class SequenceParallelRMSNorm : public nn::RMSNorm, public ShardedModule {
 public:
  explicit SequenceParallelRMSNorm(const nn::RMSNorm& full);
  ShardInfo shard_of(const Tensor& param) const override;
};

// Rewrites `model` (on its device, the same full weights on every rank of `tp`) into this rank's
// tensor-parallel shard. BLU_CHECK (before anything changes) when the model declares no plan, a
// planned module is missing or of another type, or the TP size does not divide a split's units
// (heads, kv heads, MLP width, the vocabulary) — the message names the numbers — or a rank would
// hold no real vocabulary row. Sets model.sharded (models/causal_lm.h). tp of one rank: the same
// arithmetic as the plain model up to the order of sums.
void apply_tensor_parallel(models::CausalLM& model, std::shared_ptr<ProcessGroup> tp, TPOptions options = {});

// Megatron's f and g, and the sequence-parallel collectives (see the header comment). Sequence
// functions act on dim 1 of [B, T, …]; gather_sequence's output has T·size positions. `tp` must
// outlive the graph (the backward calls it).
Tensor copy_to_tp(const Tensor& x, ProcessGroup& tp);
Tensor reduce_from_tp(const Tensor& x, ProcessGroup& tp);
Tensor gather_sequence(const Tensor& x, ProcessGroup& tp);
Tensor reduce_scatter_sequence(const Tensor& x, ProcessGroup& tp);
Tensor split_sequence(const Tensor& x, ProcessGroup& tp);

// The mean cross-entropy of this rank's logits [N, Vl] (columns [offset, offset + Vl) of the full
// vocabulary; offset -1: rank·Vl, the equal split's) against targets [N] (-1 ignored) over the first `vocab` full columns, never
// gathering the logits: one pass of the fused kernel over the rank's columns gives their
// logsumexp and, on the rank that owns it, the target's logit (ops/nn.h, cross_entropy_shard);
// the largest logsumexp is all-reduced (max), then the rescaled sums and the target's logit in one
// all-reduce (sum). The backward is local (softmax minus one-hot on this rank's columns), written
// over the logits when nothing else holds them. The same 0-d value (f32; f64 for f64 logits) on
// every rank.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets, int64_t vocab, ProcessGroup& tp,
                                    int64_t offset = -1);

struct ShardedParameter {
  std::string name;
  Tensor param;
  ShardInfo info;
};
// Every parameter of `model` (registration order) with its place in the full tensor (replicated
// ones: dim -1, full_shape their own).
std::vector<ShardedParameter> sharded_parameters(nn::Module& model);
// Whether apply_tensor_parallel has rewritten `model` (it holds a sharded module).
bool is_tensor_parallel(nn::Module& model);
// One parameter's place; BLU_CHECK when `param` is not a parameter of `model`.
ShardInfo shard_info(nn::Module& model, const Tensor& param);
// The full parameters by name (each in its own dtype, on its device), every sharded one
// all-gathered over `tp` and put back in order; collective: every rank calls it.
nn::NamedTensors gather_full_state(nn::Module& model, ProcessGroup& tp);

}  // namespace blu::dist
