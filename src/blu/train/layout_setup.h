// train/layout_setup: what a resolved `--parallel` layout builds on this rank, shared by the trainer
// and `blutrain bench` so that a layout runs the same way in both:
//   check_layout_supported: the layouts the annotations express but the runtime does not run yet
//     (ZeRO over tensor-parallel or pipelined replicas, sequence parallelism inside pipeline
//     stages, uneven split widths, a sequence that does not split over the TP ranks), refused with
//     the annotation's text;
//   pipeline_options: a Layout's pipeline (schedule, chunks, micro-batches, blocks per stage);
//   make_layout_groups: the process groups — for a hybrid (tensor parallelism, or replicas of a
//     pipeline) the dp × pp × tp mesh with a group per dimension and sub-mesh, created in one order
//     on every rank; otherwise one group over the job — NCCL on a CUDA device, Gloo on the CPU;
//   make_layout_strategy: the model rewritten into this rank's tensor-parallel shard (its compute
//     dtype re-applied), and the dist::Strategy of the layout over the right groups.
// Depends on dist/ (annotations, mesh, pipeline, strategy, tensor_parallel), models/causal_lm.
// Keep: every rank calls make_layout_groups and make_layout_strategy in the same order (they hold
// collectives); nothing here names a concrete model.
#pragma once
#include <memory>
#include <string>

#include "blu/core/device.h"
#include "blu/dist/annotations.h"
#include "blu/dist/mesh.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/models/causal_lm.h"

namespace blu::train {

// BLU_CHECK for what the runtime does not implement; `text` is the annotation as the user gave it.
void check_layout_supported(const dist::Layout& l, const std::string& text, int64_t seq_len);

// The pipeline of `l` (l.pp > 1).
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

// The layout's strategy. Under tensor parallelism the model is rewritten first and `precision`
// (fp32, tf32, bf16, fp16) applied again to the new modules. `mesh` is the hybrid's (null
// otherwise); `job` is the group of every rank, and the strategy's own when the layout is not a
// hybrid (a pipeline's stages, or the replicas of DDP/ZeRO); null on a single process.
// `pipeline_gradients`: LayoutGroups' (null: the pipeline's own group).
std::unique_ptr<dist::Strategy> make_layout_strategy(models::CausalLM& model, const dist::Layout& l,
                                                     const dist::DeviceMesh* mesh,
                                                     std::shared_ptr<dist::ProcessGroup> job, dist::StrategyConfig sc,
                                                     const dist::OptimizerConfig& oc, const std::string& precision,
                                                     std::shared_ptr<dist::ProcessGroup> pipeline_gradients = nullptr);

}  // namespace blu::train
