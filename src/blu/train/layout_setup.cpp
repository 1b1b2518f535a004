#include "blu/train/layout_setup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <ostream>

#include "blu/core/error.h"
#include "blu/dist/process_group.h"
#include "blu/models/registry.h"
#include "blu/core/rng.h"
#include "blu/dist/consistency.h"
#include "blu/dist/hetero.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/train/trainer.h"
#ifdef BLU_HAVE_CUDA
#include "blu/backend/cuda/runtime.h"
#endif

namespace blu::train {

namespace {

bool has_probe(const dist::Annotation& a) {
  for (const char* key : {"weights", "widths"})
    if (auto it = a.args.find(key); it != a.args.end() && it->second == "probe") return true;
  if (auto it = a.args.find("balance"); a.kind == "pipeline" && it != a.args.end() && it->second == "time") return true;
  return std::any_of(a.children.begin(), a.children.end(), has_probe);
}

dist::Annotation* find_kind(dist::Annotation& a, const std::string& kind) {
  if (a.kind == kind) return &a;
  for (dist::Annotation& c : a.children)
    if (dist::Annotation* f = find_kind(c, kind)) return f;
  return nullptr;
}

// Note [Stages by time]: pipeline(n, balance=time) is decided into pipeline(n) { stage(…) … }
// with the block counts dist::balance_stages picks (dist/hetero.h):
//   - speeds: every rank's forward + backward time of the whole model (probe_step_times), each
//     stage at its slowest rank's pace (the replicas of a stage run its blocks too), relative to
//     the slowest rank of the job, whose pace the costs were probed at (take_slowest);
//   - times: a block's, the embedding's (first stage) and the head's and loss's (last stage) from
//     the costs at a micro-batch of `rows` sequences;
//   - memory: each rank's capacity — memory_budget when given, else on a GPU the device's total
//     memory, else none — the smallest over a stage's ranks, against the planner's prediction of
//     the stage holding n blocks (Prediction::stage_memory_bytes); virtual stages (interleaved)
//     share their rank's capacity in equal parts.
// The times are all-gathered, so every rank states the same stages.
std::string balance_by_time(const std::string& text, const dist::Layout& l, models::CausalLM& model,
                            const dist::ModelCosts& costs, dist::ProcessGroup* probe_pg, int world, int64_t rows,
                            int64_t seq, double memory_budget, std::vector<double>& probe_ms) {
  const Device dev = model.token_embedding().weight.device();
  const std::vector<double> t =
      probe_pg ? dist::probe_step_times(model, *probe_pg, rows, seq, 3) : std::vector<double>{1.0};
  double capacity = memory_budget > 0 ? memory_budget : 0.0;
#ifdef BLU_HAVE_CUDA
  if (capacity <= 0 && dev.is_cuda()) {
    cudaDeviceProp prop{};
    BLU_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev.index));
    capacity = double(prop.totalGlobalMem);
  }
#endif
  const std::vector<double> caps = probe_pg ? dist::gather_values(*probe_pg, capacity, dev) : std::vector<double>{capacity};
  for (double s : t) probe_ms.push_back(s * 1e3);
  const double slowest = *std::max_element(t.begin(), t.end());
  const int pp = l.pp, tp = l.tp, virt = pp * std::max(1, l.chunks);
  std::vector<double> stage_speed(size_t(pp), std::numeric_limits<double>::infinity());
  std::vector<double> stage_cap(size_t(pp), std::numeric_limits<double>::infinity());
  for (int r = 0; r < world && r < int(t.size()); ++r) {  // row-major dp × pp × tp: r's stage is (r / tp) % pp
    const size_t s = size_t((r / tp) % pp);
    stage_speed[s] = std::min(stage_speed[s], slowest / t[size_t(r)]);
    if (caps[size_t(r)] > 0) stage_cap[s] = std::min(stage_cap[s], caps[size_t(r)]);
  }
  const double b = double(rows);
  const double block_s = costs.block_fixed_s + costs.block_per_seq_s * b;
  const double embed_s = costs.embed_fixed_s + costs.embed_per_seq_s * b;
  const double head_s = std::max(0.0, costs.other_fixed_s + costs.other_per_seq_s * b - embed_s);
  const int64_t B = costs.blocks;
  // The largest block count each pipeline rank holds within its capacity, as the planner predicts it.
  std::vector<int64_t> rank_max(size_t(pp), B);
  for (int r = 0; r < pp; ++r) {
    if (!std::isfinite(stage_cap[size_t(r)])) continue;
    int64_t fit = 0;
    for (int64_t n = 1; n <= B; ++n) {
      dist::Layout probe = l;
      probe.balance_by_time = false;
      probe.chunks = 1;
      probe.stage_blocks.clear();
      for (int q = 0; q < pp; ++q) probe.stage_blocks.push_back({0, (q == r ? n : 1) - 1});  // only counts matter
      dist::PlanJob job;
      job.world = world;
      job.batch = rows * l.dp * std::max<int64_t>(1, l.micro_batches);
      const dist::Prediction p = dist::predict(probe, costs, dist::LinkCosts{}, job);
      if (p.stage_memory_bytes.at(size_t(r)) > stage_cap[size_t(r)]) break;
      fit = n;
    }
    rank_max[size_t(r)] = fit;
  }
  std::vector<double> speeds;
  std::vector<int64_t> max_blocks;
  const bool capped = std::any_of(stage_cap.begin(), stage_cap.end(), [](double c) { return std::isfinite(c); });
  for (int v = 0; v < virt; ++v) {
    speeds.push_back(stage_speed[size_t(v % pp)]);
    if (capped) max_blocks.push_back(rank_max[size_t(v % pp)] / std::max(1, l.chunks));
  }
  BLU_CHECK(!capped || std::accumulate(max_blocks.begin(), max_blocks.end(), int64_t(0)) >= B, "--parallel '", text,
            "': balance=time: ", B, " blocks do not fit the stages' memory (",
            memory_budget > 0 ? "--gpu-memory-budget" : "the devices' memory", ": at most ",
            std::accumulate(max_blocks.begin(), max_blocks.end(), int64_t(0)), " blocks over ", virt, " stages)");
  const std::vector<std::pair<int64_t, int64_t>> ranges =
      dist::balance_stages(B, speeds, block_s, embed_s, head_s, max_blocks);
  dist::Annotation a = dist::parse_annotation(text);
  dist::Annotation* pipe = find_kind(a, "pipeline");
  BLU_ASSERT(pipe, "balance=time outside a pipeline: ", text);
  pipe->args.erase("balance");
  const std::vector<models::BlockRef> blocks = model.blocks();
  for (const auto& [first, last] : ranges)
    pipe->children.push_back(dist::stage(blocks[size_t(first)].name + "-" + blocks[size_t(last)].name));
  return dist::to_text(a);
}

// The annotation with every weights=probe and widths=probe replaced by `shares`.
void state_weights(dist::Annotation& a, const std::string& shares) {
  for (const char* key : {"weights", "widths"})
    if (auto it = a.args.find(key); it != a.args.end() && it->second == "probe") it->second = shares;
  for (dist::Annotation& c : a.children) state_weights(c, shares);
}

}  // namespace

bool needs_decision(const std::string& text) {
  return text == "auto" || (!text.empty() && has_probe(dist::parse_annotation(text)));
}

LayoutDecision decide_layout(const std::string& text, models::CausalLM& model, const dist::ModelCosts& costs,
                             const dist::LinkCosts& link, dist::ProcessGroup* probe_pg, dist::TcpStore* store, int rank,
                             int world, int64_t rows_per_rank, int64_t seq, double memory_budget) {
  LayoutDecision d{.text = text, .rows = rows_per_rank, .plan = nlohmann::json::array()};
  if (!needs_decision(text)) return d;
  std::vector<std::string> names;
  for (const models::BlockRef& b : model.blocks()) names.push_back(b.name);
  if (text == "auto") {
    // The units every tensor-parallel degree must divide (heads, kv heads, MLP width, vocabulary rows).
    int64_t tp_units = 0;
    for (const models::ShardSpec& spec : model.tensor_parallel_plan())
      if (spec.units > 0) tp_units = std::gcd(tp_units, spec.units);
    if (tp_units == 0) tp_units = 1;  // no tensor-parallel plan: one rank per shard only
    dist::PlanJob job;
    job.world = world;
    job.batch = rows_per_rank * world;
    job.memory_budget = memory_budget;
    // Each rank's speed on the whole model (the costs are the slowest rank's): replicas of
    // unequal speed are weighed with rows in proportion to it.
    if (probe_pg && world > 1) {
      const std::vector<double> t =
          dist::probe_step_times(model, *probe_pg, std::max<int64_t>(1, rows_per_rank / 2), seq, 5);
      job.rank_speeds = d.rank_speeds = dist::speeds_from_times(t);
      for (double s : t) d.probe_ms.push_back(s * 1e3);
    }
    const std::vector<dist::Prediction> ranked = dist::plan(costs, link, job, names, tp_units, tp_units, tp_units);
    BLU_CHECK(!ranked.empty(), "--parallel auto: no layout of ", world, " ranks admits a global batch of ", job.batch,
              " rows");
    double least = ranked.front().memory_bytes;
    for (const dist::Prediction& p : ranked) least = std::min(least, p.memory_bytes);
    BLU_CHECK(ranked.front().fits, "--parallel auto: no layout of ", world, " ranks fits the memory budget of ",
              memory_budget / double(int64_t(1) << 30), " GiB; the smallest needs ", least / double(int64_t(1) << 30),
              " GiB");
    for (size_t i = 0; i < std::min<size_t>(5, ranked.size()); ++i)
      d.plan.push_back({{"layout", ranked[i].text}, {"step_ms", ranked[i].step_s * 1e3},
                        {"memory_mib", ranked[i].memory_bytes / double(1 << 20)}, {"fits", ranked[i].fits}});
    // Every rank holds the slowest rank's costs (take_slowest); rank 0's pick is agreed all the same.
    d.text = store ? dist::agree_on(*store, rank, "parallel_auto", ranked.front().text) : ranked.front().text;
    const dist::Layout l = dist::resolve_layout(dist::parse_annotation(d.text), names, world);
    const int64_t micro = is_pipelined(l) ? l.micro_batches : 1;
    BLU_CHECK(job.batch % (int64_t(l.dp) * micro) == 0, "--parallel auto: ", d.text, " does not split ", job.batch,
              " rows");
    d.rows = job.batch / (int64_t(l.dp) * micro);
    return d;
  }
  const dist::Layout l = dist::resolve_layout(dist::parse_annotation(text), names, world);
  if (l.balance_by_time) {
    BLU_CHECK(!l.probe_weights && !l.probe_widths, "--parallel '", text,
              "': balance=time and a probe's weights or widths in one layout are not implemented; state one of them");
    d.text = balance_by_time(text, l, model, costs, probe_pg, world, rows_per_rank, seq, memory_budget, d.probe_ms);
    return d;
  }
  // weights=probe: replicas of one rank each; widths=probe: one split over every rank (dist/hetero.h
  // measures a whole model per rank: its speed there is its speed on its share).
  BLU_CHECK((l.probe_weights && l.pp == 1 && l.tp == 1) || (l.probe_widths && l.dp == 1 && l.pp == 1), "--parallel '",
            text,
            "': weights=probe weighs replicas of one rank each (no split or pipeline inside), widths=probe a split "
            "of every rank (no replicate or pipeline around it)");
  const int64_t probe_b = std::max<int64_t>(1, rows_per_rank / 2);
  const std::vector<double> t =
      probe_pg ? dist::probe_step_times(model, *probe_pg, probe_b, seq, 3) : std::vector<double>{1.0};
  const std::vector<double> w = dist::speeds_from_times(t);
  d.rank_speeds = w;
  std::string stated = "[";
  char buf[32];
  for (size_t i = 0; i < w.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%.4g", w[i]);
    stated += (i ? "," : "") + std::string(buf);
  }
  stated += "]";
  dist::Annotation a = dist::parse_annotation(text);
  state_weights(a, stated);
  d.text = dist::to_text(a);  // the same on every rank: the times were all-gathered
  for (double s : t) d.probe_ms.push_back(s * 1e3);
  return d;
}

// Note [Deciding --parallel]: `--parallel auto` and weights=probe are decided before the layout is
// resolved. Every rank builds a copy of the model on its device, probes it (auto: dist::
// measure_model and measure_split on every rank in lockstep, the slowest rank's times kept, and
// the link over a probe group of the whole job; probe: each replica's step time) and
// train/layout_setup.h's decide_layout turns the text into a stated layout, rank 0's pick agreed
// through the store. The run then trains that layout, and records it (and -B as the
// layout's rows per micro-batch per replica) in run.json, so a resume runs it again as it is. -B
// under auto is rows per rank, as under --dp N: the global batch is -B x ranks. The default
// generator is restored after the probe, so the run draws what it would have drawn without it.
LayoutCosts probe_layout_costs(models::CausalLM& probe, const nlohmann::json& config, const std::string& precision,
                               int64_t b, int64_t seq, Device dev, dist::ProcessGroup* pg, int world, bool with_sp) {
  LayoutCosts c;
  c.model = dist::measure_model(probe, b, seq, 3, pg);
  // Each tensor-parallel degree the planner may weigh, probed on a split copy of the model.
  int64_t tp_units = 0;
  for (const models::ShardSpec& spec : probe.tensor_parallel_plan())
    if (spec.units > 0) tp_units = std::gcd(tp_units, spec.units);
  for (int tp = 2; tp <= world && tp_units > 0; ++tp) {
    if (world % tp || tp_units % tp) continue;
    for (bool sp : {false, true}) {
      if (sp && (!with_sp || seq % tp)) continue;
      const std::unique_ptr<models::CausalLM> copy = models::build_model(config, 0);
      copy->to(dev);
      apply_precision(*copy, precision);
      dist::measure_split(c.model, *copy, tp, sp, b, 3, pg);
    }
  }
  if (pg) {
    dist::take_slowest(c.model, *pg, dev);
    c.link = dist::measure_link(*pg, dev, 21);
  }
  return c;
}

LayoutDecision decide_parallel(const TrainOptions& o, const dist::DistEnv& env,
                               std::unique_ptr<dist::TcpStore>& store_, std::ostream* log) {
  const double timeout_s = o.dist_timeout > 0 ? o.dist_timeout : env.dist_timeout_s;
  const auto ms = [&](double fallback_s) {
    return dist::Milliseconds(int64_t((timeout_s > 0 ? timeout_s : fallback_s) * 1000));
  };
  Device dev(o.device);
#ifdef BLU_HAVE_CUDA
  if (dev.is_cuda() && env.world_size > 1) dev = Device(DeviceType::cuda, env.local_rank);
  if (dev.is_cuda()) cuda::set_device(dev.index);
#endif
  std::shared_ptr<dist::ProcessGroup> probe_pg;
  if (env.world_size > 1) {
    store_ = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, env.rank == 0,
                                              dist::StoreOptions::from_env(ms(30)));
#ifdef BLU_HAVE_CUDA
    if (dev.is_cuda())
      probe_pg = dist::make_nccl_group(*store_, env.rank, env.world_size,
                                       dist::NcclOptions{.timeout = ms(600), .device = dev.index, .prefix = "probe"});
    else
#endif
      probe_pg = dist::make_gloo_group(*store_, env.rank, env.world_size,
                                       dist::GlooOptions{.timeout = ms(30), .hostname = "", .prefix = "probe"});
  }
  const Generator saved = default_generator();
  const std::unique_ptr<models::CausalLM> probe = models::build_model(o.model, 0);
  probe->to(dev);
  probe->train();
  apply_precision(*probe, o.precision);
  dist::ModelCosts costs;
  dist::LinkCosts link;
  if (o.parallel == "auto") {
    const LayoutCosts c = probe_layout_costs(*probe, o.model, o.precision, std::max<int64_t>(1, o.batch_size / 2),
                                             o.seq_len, dev, probe_pg.get(), env.world_size, false);
    costs = c.model;
    link = c.link;
  } else if (o.parallel.find("balance=time") != std::string::npos) {  // a block's and the edges' times
    costs = dist::measure_model(*probe, std::max<int64_t>(1, o.batch_size / 2), o.seq_len, 3, probe_pg.get());
    if (probe_pg) dist::take_slowest(costs, *probe_pg, dev);
  }
  const LayoutDecision d = decide_layout(o.parallel, *probe, costs, link, probe_pg.get(), store_.get(), env.rank,
                                         env.world_size, o.batch_size, o.seq_len,
                                         o.gpu_memory_budget * double(int64_t(1) << 30));
  default_generator() = saved;
  if (log && env.rank == 0) {
    if (o.parallel == "auto") {
      if (!d.probe_ms.empty()) {
        *log << "parallel auto: the ranks' probed step times";
        for (double t : d.probe_ms) *log << " " << t << " ms";
        *log << "\n";
      }
      *log << "parallel auto: the planner's fastest layouts for " << o.batch_size * env.world_size
               << " rows per step on " << env.world_size << " rank(s):\n";
      for (const auto& p : d.plan) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "  %9.2f ms  %9.1f MiB per rank%s  ", p["step_ms"].get<double>(),
                      p["memory_mib"].get<double>(), p["fits"].get<bool>() ? "" : " (over budget)");
        *log << buf << p["layout"].get<std::string>() << "\n";
      }
      *log << "parallel auto: training " << d.text << " with -B " << d.rows << "\n";
    } else {
      *log << "parallel: the probe measured step times of";
      for (double t : d.probe_ms) *log << " " << t << " ms";
      *log << ": training " << d.text << "\n";
    }
  }
  return d;
}

void check_layout_supported(const dist::Layout& l, const std::string& text, int64_t seq_len) {
  BLU_CHECK(l.pp > 1 || !is_pipelined(l) || (l.dp == 1 && l.tp == 1), "--parallel '", text,
            "': a pipeline of one stage runs alone (the pipeline's code path on one rank); inside replicate(...) or "
            "around a split it is not implemented — drop it and give its micro-batches as --grad-accum");
  BLU_CHECK(l.zero == 0 || (l.tp == 1 && l.pp == 1), "--parallel '", text, "': ZeRO-", l.zero,
            l.tp > 1 ? " over tensor-parallel replicas (replicate(zero=" : " over pipelined replicas (replicate(zero=",
            l.zero, ") of ", l.tp > 1 ? "split" : "pipeline", ") is not implemented");
  BLU_CHECK(!l.sequence_parallel || l.pp == 1, "--parallel '", text,
            "': sequence parallelism inside pipeline stages is not implemented (the stages send whole [B, T, C] "
            "activations); use split(n) in the stages");
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

void split_tensor_parallel(models::CausalLM& model, const dist::Layout& l, const dist::DeviceMesh& mesh,
                           const std::string& precision) {
  // Uneven widths cut every split by them (dist::apportion_units); equal ones are the even split.
  const bool even = std::all_of(l.tp_widths.begin(), l.tp_widths.end(),
                                [&](double w) { return std::abs(w - 1.0 / l.tp) < 1e-12; });
  dist::apply_tensor_parallel(
      model, mesh.group_ptr({"tp"}),
      dist::TPOptions{.sequence_parallel = l.sequence_parallel,
                      .widths = even ? std::vector<double>{} : l.tp_widths,
                      .row_chunks = l.tp_row_chunks});
  apply_precision(model, precision);  // the sharded modules take the compute dtype too
}

std::unique_ptr<dist::Strategy> make_layout_strategy(models::CausalLM& model, const dist::Layout& l,
                                                     const dist::DeviceMesh* mesh,
                                                     std::shared_ptr<dist::ProcessGroup> job, dist::StrategyConfig sc,
                                                     const dist::OptimizerConfig& oc, const std::string& precision,
                                                     std::shared_ptr<dist::ProcessGroup> pipeline_gradients) {
  const bool piped = is_pipelined(l);
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
    if (!dist::is_tensor_parallel(model)) split_tensor_parallel(model, l, *mesh, precision);
  }
  if (piped) {
    if (l.dp > 1) sc.dp = mesh->group_ptr({"dp"});
    sc.job = std::move(job);
    return std::make_unique<dist::Strategy>(model, mesh->group_ptr({"pp"}), pipeline, sc, oc);
  }
  return std::make_unique<dist::Strategy>(model, l.dp > 1 ? mesh->group_ptr({"dp"}) : nullptr, sc, oc);
}

Parallel parallelize(models::CausalLM& model, const std::string& text, int64_t rows, const dist::OptimizerConfig& oc,
                     const std::string& precision) {
  Parallel p;
  const dist::DistEnv env = dist::detect_env();
  BLU_CHECK(rows >= 1, "parallelize: expected a micro-batch of at least one row, got ", rows);
  if (!text.empty()) {
    BLU_CHECK(!needs_decision(text), "parallelize: '", text,
              "' asks for the planner or a probe (auto, weights=probe, widths=probe, balance=time): `blutrain train` "
              "and `bench` decide those and record the stated layout; pass that one");
    std::vector<std::string> names;
    for (const models::BlockRef& b : model.blocks()) names.push_back(b.name);
    p.layout = dist::resolve_layout(dist::parse_annotation(text), names, env.world_size);
    check_layout_supported(p.layout, text, 0);
  }
  const dist::Layout& l = p.layout;
  BLU_CHECK(rows % p.micro_batches() == 0, "parallelize: '", text, "' runs ", p.micro_batches(),
            " micro-batches a step; ", rows, " rows do not divide into them");
  const int64_t micro_rows = rows / p.micro_batches();
  const ReplicaRows split = replica_rows(l, micro_rows);
  const std::vector<int64_t>& per_replica = split.rows;
  const dist::DeviceMesh grid(env.rank, env.world_size, {{"dp", l.dp}, {"pp", l.pp}, {"tp", l.tp}});
  p.replica = grid.coordinate("dp");
  for (int r = 0; r < p.replica; ++r) p.first_row += per_replica[size_t(r)];
  p.rows = per_replica[size_t(p.replica)];
  dist::StrategyConfig sc;
  if (split.uneven) {
    sc.batch_share = double(p.rows) / double(micro_rows);
    sc.row_exchange = false;  // its gather takes the same number of ids from every rank
  }
  if (env.world_size == 1 && text.empty()) {
    p.strategy = std::make_unique<dist::Strategy>(model, nullptr, sc, oc);
    return p;
  }
  const Device dev = model.token_embedding().weight.device();
  if (env.world_size > 1) {
    p.store = std::make_unique<dist::TcpStore>(env.master_addr, env.master_port, env.rank == 0,
                                               dist::StoreOptions::from_env());
    p.groups = make_layout_groups(*p.store, env.rank, env.world_size, l, dev, 0);
  }
  p.strategy = make_layout_strategy(model, l, p.groups.mesh.get(), p.groups.job, sc, oc, precision,
                                    p.groups.pipeline_gradients);
  return p;
}

ReplicaRows replica_rows(const dist::Layout& l, int64_t rows) {
  const int dp = std::max(l.dp, 1);
  const bool uneven = std::any_of(l.replica_weights.begin(), l.replica_weights.end(),
                                  [&](double w) { return std::abs(w - 1.0 / dp) > 1e-12; });
  if (!uneven && rows % dp == 0) return {std::vector<int64_t>(size_t(dp), rows / dp), false};
  const std::vector<double> equal(size_t(dp), 1.0 / dp);
  return {dist::proportional_split(rows, l.replica_weights.empty() ? equal : l.replica_weights), true};
}

// --parallel: the layout resolved (every annotation error here, before anything runs) and mapped
// onto what the trainer drives: data parallelism (with ZeRO), a pipeline, tensor parallelism and
// their nestings; without it, --dp replicas (with --zero). Sets what the layout decides of the
// options (the rows of an auto or probed decision, dp, zero, a pipeline's accumulation).
dist::Layout Trainer::resolve_run_layout(const dist::DistEnv& env) {
  const TrainOptions& o = opt_s_;
  dist::Layout layout;
  if (!o.parallel.empty() && needs_decision(o.parallel)) {
    const LayoutDecision d = decide_parallel(o, env, store_, cb_.log);
    if (o.parallel == "auto" && !d.plan.empty()) auto_prediction_ = d.plan[0];
    opt_s_.parallel = d.text;
    opt_s_.batch_size = d.rows;
  }
  if (!o.parallel.empty()) {
    std::vector<std::string> names;
    for (const models::BlockRef& b : model_->blocks()) names.push_back(b.name);
    layout = dist::resolve_layout(dist::parse_annotation(o.parallel), names, env.world_size);
    const dist::Layout& l = layout;
    BLU_CHECK(o.dp == 1 || o.dp == l.dp, "--parallel '", o.parallel, "' gives ", l.dp, " replicas, --dp says ", o.dp,
              ": give one of the two");
    BLU_CHECK(o.zero == 0 || o.zero == l.zero, "--parallel '", o.parallel, "' asks for ZeRO-", l.zero,
              ", --zero says ", o.zero, ": give one of the two");
    check_layout_supported(l, o.parallel, o.seq_len);
    BLU_CHECK((l.tp == 1 && !is_pipelined(l)) || !o.offload_state.starts_with("master"), "--parallel '", o.parallel, "': --offload-state ",
              o.offload_state, " is implemented for data parallelism; use --offload-state optimizer");
    if (is_pipelined(l)) {
      BLU_CHECK(o.grad_accum == 1 || o.grad_accum == l.micro_batches, "--parallel '", o.parallel,
                "': a pipeline's micro=", l.micro_batches, " is its accumulation; drop --grad-accum ", o.grad_accum);
      pipelined_ = true;
      opt_s_.grad_accum = l.micro_batches;  // the tokens of a step, as the header and metrics count them
    }
    opt_s_.dp = l.dp;
    opt_s_.zero = l.zero;
    // Every layout checkpoints (dist/layout_checkpoint.h); --keep-best copies a single file.
    BLU_CHECK(!o.keep_best || (l.tp == 1 && !is_pipelined(l)), "--parallel '", o.parallel,
              "': --keep-best keeps a single-file checkpoint, and this layout writes a checkpoint directory");
    layout_text_ = l.describe();
  } else {
    layout.dp = int(o.dp);
    layout.zero = o.zero;
    layout.replica_weights.assign(size_t(o.dp), 1.0 / double(o.dp));
  }
  return layout;
}

}  // namespace blu::train
