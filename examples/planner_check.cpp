// examples/planner_check: the planner's predictions (dist/planner.h) against measured step times and
// memory, for every layout that two CPU ranks run — single process, DDP, ZeRO-1/2/3, pipelines
// (1F1B, GPipe), tensor parallelism with and without sequence parallelism.
// Usage: blutrain launch -n 2 -- planner_check [MODEL] [GLOBAL_BATCH] [T] [STEPS]
//   (defaults: llama:tiny 8 64 6; MODEL may be a Hugging Face config folder such as
//   examples/planner_llama). Rank 0 prints one line per layout and the median errors.
// The costs are measured by both ranks in lockstep (rank 0's are used) at micro-batch sizes B/4
// and B/2 — split(2)'s on a copy split over a stand-in group (measure_split) —, then the link;
// each layout then trains STEPS steps (after two warm-up steps) from the same initial weights: the
// step time is the median, the memory the largest allocator peak over the ranks, from the
// layout's set-up on, above what the rank held before it built the model.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "blu/blu.h"
#include "blu/dist/annotations.h"
#include "blu/dist/env.h"
#include "blu/dist/pipeline.h"
#include "blu/dist/planner.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/memory/allocator.h"
#include "blu/models/registry.h"

using namespace blu;
using namespace blu::dist;

namespace {

struct Measured {
  double step_s = 0, memory = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs `layout_text` on the ranks it needs (the others wait) and returns rank 0's view of the
// slowest rank's median step and the largest memory peak.
Measured run_layout(const std::string& spec, const std::string& text, ProcessGroup& world, TcpStore& store,
                    int64_t global_batch, int64_t T, int steps, int& group_id) {
  const int rank = world.rank();
  std::vector<std::string> names;
  {
    auto probe = models::build_model(models::resolve_model_config(spec), 1);
    for (const auto& b : probe->blocks()) names.push_back(b.name);
  }
  const Layout l = resolve_layout(parse_annotation(text), names, 0);
  const int need = l.world_size();
  Allocator& alloc = allocator_for(kCPU);
  Measured m;
  std::vector<double> out(2, 0.0);
  const std::string prefix = "check" + std::to_string(group_id++);
  if (rank < need) try {
    const int64_t base = alloc.stats().current_bytes;
    alloc.reset_peak();
    auto model = models::build_model(models::resolve_model_config(spec), 1);
    std::shared_ptr<ProcessGroup> pg;
    if (need > 1) pg = make_gloo_group(store, rank, need, GlooOptions{.timeout = std::chrono::milliseconds(60000), .prefix = prefix});
    StrategyConfig sc;
    OptimizerConfig oc{.lr = 1e-4};
    std::unique_ptr<Strategy> s;
    const bool piped = l.pp > 1;
    const int64_t micro = piped ? l.micro_batches : 1;
    const int64_t rows = global_batch / l.dp / micro;  // sequences per micro-batch on this rank
    if (piped) {
      PipelineOptions po;
      po.schedule = l.schedule == Schedule::gpipe ? PipelineScheduleKind::gpipe : PipelineScheduleKind::one_f_one_b;
      po.micro_batches = micro;
      s = std::make_unique<Strategy>(*model, pg, po, sc, oc);
    } else if (l.tp > 1) {
      apply_tensor_parallel(*model, pg, TPOptions{.sequence_parallel = l.sequence_parallel});
      sc.tp = pg;
      s = std::make_unique<Strategy>(*model, nullptr, sc, oc);
    } else {
      sc.zero = l.zero;
      s = std::make_unique<Strategy>(*model, pg, sc, oc);
    }
    // What the rank holds from here on: building the whole model before a pipeline stage gives the
    // other stages' parameters back is a start-up transient, not the step's memory.
    alloc.reset_peak();
    Generator gen(7);
    const Tensor idx = randint(0, model->vocab_size(), {rows, T}, DType::i64, kCPU, &gen);
    std::vector<double> times;
    for (int i = -2; i < steps; ++i) {
      if (pg) pg->barrier()->wait();
      const auto t0 = std::chrono::steady_clock::now();
      StepValues v = piped ? s->step(micro, [&](int64_t) { return std::make_pair(idx, idx); }, 1e-4, 1.0)
                           : s->step(1, [&](int64_t) { return model->forward(idx, idx).loss; }, 1e-4, 1.0);
      (void)s->read(v, false);
      if (i >= 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    out = {median(times), double(alloc.stats().peak_bytes - base)};
  } catch (const Error& e) {  // a layout the model does not admit: every rank refuses it alike
    if (rank == 0) std::printf("%-38s refused: %s\n", text.c_str(), e.what());
    out = {-1.0, -1.0};
  }
  Tensor t = from_vector(out, {2}, DType::f64);
  world.all_reduce(t, ReduceOp::max)->wait();
  const std::vector<double> r = to_vector(t);
  m.step_s = r[0], m.memory = r[1];
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string spec = argc > 1 ? argv[1] : "llama:tiny";
  const int64_t B = argc > 2 ? std::stoll(argv[2]) : 8, T = argc > 3 ? std::stoll(argv[3]) : 64;
  const int steps = argc > 4 ? std::stoi(argv[4]) : 6;
  const DistEnv env = detect_env();
  if (env.world_size != 2) {
    std::cerr << "planner_check: run as two ranks: blutrain launch -n 2 -- planner_check ...\n";
    return 2;
  }
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, std::chrono::milliseconds(30000));
  auto world = make_gloo_group(store, env.rank, 2, GlooOptions{.timeout = std::chrono::milliseconds(120000)});
  // Costs on both ranks at once and in lockstep, as `train --parallel auto` probes them: the
  // layouts run two ranks on the machine's cores together, and a probe alone would have them to
  // itself (on this 2-core machine 15-20% faster). Rank 0's are used; then the link.
  ModelCosts costs;
  auto model = models::build_model(models::resolve_model_config(spec), 1);
  std::vector<std::string> names;
  for (const auto& b : model->blocks()) names.push_back(b.name);
  const int64_t b = std::max<int64_t>(1, B / 4);  // b and 2b: the micro-batches the layouts run
  costs = measure_model(*model, b, T, 5, world.get());
  for (bool sp : {false, true}) {  // split(2)'s rank, probed on a split copy
    auto copy = models::build_model(models::resolve_model_config(spec), 1);
    try {
      measure_split(costs, *copy, 2, sp, b, 5, world.get());
    } catch (const Error& e) {  // the model does not split in two: its split layouts are refused below
      if (env.rank == 0) std::printf("no split(2) probe: %s\n", e.what());
      break;
    }
  }
  world->barrier()->wait();
  const LinkCosts link = measure_link(*world, kCPU, 101);
  model.reset();

  const std::vector<std::string> layouts = {
      "replicate(1)",           "replicate(2)",          "replicate(2, zero=1)",
      "replicate(2, zero=2)",   "replicate(2, zero=3)",  "pipeline(2, schedule=1f1b, micro=2)",
      "pipeline(2, schedule=1f1b, micro=4)", "pipeline(2, schedule=gpipe, micro=4)", "split(2)",
      "split(2, sp=true)"};
  int group_id = 0;
  std::vector<double> time_err, mem_err;
  if (env.rank == 0) {
    std::printf("model %s, global batch %lld x T %lld, %d steps; link %.1f us + %.2f GB/s\n", spec.c_str(),
                (long long)B, (long long)T, steps, link.latency_s * 1e6, link.bytes_per_s / 1e9);
    std::printf("%-38s %10s %10s %7s %10s %10s %7s\n", "layout", "pred ms", "meas ms", "err", "pred MiB", "meas MiB",
                "err");
  }
  for (const std::string& text : layouts) {
    const Measured got = run_layout(spec, text, *world, store, B, T, steps, group_id);
    if (env.rank != 0 || got.step_s < 0) continue;
    const Layout l = resolve_layout(parse_annotation(text), names, 0);
    PlanJob job;
    job.world = l.world_size();
    job.batch = B;
    const Prediction p = predict(l, costs, link, job);
    const double te = (p.step_s - got.step_s) / got.step_s, me = (p.memory_bytes - got.memory) / got.memory;
    time_err.push_back(std::abs(te));
    mem_err.push_back(std::abs(me));
    std::printf("%-38s %10.2f %10.2f %+6.0f%% %10.2f %10.2f %+6.0f%%\n", text.c_str(), p.step_s * 1e3,
                got.step_s * 1e3, te * 100, p.memory_bytes / 1048576.0, got.memory / 1048576.0, me * 100);
  }
  if (env.rank == 0)
    std::printf("median |error|: step time %.0f%%, memory per rank %.0f%%\n", median(time_err) * 100,
                median(mem_err) * 100);
  return 0;
}
