#include "blu/train/layout_setup.h"

#include <algorithm>
#include <cmath>

#include "blu/core/error.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/train/trainer.h"

namespace blu::train {

void check_layout_supported(const dist::Layout& l, const std::string& text, int64_t seq_len) {
  BLU_CHECK(l.zero == 0 || (l.tp == 1 && l.pp == 1), "--parallel '", text, "': ZeRO-", l.zero,
            l.tp > 1 ? " over tensor-parallel replicas (replicate(zero=" : " over pipelined replicas (replicate(zero=",
            l.zero, ") of ", l.tp > 1 ? "split" : "pipeline", ") is not implemented");
  BLU_CHECK(!l.sequence_parallel || l.pp == 1, "--parallel '", text,
            "': sequence parallelism inside pipeline stages is not implemented (the stages send whole [B, T, C] "
            "activations); use split(n) in the stages");
  BLU_CHECK(l.tp_widths.empty() || std::all_of(l.tp_widths.begin(), l.tp_widths.end(),
                                               [&](double w) { return std::abs(w - 1.0 / l.tp) < 1e-12; }),
            "--parallel '", text, "': uneven split widths are not implemented in tensor parallelism");
  BLU_CHECK(!l.sequence_parallel || seq_len % l.tp == 0, "--parallel '", text,
            "': sequence parallelism splits the sequence over ", l.tp, " ranks; the sequence length ", seq_len,
            " does not divide by it");
}

dist::PipelineOptions pipeline_options(const dist::Layout& l) {
  dist::PipelineOptions p;
  p.schedule = l.schedule == dist::Schedule::gpipe         ? dist::PipelineScheduleKind::gpipe
               : l.schedule == dist::Schedule::interleaved ? dist::PipelineScheduleKind::interleaved
                                                           : dist::PipelineScheduleKind::one_f_one_b;
  p.chunks = l.chunks;
  p.micro_batches = l.micro_batches;
  for (const auto& [first, last] : l.stage_blocks) p.layers.push_back(last - first + 1);
  return p;
}

LayoutGroups make_layout_groups(dist::TcpStore& store, int rank, int world, const dist::Layout& l, Device device,
                                double timeout_s) {
  const auto ms = [&](double fallback_s) {
    return dist::Milliseconds(int64_t((timeout_s > 0 ? timeout_s : fallback_s) * 1000));
  };
  const dist::DeviceMesh grid(rank, world, {{"dp", l.dp}, {"pp", l.pp}, {"tp", l.tp}});
#ifdef BLU_HAVE_CUDA
  const bool nccl = device.is_cuda();
  const dist::GroupFactory make = nccl ? dist::nccl_group_factory(dist::NcclOptions{.timeout = ms(600), .device = device.index})
                                       : dist::gloo_group_factory(dist::GlooOptions{.timeout = ms(30)});
#else
  const bool nccl = false;
  const dist::GroupFactory make = dist::gloo_group_factory(dist::GlooOptions{.timeout = ms(30)});
#endif
  LayoutGroups g;
  if (is_hybrid(l)) {
    g.mesh = std::make_unique<dist::DeviceMesh>(store, rank, world, grid.dims(), make);
    g.job = g.mesh->group_ptr({"dp", "pp", "tp"});
  } else {
    g.job = make(store, rank, world, "default_pg");
  }
  if (nccl && l.pp > 1) {
    // The stages' second communicator (PipelineOptions::gradients), named by its members.
    const std::vector<int> stages = grid.group_ranks({"pp"});
    std::string name = "pipeline_gradients/";
    for (int r : stages) name += std::to_string(r) + ".";
    const int index = int(std::find(stages.begin(), stages.end(), rank) - stages.begin());
    g.pipeline_gradients = make(store, index, int(stages.size()), name);
  }
  return g;
}

std::unique_ptr<dist::Strategy> make_layout_strategy(models::CausalLM& model, const dist::Layout& l,
                                                     const dist::DeviceMesh* mesh,
                                                     std::shared_ptr<dist::ProcessGroup> job, dist::StrategyConfig sc,
                                                     const dist::OptimizerConfig& oc, const std::string& precision,
                                                     std::shared_ptr<dist::ProcessGroup> pipeline_gradients) {
  const bool piped = l.pp > 1;
  dist::PipelineOptions pipeline;
  if (piped) {
    pipeline = pipeline_options(l);
    pipeline.gradients = std::move(pipeline_gradients);
  }
  if (!mesh) {
    if (piped) return std::make_unique<dist::Strategy>(model, std::move(job), pipeline, sc, oc);
    return std::make_unique<dist::Strategy>(model, std::move(job), sc, oc);
  }
  // Hybrid: the model rewritten into this rank's TP shard, the stage's pipeline over the pp group,
  // gradients averaged over the dp group.
  if (l.tp > 1) {
    sc.tp = mesh->group_ptr({"tp"});
    dist::apply_tensor_parallel(model, sc.tp, dist::TPOptions{.sequence_parallel = l.sequence_parallel});
    apply_precision(model, precision);  // the sharded modules take the compute dtype too
  }
  if (piped) {
    if (l.dp > 1) sc.dp = mesh->group_ptr({"dp"});
    sc.job = std::move(job);
    return std::make_unique<dist::Strategy>(model, mesh->group_ptr({"pp"}), pipeline, sc, oc);
  }
  return std::make_unique<dist::Strategy>(model, l.dp > 1 ? mesh->group_ptr({"dp"}) : nullptr, sc, oc);
}

}  // namespace blu::train
