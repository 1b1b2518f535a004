// train/memory_probe: Trainer::plan_memory — the start-up probe of the memory budget planner
// (offload/plan.h) and the strategy settings it decides.
#include <algorithm>
#include <chrono>
#include <optional>
#include <set>

#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/core/exec_context.h"
#include "blu/core/rng.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/dist/zero.h"
#include "blu/memory/allocator.h"
#include "blu/memory/device_pool.h"
#include "blu/nn/layers.h"
#include "blu/offload/plan.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/train/layout_setup.h"
#include "blu/train/trainer.h"

namespace blu::train {

// The probe: a micro-batch's forward and backward on the device — two with gradient accumulation,
// the second beside the first's accumulated gradients, as every later micro-batch of a step runs —
// its transient bytes (saved activations, the scratch workspace and the gradients) read from the
// allocator's peak, with the workspace an earlier probe left counted again; the default generator
// is restored and the gradients dropped, so training after it is what it would have been. A
// pipeline stage runs a whole step of its schedule instead (every stage at
// once), which holds the micro-batches its schedule keeps in flight.
// --recompute auto: the least recompute whose plan fits, the optimizer state on the device first.
// The settings in the order of what they cost a step: none, the MLP recomputed on the first K of
// the L blocks for K = ⌈L/4⌉, ⌈L/2⌉, ⌈3L/4⌉ and L-1 (each below L; the first K that fits is then
// halved down to the least that fits), selective, block:4, selective+block:4, mlp, block:2,
// selective+block:2, selective+mlp, block (on an H200, llama-250m compiled: selective 7%, block:2
// 10%, selective+block:2 13%, block 18%; mlp, one GEMM a block, ran 6.5% faster than
// selective+block:2 in 62 MiB less, and each block's MLP costs ~0.45% of the step;
// docs/performance.md). The first blocks are the ones to rebuild (models/activations.h: mlp-first).
// Recompute costs a share of a forward; moving the state to the host costs its transfers or a host
// update (docs/offload.md), more at every batch size measured, so every recompute setting is tried
// with the state on the device before the user's --offload-state choice is let in (never under
// --compile, which keeps the state on the device). After whole-block recompute, with each state,
// comes the same with the activations it keeps (its blocks' inputs) offloaded: on an H200 that
// cost GPT-2 124M 1.7% of the step (docs/offload.md), less than any state offload. With
// --offload-activations given, every candidate offloads what it keeps. Each candidate is probed
// (the activation bytes are measured, not modelled); the model keeps the policy chosen.
// With --loss-chunks left unset (0) and the loss not split by tensor parallelism, each setting is
// followed by the same with the head's loss in row pieces, 4 then 8 (kAutoLossChunks; Note
// [Chunked loss], ops/fused.h): on an H200 they took 1.2-1.3 GiB off GPT-2 124M's peak for 1.2%
// and 3.7% of the step, less than `selective` costs (4-7%), and never a GEMM. The pieces change the
// w-gradient's sums by fp32 rounding, so the choice is written back into the options (run.json: a
// resume takes it, and a run that kept the logits whole records 1, which the planner leaves alone).
offload::MemoryPlan Trainer::plan_with_recompute(offload::PlanInput& in, const std::function<void()>& probe,
                                                 const std::function<bool(bool)>& all_fit) {
  const TrainOptions& o = opt_s_;
  struct Candidate {
    std::string recompute;
    bool offload_activations;
    std::string state;
    int64_t loss_chunks;
  };
  // Decided by the planner only when the user left it unset; the model refuses pieces under tensor
  // parallelism. Every rank that must agree sees the same options and layout, so the same list.
  const bool try_pieces = o.loss_chunks == 0 && !dist::is_tensor_parallel(*model_);
  std::vector<std::string> states = {"none"};
  if (!o.compile && o.offload_state != "none") states.push_back(o.offload_state);
  std::vector<Candidate> candidates;
  const auto add = [&](const std::string& r, bool offload_activations, const std::string& state) {
    candidates.push_back({r, offload_activations, state, o.loss_chunks});
    if (try_pieces)
      for (const int64_t n : kAutoLossChunks) candidates.push_back({r, offload_activations, state, n});
  };
  const int64_t L = int64_t(model_->num_blocks());
  std::vector<int64_t> ladder;  // the mlp-first block counts probed in turn
  for (const int64_t K : {(L + 3) / 4, (L + 1) / 2, (3 * L + 3) / 4, L - 1})
    if (K >= 1 && K < L && (ladder.empty() || ladder.back() != K)) ladder.push_back(K);
  const auto mlp_first = [](int64_t K) { return "mlp-first:" + std::to_string(K); };
  for (const std::string& state : states) {
    std::vector<std::string> settings = {"none"};
    for (const int64_t K : ladder) settings.push_back(mlp_first(K));
    for (const char* r : {"selective", "block:4", "selective+block:4", "mlp", "block:2", "selective+block:2",
                          "selective+mlp", "block"})
      settings.push_back(r);
    for (const std::string& r : settings) add(r, o.offload_activations, state);
    if (!o.offload_activations && !o.compile) add("block", true, state);  // the compiler does not capture activation offload
  }
  // One candidate probed and planned: its plan when it fits (on every rank that must agree), else
  // what it needs, for the error's list.
  const auto attempt = [&](const Candidate& c, std::string& why_not) -> std::optional<offload::MemoryPlan> {
    model_->set_activation_policy(models::ActivationPolicy::parse(c.recompute, c.offload_activations));
    model_->set_loss_chunks(c.loss_chunks);
    probe();
    in.offload_state = c.state;
    std::optional<offload::MemoryPlan> plan;
    std::string why;
    try {
      plan = offload::plan_memory(in);
    } catch (const Error& e) {
      why = e.what();
    }
    if (all_fit(plan.has_value())) return plan;
    const size_t at = why.rfind("the smallest device budget that fits is ");
    why_not = plan ? std::string("fits this rank, not every rank")
                   : at == std::string::npos ? why.substr(0, 120) : why.substr(at);
    return std::nullopt;
  };
  std::string tried;
  for (Candidate c : candidates) {
    std::string why_not;
    std::optional<offload::MemoryPlan> plan = attempt(c, why_not);
    const bool pieces = try_pieces && c.loss_chunks > 1;
    const auto name = [&] {
      return c.recompute + (c.offload_activations && !o.offload_activations ? ", --offload-activations" : "") +
             (pieces ? ", --loss-chunks " + std::to_string(c.loss_chunks) : "");
    };
    if (!plan) {
      tried += "\n  --recompute " + name() + ", --offload-state " + c.state + ": " + why_not;
      continue;
    }
    // The ladder's K fits and the K before it (or none) did not, with the same state and pieces:
    // the least K between them that fits, found by halving (the activations' bytes fall as K
    // grows), so a budget between two steps of the ladder costs only the blocks it needs.
    const auto k_at = std::find_if(ladder.begin(), ladder.end(), [&](int64_t K) { return c.recompute == mlp_first(K); });
    if (k_at != ladder.end()) {
      int64_t lo = k_at == ladder.begin() ? 0 : *(k_at - 1), hi = *k_at;
      const std::string bounds = c.recompute + " fits and " + (lo == 0 ? std::string("none") : mlp_first(lo));
      std::string probed;
      bool last_fit = true;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        Candidate m = c;
        m.recompute = mlp_first(mid);
        if (auto p = attempt(m, why_not)) {
          hi = mid;
          plan = std::move(p);
          last_fit = true;
        } else {
          lo = mid;
          last_fit = false;
        }
        probed += std::string(probed.empty() ? "" : ", ") + std::to_string(mid) + (last_fit ? " fits" : " does not");
      }
      c.recompute = mlp_first(hi);
      if (!last_fit) plan = attempt(c, why_not);  // the probe and the model's policy are the chosen K's again
      BLU_CHECK(plan, "--recompute auto: ", c.recompute, " fitted and then did not on its second probe");
      if (cb_.log && !probed.empty())
        *cb_.log << "recompute auto: " << bounds << " does not; between them " << probed << "\n";
    }
    if (try_pieces) opt_s_.loss_chunks = pieces ? c.loss_chunks : 1;
    if (cb_.log)
      *cb_.log << "recompute auto: " << name() << " (the least recompute that fits"
               << (c.state == "none" ? " with the optimizer state on the device" : "") << ")\n";
    return *plan;
  }
  BLU_CHECK(false, "--recompute auto: no recompute setting fits the budget (--gpu-memory-budget ", o.gpu_memory_budget,
            ", --host-memory-budget ", o.host_memory_budget, "):", tried);
  return {};
}

void Trainer::plan_memory(dist::StrategyConfig& sc, const dist::Layout& layout,
                          const std::shared_ptr<dist::ProcessGroup>& job,
                          const std::shared_ptr<dist::ProcessGroup>& pipeline_gradients) {
  const TrainOptions& o = opt_s_;
  BLU_CHECK(o.optimizer == "adamw", "--gpu-memory-budget/--offload-*: the planner handles adamw; got --optimizer ",
            o.optimizer);
  // A pipeline stage is probed by running a whole step of its schedule on a stage of its own
  // (dropped after): the micro-batches in flight, the sends and receives and the replicas'
  // gradient average are the training step's.
  std::unique_ptr<dist::PipelineStage> probe_stage;
  if (pipelined_) {
    dist::PipelineOptions po = pipeline_options(layout);
    po.gradients = pipeline_gradients;
    if (layout.tp > 1) po.tp = mesh_->group_ptr({"tp"});
    if (layout.dp > 1)
      po.reduce_gradients = [this, dp = mesh_->group_ptr({"dp"})] {
        std::vector<Tensor> grads;  // the stage's own: no other parameter runs on this rank
        for (const Tensor& p : model_->parameters())
          if (p.grad().defined()) grads.push_back(p.grad());
        dist::all_reduce_packed(*dp, grads, dist::ReduceOp::avg);
      };
    // In list order, so the stage holds the schedule's bound of micro-batches in flight: message-
    // driven, a gradient that arrives before the next forward's activation runs first and frees a
    // micro-batch early, and the probe saw three of GPipe's four under load (then the plan was
    // too small for training, which can reach the bound).
    po.execution = dist::PipelineExecution::scheduled;
    probe_stage = std::make_unique<dist::PipelineStage>(*model_, mesh_ ? mesh_->group_ptr({"pp"}) : job, po);
  }
  dist::PipelineStage* const stage = probe_stage.get();
  offload::PlanInput in;
  // A tensor-parallel rank probes and plans its own shard (the model is split already), a
  // pipeline rank its stage's parameters; the fp32 masters on the host are implemented for data
  // parallelism only.
  const bool split = dist::is_tensor_parallel(*model_);
  in.moment_bytes = 2 * int64_t(dtype_size(adamw_state_dtype(o)));
  in.masters_allowed = !split && !stage;
  if (o.zero >= 1) in.state_shards = int64_t(replica_rows_.size());  // the replicas ZeRO shards over
  if (o.zero == 2 && in.state_shards > 1) in.shard_gradients = true;
  std::set<const Storage*> own;  // a pipeline stage's parameters (a tied weight on both ends)
  if (stage)
    for (const auto& [name, p] : stage->owned_parameters()) own.insert(p.storage().get());
  const auto counted = [&](const Tensor& p) { return !stage || own.count(p.storage().get()) > 0; };
  for (const Tensor& p : model_->parameters())
    if (counted(p)) in.param_elements += p.numel();
  for (const auto& [path, m] : model_->named_modules())  // looked up in fp32: they stay on the device
    if (auto* e = dynamic_cast<nn::Embedding*>(m); e && counted(e->weight)) in.resident_elements += e->weight.numel();
  // ZeRO-3 shards the parameters: a Strategy of its own (the state on the device) is built for the
  // probe and dropped after it (the parameters get whole storage back). What it holds once built,
  // less its moments, is this rank's parameter and gradient shards; the probe's micro-batches run
  // through its gathers and reductions.
  const bool zero3 = o.zero == 3;
  std::unique_ptr<dist::Strategy> zero3_probe;
  dist::ZeroAdamW* zero3_opt = nullptr;
  if (zero3) {
    BLU_CHECK(job, "--zero 3 shards over the job's ranks: it needs a process group");
    model_->set_compute_copies(false);  // as ZeRO-3 does: each forward casts the gathered units
    int64_t whole = 0;  // the parameters' bytes on the device now, each storage once
    std::set<const Storage*> seen;
    for (const Tensor& p : model_->parameters())
      if (seen.insert(p.storage().get()).second) whole += int64_t(p.storage()->nbytes());
    Allocator& alloc = allocator_for(device_);
    const int64_t before = alloc.stats().current_bytes;
    dist::StrategyConfig probe_sc = sc;
    probe_sc.offload_state = false;
    zero3_probe = std::make_unique<dist::Strategy>(
        *model_, job, probe_sc,
        dist::OptimizerConfig{
            .name = o.optimizer, .lr = o.lr, .weight_decay = o.weight_decay, .beta1 = o.beta1, .beta2 = o.beta2,
            .state_dtype = adamw_state_dtype(o)});
    zero3_opt = dynamic_cast<dist::ZeroAdamW*>(&zero3_probe->optimizer());
    BLU_CHECK(zero3_opt, "plan_memory: the ZeRO-3 probe strategy has no ZeroAdamW");
    in.state_shards = job->size();
    in.measured_parameter_bytes =
        alloc.stats().current_bytes - before + whole - in.moment_bytes * zero3_opt->shard_numel();
  }
  // ZeRO-3 keeps no compute copies (each forward casts the gathered units: the probe counts them).
  in.compute_copy_bytes = !zero3 && (o.precision == "bf16" || o.precision == "fp16") ? 2 : 0;
  if (sc.split_masters) {  // what dist::Strategy splits: every parameter but the embeddings' (looked up in fp32)
    const std::set<const Storage*> looked_up = dist::embedding_weight_storages(*model_);
    for (const Tensor& p : model_->parameters())
      if (!looked_up.count(p.storage().get())) in.split_elements += p.numel();
  }
  in.device_budget = offload::gib_to_bytes(o.gpu_memory_budget);
  // A device pool counts exactly what the probe counts; on a GPU the steps' peak came out 0.3-1.8%
  // above the plan (docs/offload.md), so 2% of the budget is kept free there.
  if (device_.is_cuda()) in.device_headroom = 0.02;
  in.host_budget = offload::gib_to_bytes(o.host_memory_budget);
  // Under --compile the state stays on the device (the compiler does not capture the offloaded
  // update): the budget is met by the activations' recompute (--recompute) or refused.
  in.offload_state = o.compile ? "none" : o.offload_state;
  in.single_rank = world_ == 1;
  in.micro_batches = o.grad_accum;
  in.offload_update = o.offload_update;
  in.offload.chunk_elements = o.offload_chunk;
  in.offload.overlap_forward = o.offload_overlap && !is_pipelined(layout);  // a pipeline's stages update inside the step
  if (!device_.is_cuda()) in.offload.grad_window_bytes = 0;  // a pool's copies are done when queued
  // The probe, under the model's activation policy. The compute copies the first probe's forward
  // makes stay (the plan counts them as such): later probes find them already there.
  bool copies_made = false;
  auto probe = [&] {
    in.activations = {};
    in.gradient_staging_bytes = 0;
    Allocator& alloc = allocator_for(device_);
    Generator& gen = default_generator();
    const uint64_t seed = gen.seed(), offset = gen.offset();
    const int64_t before = alloc.stats().current_bytes;
    // The scratch workspace (cuBLASLt's, flash attention's) grows to its high-water mark and keeps
    // its block: an earlier probe's is already in `before`, yet every step holds it at its peak.
    const int64_t scratch_held = int64_t(current_context(device_).scratch->block_bytes());
    alloc.reset_peak();
    // Replicas that exchange a tied embedding's gradient rows apart (dist/ddp.h) never make its
    // dense row gradient: the probe hands the rows to a sink that keeps them, as DDP's does.
    std::vector<nn::Embedding*> sinks;
    std::vector<Tensor> kept_rows;
    if (!stage && sc.row_exchange && sc.zero != 3 && replica_rows_.size() > 1) sinks = dist::row_sparse_embeddings(*model_);
    for (nn::Embedding* e : sinks)
      e->set_row_grad_sink([&kept_rows](const Tensor& idx, const Tensor& g) { kept_rows.insert(kept_rows.end(), {idx, g}); });
    const auto t0 = std::chrono::steady_clock::now();
    if (stage) {
      // A whole step of the schedule: every stage runs it at once (sends, receives and the
      // gradient norm's all-reduce pair up), so the stage's peak holds the micro-batches it has
      // in flight. Its time is the step's forward and backward.
      const Tensor ids = zeros({local_batch_, o.seq_len}, DType::i32, device_);
      const dist::PipelineStepValues v =
          stage->forward_backward(o.grad_accum, [&](int64_t) { return std::pair<Tensor, Tensor>{ids, ids}; }, o.grad_clip);
      to_device(v.gate.sum_squares, kCPU);  // waits for the device
      in.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const int64_t micro = stage ? 0 : std::min<int64_t>(2, o.grad_accum);
    std::vector<Tensor> params = model_->parameters();
    Tensor shard_grad;  // ZeRO-2's averaged gradient of this rank, from the first reduced bucket on
    const auto micro_batches = [&] {
      for (int64_t i = 0; i < micro; ++i) {
        // ZeRO-2's synced micro-batch (the last) hands each gradient to a bucket as soon as backward
        // has made it and releases it, the first opening this rank's shard gradient: the probe does
        // both (the buckets' staging is added by the plan).
        const bool release = in.shard_gradients && i == micro - 1;
        if (release)
          for (Tensor& p : params)
            if (p.requires_grad())
              p.register_grad_hook([q = p, &shard_grad, n = (in.param_elements + in.state_shards - 1) / in.state_shards,
                                    dev = device_](Tensor&) mutable {
                if (!shard_grad.defined()) shard_grad = empty({n}, DType::f32, dev);
                q.zero_grad();
              });
        const Tensor ids = zeros({o.batch_size, o.seq_len}, DType::i32, device_);
        if (zero3) zero3_opt->begin_forward(i == 0);
        Tensor loss = model_->forward(ids, ids).loss;
        if (zero3) zero3_opt->begin_backward();
        loss.backward();
        if (zero3) zero3_opt->end_backward();
        to_device(loss, kCPU);  // waits for the device
        if (release)
          for (Tensor& p : params)
            if (p.requires_grad()) p.autograd_meta().grad_hooks.pop_back();
      }
      shard_grad = Tensor();
    };
    micro_batches();
    if (in.shard_gradients) {
      int64_t largest = 0;
      for (const Tensor& p : params) largest = std::max(largest, p.numel());
      in.gradient_staging_bytes =
          int64_t(dist::zero2_staging_bytes(double(in.param_elements), double(largest), 4, sc.zero_bucket_mib));
    }
    if (!stage)
      in.compute_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                           double(micro) * double(o.grad_accum);
    in.activations.device_bytes =
        alloc.stats().peak_bytes - before + scratch_held - (copies_made ? 0 : in.compute_copy_bytes * in.param_elements);
    kept_rows.clear();
    copies_made = true;
    in.grads_in_activations = true;
    const auto put_back = [&] {  // the gradients dropped, the generator where the probe found it
      for (Tensor p : model_->parameters()) p.zero_grad();
      gen.set_state(seed, offset);
    };
    put_back();
    // --compile --compile-remat: the warm-up step runs eager with every block recomputed (Note [The
    // warm-up step recomputes every block], models/activations.h), probed as such.
    if (o.compile && o.compile_remat && !stage) {
      const models::WarmupPolicy warmup(*model_, true);
      const int64_t at = alloc.stats().current_bytes;
      alloc.reset_peak();
      micro_batches();
      in.activations.warmup_bytes = alloc.stats().peak_bytes - at + scratch_held;
      kept_rows.clear();
      put_back();
    }
    for (nn::Embedding* e : sinks) e->set_row_grad_sink(nullptr);
    // --compile: what the compiled steps hold instead — less what the compiler's recompute
    // (--compile-remat) takes off, plus the gaps of its arena's packing — decided on a capture of
    // one micro-batch's forward and backward (no kernel runs; its unbacked gradients are dropped
    // and the generator put back). The eager probe above measured the rest.
    if (o.compile && !stage) {
      const Tensor ids = zeros({o.batch_size, o.seq_len}, DType::i32, device_);
      const compiler::CompiledPeakChange c = compiler::compiled_peak_change(
          [&] { model_->forward(ids, ids).loss.backward(); }, model_->named_parameters(), {ids},
          compiler::excluded_ops(), o.compile_remat);
      in.activations.compiled_saving = int64_t(c.remat_saving);
      in.activations.compiled_excess = int64_t(c.arena_excess);
      put_back();
    }
    // A stage runs its own blocks, with up to its schedule's in-flight bound of micro-batches saved.
    const std::vector<int64_t> own_blocks = stage ? stage->owned_blocks() : std::vector<int64_t>{};
    const int64_t in_flight = stage ? std::max<int64_t>(1, stage->schedule().max_in_flight(stage->rank())) : 1;
    in.activations.blocks = stage ? int64_t(own_blocks.size()) : int64_t(model_->blocks().size());
    in.activations.kept = in.activations.blocks;
    // The activation policy (models/activations.h): the probe ran under it, so device_bytes holds
    // its effect; the blocks it keeps, offloads and recomputes and the host bytes come from it
    // (a stage's blocks; its host bytes for each micro-batch it may hold).
    if (const models::ActivationPolicy& ap = model_->activation_policy(); ap.any() && (!stage || !own_blocks.empty())) {
      const models::ActivationTotals t =
          models::activation_totals(*model_, stage ? local_batch_ : o.batch_size, o.seq_len, ap, own_blocks);
      in.activations.kept = t.kept_blocks;
      in.activations.offloaded = t.offloaded_blocks;
      in.activations.recomputed = t.recomputed_blocks;
      in.activations.regions = t.regions;
      in.activations.host_bytes = t.host_bytes * in_flight;
    }
  };
  in.host_adamw_elements_per_s = offload::probe_host_adamw(0);
  if (device_ != kCPU) in.transfer_bytes_per_s = offload::probe_transfer(*offload::make_copy_engine(device_));
  offload::MemoryPlan plan;
  if (o.recompute == "auto") {
    // Where the probe is collective (a pipeline's step, a tensor-parallel shard's forward and
    // backward, ZeRO-3's gathers) every rank must probe the same candidates: a candidate is taken when it fits on
    // every rank of the job. Replicas of a plain layout probe without collectives and decide alone.
    const bool collective = job && (stage || split || zero3);
    const auto all_fit = [&](bool fits) {
      if (!collective) return fits;
      Tensor misfit = full({1}, fits ? 0.0 : 1.0, DType::f32, device_);
      job->all_reduce(misfit, dist::ReduceOp::max)->wait();
      return to_device(misfit, kCPU).item() == 0.0;
    };
    plan = plan_with_recompute(in, probe, all_fit);
  } else {
    probe();
    try {
      plan = offload::plan_memory(in);
    } catch (const Error& e) {
      BLU_CHECK(!o.compile, e.what(), "\n  under --compile the optimizer state stays on the device; --recompute ",
                "selective|mlp|block:N|block|auto (now ", o.recompute, ") lowers the activations' bytes");
      throw;
    }
  }
  if (cb_.log) {
    if (stage) {
      const std::vector<int64_t> b = stage->owned_blocks();
      *cb_.log << "memory plan of pipeline stage " << stage->rank() << " (blocks " << (b.empty() ? 0 : b.front()) << "-"
               << (b.empty() ? -1 : b.back()) << (split ? ", a tensor-parallel shard" : "") << "): "
               << in.param_elements << " parameters\n";
    } else if (split) {
      *cb_.log << "memory plan of this rank's tensor-parallel shard: " << in.param_elements << " parameters\n";
    }
    *cb_.log << plan.text << "\n";
  }
  sc.offload_state = plan.offload_state;
  sc.offload = in.offload;
  sc.offload.update = plan.update;
  sc.offload.masters_on_host = plan.masters_on_host;
  sc.offload.grads_on_host = plan.grads_on_host;
  if (device_.is_cpu() && device_.index >= 1) device_pool(device_.index).set_budget(in.device_budget);
  memory_plan_ = plan;
}

}  // namespace blu::train
