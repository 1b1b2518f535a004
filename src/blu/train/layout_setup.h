// train/layout_setup: what a resolved `--parallel` layout builds on this rank, shared by the trainer
// and `blutrain bench` so that a layout runs the same way in both:
//   check_layout_supported: the layouts the annotations express but the runtime does not run yet
//     (ZeRO over tensor-parallel or pipelined replicas, sequence parallelism inside pipeline
//     stages, a sequence that does not split over the TP ranks), refused with the annotation's
//     text;
//   pipeline_options: a Layout's pipeline (schedule, chunks, micro-batches, blocks per stage);
//   make_layout_groups: the process groups — for a hybrid (tensor parallelism, or replicas of a
//     pipeline) the dp × pp × tp mesh with a group per dimension and sub-mesh, created in one order
//     on every rank; otherwise one group over the job — NCCL on a CUDA device, Gloo on the CPU;
//   split_tensor_parallel: the model rewritten into this rank's tensor-parallel shard (its compute
//     dtype re-applied);
//   make_layout_strategy: the model split (unless it is already) and the dist::Strategy of the
//     layout over the right groups;
//   decide_layout: `--parallel auto` (the planner's pick), weights=probe, widths=probe and
//     balance=time made into a stated layout.
// Depends on dist/ (annotations, mesh, pipeline, strategy, tensor_parallel), models/causal_lm.
// Keep: every rank calls make_layout_groups and make_layout_strategy in the same order (they hold
// collectives); nothing here names a concrete model.
#pragma once
#include <iosfwd>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "blu/core/device.h"
#include "blu/dist/annotations.h"
#include "blu/dist/env.h"
#include "blu/dist/mesh.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/planner.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/models/causal_lm.h"

namespace blu::train {

// `--parallel auto` and `replicate(n, weights=probe)` decided on this job, into a stated layout:
//   auto: the planner's fastest layout (dist::plan over `costs` and `link`, this rank's probes) that
//     fits memory_budget bytes per rank (0: no limit), for a global batch of rows_per_rank x world
//     rows (what --dp N trains on); `rows` is then that batch's rows per micro-batch per replica;
//   weights=probe: each replica's forward + backward time of `model` (on its device) measured over
//     probe_pg (dist/hetero.h), stated as weights=[...]; `rows` stays rows_per_rank;
//   balance=time: the pipeline's stages from the same probe, `costs` and memory_budget (Note
//     [Stages by time], layout_setup.cpp), stated as stage(…) ranges; `rows` stays rows_per_rank.
// A stated text comes back as it is. Rank 0's pick is agreed through `store` (null: one process).
// Collective over probe_pg and the store when there is something to decide.
struct LayoutDecision {
  std::string text;              // an annotation without auto or probe: what run.json records
  int64_t rows = 0;              // -B for the layout: rows of one micro-batch of one replica
  nlohmann::json plan;           // auto: the planner's first five (layout, step_ms, memory_mib, fits)
  // weights=probe, and auto over several ranks: each rank's probe step time (ms), and the speeds
  // from them (dist::PlanJob::rank_speeds: predict the layout with them).
  std::vector<double> probe_ms{}, rank_speeds{};
};
bool needs_decision(const std::string& text);  // "auto", or a weights/widths=probe or balance=time anywhere
LayoutDecision decide_layout(const std::string& text, models::CausalLM& model, const dist::ModelCosts& costs,
                             const dist::LinkCosts& link, dist::ProcessGroup* probe_pg, dist::TcpStore* store, int rank,
                             int world, int64_t rows_per_rank, int64_t seq, double memory_budget);

// The planner's probes (Note [Deciding --parallel]): measure_model of `probe` (on its device, in its
// precision) at b and 2b rows of `seq` tokens on every rank of `pg` in lockstep; measure_split on a
// fresh copy built from `config` for each tensor-parallel degree that divides `world` and the
// model's units (and with sequence parallelism too when `with_sp`); each time's slowest value over
// the ranks; the link over `pg`. Collective over pg (null: one process, no link).
struct LayoutCosts {
  dist::ModelCosts model;
  dist::LinkCosts link;
};
LayoutCosts probe_layout_costs(models::CausalLM& probe, const nlohmann::json& config, const std::string& precision,
                               int64_t b, int64_t seq, Device dev, dist::ProcessGroup* pg, int world, bool with_sp);

// Each replica's rows of a batch of `rows` rows: equal shares when the layout's replica weights are
// equal and dp divides the rows, else in proportion to the weights (dist::proportional_split).
// Uneven shares make a replica's gradient weigh its rows (StrategyConfig::batch_share) and turn the
// tied embedding's row exchange off (it gathers as many ids from every rank); `uneven` says so.
struct ReplicaRows {
  std::vector<int64_t> rows;
  bool uneven = false;
};
ReplicaRows replica_rows(const dist::Layout& l, int64_t rows);

// The trainer's decision of `o.parallel` (auto or weights=probe) on this job: probes a copy of the
// model on this rank's device and the link over a probe group, made through `store`, which it
// creates when the job has several ranks (the trainer keeps it); prints the plan or the probe's
// times to `log` on rank 0 (Note [Deciding --parallel] in layout_setup.cpp).
struct TrainOptions;
LayoutDecision decide_parallel(const TrainOptions& o, const dist::DistEnv& env, std::unique_ptr<dist::TcpStore>& store,
                               std::ostream* log);

// BLU_CHECK for what the runtime does not implement; `text` is the annotation as the user gave it.
void check_layout_supported(const dist::Layout& l, const std::string& text, int64_t seq_len);

// A layout with a pipeline annotation: several stages, or one (`pipeline(1, micro=M)`: the
// pipeline's code path on one rank, its micro-batches accumulated as a pipeline of several does).
inline bool is_pipelined(const dist::Layout& l) { return l.pp > 1 || l.micro_batches > 0; }

// The pipeline of `l` (is_pipelined(l)).
dist::PipelineOptions pipeline_options(const dist::Layout& l);

// A layout that needs the mesh's groups: tensor parallelism, or a pipeline with replicas.
inline bool is_hybrid(const dist::Layout& l) { return l.tp > 1 || (l.pp > 1 && l.dp > 1); }

struct LayoutGroups {
  std::unique_ptr<dist::DeviceMesh> mesh;   // hybrids only
  std::shared_ptr<dist::ProcessGroup> job;  // every rank of the job
  // A pipeline over NCCL: a second group over this rank's stages, which the gradients travel on
  // (dist::PipelineOptions::gradients); null otherwise.
  std::shared_ptr<dist::ProcessGroup> pipeline_gradients;
};

// Collective. `timeout_s` > 0 bounds every collective (0: NCCL's 600 s, Gloo's 30 s); a CUDA
// `device` gets NCCL groups on it, the CPU Gloo groups.
LayoutGroups make_layout_groups(dist::TcpStore& store, int rank, int world, const dist::Layout& l, Device device,
                                double timeout_s);

// The model rewritten into this rank's shard of the layout's split (over the mesh's tp group) and
// `precision` (fp32, tf32, bf16, fp16) applied again to the new modules. Collective over tp.
void split_tensor_parallel(models::CausalLM& model, const dist::Layout& l, const dist::DeviceMesh& mesh,
                           const std::string& precision);

// The layout's strategy. Under tensor parallelism the model is split first (split_tensor_parallel)
// unless it is already (a memory budget's probe runs the shard: Trainer::plan_memory). `mesh` is the hybrid's (null
// otherwise); `job` is the group of every rank, and the strategy's own when the layout is not a
// hybrid (a pipeline's stages, or the replicas of DDP/ZeRO); null on a single process.
// `pipeline_gradients`: LayoutGroups' (null: the pipeline's own group).
std::unique_ptr<dist::Strategy> make_layout_strategy(models::CausalLM& model, const dist::Layout& l,
                                                     const dist::DeviceMesh* mesh,
                                                     std::shared_ptr<dist::ProcessGroup> job, dist::StrategyConfig sc,
                                                     const dist::OptimizerConfig& oc, const std::string& precision,
                                                     std::shared_ptr<dist::ProcessGroup> pipeline_gradients = nullptr);

// A script's whole rewrite from one device to a layout (docs/distributed.md, "From one device to
// a layout"): the job from the launcher's environment (dist::detect_env), its store, `text`
// resolved against the model's blocks and checked (check_layout_supported), the groups
// (make_layout_groups, NCCL when the model is on a GPU), the model split and its strategy
// (make_layout_strategy), and the rows of each micro-batch that this rank's replica trains: a
// step's `rows` global rows make micro_batches() micro-batches of rows / micro_batches() each (a
// BLU_CHECK that they divide), of which each replica takes its weight's share
// (dist::proportional_split; each replica's gradient weighted by its rows). An empty text, or one process without a launcher, gives the single-device strategy.
// `text` must be stated: auto and the probes (weights=probe, widths=probe, balance=time) are
// decided by `blutrain train`/`bench`, which record the stated layout. Collective.
struct Parallel {
  dist::Layout layout;
  std::unique_ptr<dist::TcpStore> store;
  LayoutGroups groups;
  std::unique_ptr<dist::Strategy> strategy;
  int replica = 0;                  // this rank's replica (its dp coordinate)
  int64_t first_row = 0, rows = 0;  // rows [first_row, first_row + rows) of each micro-batch
  int64_t micro_batches() const { return is_pipelined(layout) ? layout.micro_batches : 1; }
};
Parallel parallelize(models::CausalLM& model, const std::string& text, int64_t rows, const dist::OptimizerConfig& oc,
                     const std::string& precision = "fp32");

}  // namespace blu::train
