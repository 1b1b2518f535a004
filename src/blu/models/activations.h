// models/activations: what a causal LM does with the activations its blocks save for backward —
// keep them, recompute them, or move them to host memory — set per model with
// CausalLM::set_activation_policy and applied by CausalLM::block (docs/offload.md, "Activations").
//   none       every block keeps what its ops save (the plain run).
//   selective  Megatron's selective recompute: each block keeps its GEMM inputs and recomputes the
//              memory-heavy, cheap parts in backward — the attention core (GPT-2: from the fused
//              q|k|v projection to the heads merged back; Llama: RoPE, attention, merge) and the
//              MLP activation (Llama: SwiGLU; GPT-2's GELU is already recomputed by gelu_linear).
//              Model code marks those parts with selective_region().
//   mlp[:N]    the MLP's input side recomputed in backward from the MLP's input (Megatron's "mlp"
//              recompute module) on blocks 0, N, 2N, … (N = 1: every block): Llama's gate/up
//              projection and SwiGLU, GPT-2's c_fc (whose GELU gelu_linear recomputes anyway). Such
//              a block keeps the MLP's input, not the 2·I-wide projection output, for one more GEMM;
//              mlp:N takes a share of that trade, N-fold fewer blocks, where a budget needs only
//              part of it. Model code marks the region with mlp_region().
//   mlp-first:K  the same on blocks 0 … K-1 only (Megatron's recompute-num-layers): any count of
//              blocks, not only L/N. The first blocks are the ones to rebuild: a block's rebuild
//              comes in backward after every later block has let its activations go, so the peak
//              (the start of backward) drops by what each of them leaves out, while a rebuild of
//              the last block would stand in for its own kept bytes at that very peak.
//   block[:N]  whole-block recompute on blocks 0, N, 2N, … (N = 1: every block): such a block's
//              forward keeps only its input and its backward runs the block again first
//              (autograd/checkpoint.h). "selective+block:N" adds selective recompute to the others,
//              "mlp+block:N" the MLP's; the parts join with + in the order selective, mlp, block. A
//              block that block:N recomputes whole is rebuilt whole whatever mlp:N says of it.
//   block-first:K  whole-block recompute on blocks 0 … K-1.
//   offload    (with any of the above) each saved activation of a block goes to host memory as soon
//              as it is saved and comes back ahead of the backward that needs it: the blocks i and
//              i-1 are fetched when block i's backward is about to start (ActivationOffloader).
// activation_bytes() answers, per block, how many activation bytes a policy keeps on the device,
// sends to the host and leaves to be recomputed, at a given B and T in the model's compute dtype,
// by running one block under the device allocator's counters (a formula would have to follow
// every op's save rule).
// Depends on autograd/{checkpoint,saved_hooks,function}, memory/host_transfer, nn/module, ops/.
// Keep: with the same kernels every policy gives bitwise the plain run's losses and gradients
// (random draws included: the model's generators are restored for the rebuild); the hooks and
// scopes are open only inside CausalLM::block, never around the head or the backward.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "blu/autograd/checkpoint.h"
#include "blu/autograd/saved_hooks.h"
#include "blu/memory/host_transfer.h"
#include "blu/nn/module.h"

namespace blu::models {

class CausalLM;

// Which blocks a kind of recompute covers: blocks 0, every, 2·every, … (every > 0), or blocks
// 0 … first-1 (first > 0); none when both are 0.
struct BlockSet {
  int64_t every = 0;
  int64_t first = 0;
  bool has(size_t i) const { return every > 0 ? i % size_t(every) == 0 : first > 0 && i < size_t(first); }
  bool any() const { return every > 0 || first > 0; }
  static BlockSet all() { return {1, 0}; }
  bool operator==(const BlockSet&) const = default;
};

// Note [The warm-up step recomputes every block]
// A compiled run's warm-up step runs eager, with the activations the model's policy keeps whole
// (the compiler's own recompute, --compile-remat, comes with the compiled steps only) but before
// the optimizer has made its moments. When the moments are small beside the activations (bf16
// moments, long sequences) that step, not the compiled ones, sets the run's peak, allocated and
// reserved (its eager allocations fragment the caching allocator's segments). So under
// --compile-remat the trainer and `bench` run the warm-up with every block recomputed whole
// (ActivationPolicy::warmup below), which changes no bit (a recomputed block gives what the saved
// one held), and the compiled steps capture the model's own policy; the memory planner probes the
// warm-up under that policy too (train/memory_probe.cpp, offload::ActivationPlan::warmup_bytes).
// Not without --compile-remat: on an H200, GPT-2 124M (B=16, whole logits, bf16 moments) reserved
// 7,630 MiB with its warm-up recomputing, 6,586 MiB without (its allocated peak was 6,495 both ways).

struct ActivationPolicy {
  BlockSet block;  // whole-block recompute
  BlockSet mlp;    // the MLP's input side recomputed
  bool selective = false;
  bool offload = false;
  // "none", or selective, mlp / mlp:N / mlp-first:K, block / block:N / block-first:K joined by +
  // in that order ("selective+block:2", "mlp-first:9+block:4"; BLU_CHECK otherwise, naming them).
  static ActivationPolicy parse(std::string_view recompute, bool offload_activations = false);
  std::string recompute_name() const;  // as parse takes it
  // The policy of a compiled run's eager warm-up step (Note [The warm-up step recomputes every
  // block]): every block recomputed whole, offload as set.
  ActivationPolicy warmup() const {
    ActivationPolicy w = *this;
    w.block = BlockSet::all();
    w.mlp = {};
    w.selective = false;
    return w;
  }
  bool recompute_block(size_t i) const { return block.has(i); }
  bool recompute_mlp(size_t i) const { return mlp.has(i); }
  bool any() const { return block.any() || selective || mlp.any() || offload; }
  bool operator==(const ActivationPolicy&) const = default;
};

// fn(inputs), as a drop_output recompute region when CausalLM::block runs the block under a
// selective policy (with grad mode on); fn(inputs) plainly otherwise. For the model code's
// attention cores and MLP activations.
Tensor selective_region(const char* name, const RegionFn& fn, const std::vector<Tensor>& inputs);
// The same for the MLP's input side under an mlp policy (a drop_output region named "mlp").
Tensor mlp_region(const RegionFn& fn, const std::vector<Tensor>& inputs);

// RAII, opened by CausalLM::block: selective_region() (when `selective`) and mlp_region() (when
// `mlp`) recompute inside the scope, restoring `generators` (the model's) for the rebuild.
class SelectiveScope {
 public:
  SelectiveScope(std::vector<Generator*> generators, bool selective, bool mlp);
  ~SelectiveScope();
  SelectiveScope(const SelectiveScope&) = delete;
  SelectiveScope& operator=(const SelectiveScope&) = delete;

 private:
  std::vector<Generator*> prev_;
  bool prev_selective_, prev_mlp_;
};

// The host copies of one model's offloaded activations. A tensor saved inside block i (an op's
// output, or an input that is itself an activation: a non-leaf that requires grad and is not a
// parameter's compute copy) is boxed; its storage is copied to the host once however many views
// of it are saved, and the device storage is freed as soon as nothing else holds it. The copies
// come back per block: prefetch(i) starts the copies of block i's storages back to the device,
// and a box's unpack waits for its own (fetching it then if no prefetch did).
class ActivationOffloader {
 public:
  // The pack hook for block i of `block_module` (whose parameters and compute copies stay put).
  PackHook hook(size_t block, const nn::Module& block_module);
  void prefetch(size_t block);
  // Bytes copied to the host since construction, and how many storages.
  int64_t bytes_offloaded() const { return bytes_; }
  int64_t storages_offloaded() const { return count_; }

 private:
  struct Entry;
  std::shared_ptr<Entry> entry_for(const Tensor& t, size_t block);
  std::unordered_map<const Storage*, std::weak_ptr<Entry>> by_storage_;
  std::vector<std::vector<std::weak_ptr<Entry>>> by_block_;
  int64_t bytes_ = 0, count_ = 0;
};

// Per block (of model.num_blocks()): activation bytes under `policy` at [B, T] in the model's
// compute dtype. kept: held on the device by the block's graph after its forward — its input
// included when the graph keeps it, its output not (the next block's input, or the head's);
// offloaded: sent to host memory; recomputed: what the plain run keeps beyond those two, rebuilt in
// backward. Measured by running block `probe_block` (the blocks are alike; a pipeline stage
// measures one of its own) on the model's device, grad mode on and the training flag as it is, on
// a random input; the model's policy and generators are left as they were. The step's activations after the forward are these summed over the blocks
// plus the embedding's and the head's, which no policy changes.
struct ActivationBytes {
  int64_t kept = 0, offloaded = 0, recomputed = 0;
};
std::vector<ActivationBytes> activation_bytes(CausalLM& model, int64_t B, int64_t T, const ActivationPolicy& policy,
                                              size_t probe_block = 0);

// The whole model's activations under `policy` at [B, T], in the terms of the memory planner
// (offload/plan.h's ActivationPlan): how many blocks keep, offload and recompute (a block with
// selective or mlp recompute counts as recomputed), what selective and mlp recompute (regions), and bytes. device_bytes:
// the blocks' kept bytes plus the most that one block's backward brings back — its recomputed
// bytes, and with offload its own and the prefetched previous block's offloaded bytes;
// host_bytes: all offloaded bytes. The embedding's and the head's activations are not included.
// `blocks`: only these (a pipeline stage's, ascending; empty: every block).
struct ActivationTotals {
  int64_t blocks = 0, kept_blocks = 0, offloaded_blocks = 0, recomputed_blocks = 0;
  std::string regions;  // what selective and mlp recompute: "", "attention core, MLP activation", …
  int64_t device_bytes = 0, host_bytes = 0;
};
ActivationTotals activation_totals(CausalLM& model, int64_t B, int64_t T, const ActivationPolicy& policy,
                                   const std::vector<int64_t>& blocks = {});

}  // namespace blu::models
