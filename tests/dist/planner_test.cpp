// The planner's cost model (dist/planner.h): predictions follow the formulas the header states
// (bubble, sharding, in-flight micro-batches), every candidate's annotation text resolves back to
// its layout, and the probe's activation bytes predict a single-device step's memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "blu/blu.h"
#include "blu/dist/planner.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/memory/allocator.h"
#include "blu/models/registry.h"
#include "dist_test_util.h"

namespace blu::dist {
namespace {

ModelCosts costs() {
  ModelCosts m;
  m.blocks = 8, m.seq_len = 64, m.width = 32;
  m.block_params = 1000, m.other_params = 4000, m.first_params = 2500, m.last_params = 2500;
  m.block_fixed_s = 0.001, m.block_per_seq_s = 0.002;
  m.other_fixed_s = 0.004, m.other_per_seq_s = 0.003;
  m.update_per_param_s = 1e-6;
  m.block_act_bytes = 5000, m.other_act_bytes = 20000;
  return m;
}

std::vector<std::string> names(int n) {
  std::vector<std::string> v;
  for (int i = 0; i < n; ++i) v.push_back("h." + std::to_string(i));
  return v;
}

Layout resolved(const std::string& text, int world) { return resolve_layout(parse_annotation(text), names(8), world); }

TEST(Planner, SingleDeviceIsTheMeasuredParts) {
  const ModelCosts m = costs();
  PlanJob job;
  job.batch = 4, job.grad_accum = 2;
  const Prediction p = predict(resolved("replicate(1)", 1), m, LinkCosts{}, job);
  const double b = 2;  // 4 sequences in 2 micro-batches
  const double micro = 8 * (0.001 + 0.002 * b) + (0.004 + 0.003 * b);
  EXPECT_DOUBLE_EQ(p.compute_s, 2 * micro);
  EXPECT_DOUBLE_EQ(p.update_s, 12000 * 1e-6);
  EXPECT_DOUBLE_EQ(p.step_s, 2 * micro + 12000 * 1e-6);
  EXPECT_EQ(p.bubble_s, 0);
  EXPECT_DOUBLE_EQ(p.state_bytes, 12000 * (4 + 4 + 8));
  EXPECT_DOUBLE_EQ(p.activation_bytes, b * (8 * 5000 + 20000));
  EXPECT_DOUBLE_EQ(p.memory_bytes, p.state_bytes + p.activation_bytes + m.largest_param * 4)
      << "every gradient held through both micro-batches, the largest twice";
}

// One micro-batch on one process: the step starts without gradients (the previous step dropped
// them), so the peak is the state without them plus the larger of the activations with the head's
// gradient (the backward's first) and every gradient (its end).
TEST(Planner, OneMicroBatchHoldsTheGradientsOnlyAsBackwardMakesThem) {
  ModelCosts m = costs();
  PlanJob job;
  job.batch = 4;
  const Prediction p = predict(resolved("replicate(1)", 1), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(p.state_bytes, 12000 * (4 + 8));
  EXPECT_DOUBLE_EQ(p.activation_bytes, 4 * (8 * 5000 + 20000));
  EXPECT_DOUBLE_EQ(p.memory_bytes, p.state_bytes + p.activation_bytes + 2500 * 4);
  job.batch = 1;
  m.block_act_bytes = 100, m.other_act_bytes = 200;  // 1000 bytes of activations: every gradient (48000) outweighs them
  const Prediction small = predict(resolved("replicate(1)", 1), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(small.memory_bytes, 12000 * (4 + 8) + 12000 * 4);
}

// Unequal ranks (PlanJob::rank_speeds, the costs the slowest rank's): an even layout runs at its
// slowest replica's pace; plan() adds the replicas weighted by their speeds, whose text states the
// weights, whose compute follows the rows each replica gets at its speed, and which it ranks
// first. Speeds closer than kUnequalSpeeds add nothing.
TEST(Planner, UnequalRanksGetWeightedReplicas) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 2, job.batch = 10;
  job.rank_speeds = {4.0, 1.0};  // rank 0 four times rank 1's speed
  const Prediction even = predict(resolved("replicate(2)", 2), m, LinkCosts{}, job);
  // Each replica 5 rows; rank 1 (the costs' speed) bounds the step.
  EXPECT_DOUBLE_EQ(even.compute_s, 8 * (0.001 + 0.002 * 5) + (0.004 + 0.003 * 5));
  const std::vector<Prediction> ranked = plan(m, LinkCosts{}, job, names(8), 8, 8, 64);
  const auto weighted = std::find_if(ranked.begin(), ranked.end(),
                                     [](const Prediction& p) { return p.text == "replicate(2, weights=[0.8,0.2])"; });
  ASSERT_NE(weighted, ranked.end());
  // Rows 8 and 2 (dist::proportional_split): rank 0's 8 at four times the speed take what 2 take
  // on rank 1.
  EXPECT_DOUBLE_EQ(weighted->compute_s, 8 * (0.001 + 0.002 * 2) + (0.004 + 0.003 * 2));
  EXPECT_NE(ranked.front().text.find("weights=[0.8,0.2]"), std::string::npos) << ranked.front().text;
  EXPECT_LT(ranked.front().step_s, even.step_s);
  const Layout back = resolved(weighted->text, 2);
  EXPECT_NEAR(back.replica_weights[0], 0.8, 1e-12);
  // Within the noise: no weighted layout.
  job.rank_speeds = {1.4, 1.0};
  for (const Prediction& p : plan(m, LinkCosts{}, job, names(8), 8, 8, 64))
    EXPECT_EQ(p.text.find("weights="), std::string::npos) << p.text;
}

// Unequal ranks under tensor parallelism: a split rank takes its share of the work at its speed, so
// even widths run at the slower rank's half; plan() adds the split with widths by the positions'
// speeds (heads apportioned: 0.8/0.2 of 8 heads is 6/2), whose text states them and whose compute
// follows the widest share over its speed. Over replicas and stages a position's pace is its
// slowest rank's.
TEST(Planner, UnequalRanksGetWeightedSplitWidths) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 2, job.batch = 10;
  job.rank_speeds = {4.0, 1.0};
  const Prediction even = predict(resolved("split(2)", 2), m, LinkCosts{}, job);
  // Rank 1 (the costs' speed) holds half the work of 10 rows: 5 rows' worth.
  EXPECT_DOUBLE_EQ(even.compute_s, 8 * (0.001 + 0.002 * 5) + (0.004 + 0.003 * 5));
  const std::vector<Prediction> ranked = plan(m, LinkCosts{}, job, names(8), 8, 8, 64);
  const auto weighted = std::find_if(ranked.begin(), ranked.end(),
                                     [](const Prediction& p) { return p.text == "split(2, widths=[0.75,0.25])"; });
  ASSERT_NE(weighted, ranked.end());
  // Rank 0's 0.75 at four times the speed takes 0.1875 of the work's time, rank 1's 0.25 bounds it.
  EXPECT_DOUBLE_EQ(weighted->compute_s, 8 * (0.001 + 0.002 * 2.5) + (0.004 + 0.003 * 2.5));
  EXPECT_LT(weighted->step_s, even.step_s);
  const Layout back = resolved(weighted->text, 2);
  EXPECT_EQ(apportion_units(8, 1, back.tp_widths), (std::vector<int64_t>{6, 2}));
  // The same speeds predicted on a layout stated by hand.
  EXPECT_DOUBLE_EQ(predict(back, m, LinkCosts{}, job).compute_s, weighted->compute_s);
  // The widest rank holds 0.75 of the split parameters and activations, not half.
  EXPECT_DOUBLE_EQ(weighted->state_bytes, 1.5 * even.state_bytes);
  EXPECT_DOUBLE_EQ(weighted->activation_bytes, 1.5 * even.activation_bytes);
  // Two replicas of split(2): position 0 is ranks 0 and 2, position 1 ranks 1 and 3; the slower of
  // each pair sets its pace (2 and 1: 0.67/0.33 of 8 heads is 5/3).
  job.world = 4;
  job.rank_speeds = {2.0, 1.0, 6.0, 3.0};
  bool found = false;
  for (const Prediction& p : plan(m, LinkCosts{}, job, names(8), 8, 8, 64))
    found |= p.text == "replicate(2) { split(2, widths=[0.625,0.375]) }";
  EXPECT_TRUE(found);
  // Within the noise: no uneven widths (8 heads divide evenly).
  job.world = 2;
  job.rank_speeds = {1.4, 1.0};
  for (const Prediction& p : plan(m, LinkCosts{}, job, names(8), 8, 8, 64))
    EXPECT_EQ(p.text.find("widths="), std::string::npos) << p.text;
}

TEST(Planner, PipelineBubbleAndInFlightMicroBatches) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 2, job.batch = 8;
  const Prediction f = predict(resolved("pipeline(2, schedule=1f1b, micro=4)", 2), m, LinkCosts{}, job);
  const Prediction g = predict(resolved("pipeline(2, schedule=gpipe, micro=4)", 2), m, LinkCosts{}, job);
  const Prediction i = predict(resolved("pipeline(2, schedule=interleaved, micro=4)", 2), m, LinkCosts{}, job);
  EXPECT_GT(f.bubble_s, 0);
  EXPECT_DOUBLE_EQ(f.bubble_s, g.bubble_s);              // the same idle slots
  EXPECT_NEAR(i.bubble_s, f.bubble_s / 2, 1e-12);        // two chunks halve them
  // Per sequence a stage's 4 blocks keep 4 · 5000 bytes, the last stage's head 20000 more. Rank 0
  // keeps pp = 2 micro-batches of its blocks under 1F1B, all 4 under GPipe; the last stage one of
  // its blocks and the head under either (message-driven, it runs each backward at once). Two
  // sequences per micro-batch.
  const double b = 2;
  EXPECT_DOUBLE_EQ(f.activation_bytes, std::max(2 * b * 4 * 5000, 1 * b * (4 * 5000 + 20000)));
  EXPECT_DOUBLE_EQ(g.activation_bytes, std::max(4 * b * 4 * 5000, 1 * b * (4 * 5000 + 20000)));
}

// A tied embedding/head weight: the first and the last stage each receive the other's part of its
// gradient after the backward, so an end stage holds its state plus the larger of its activations
// and that buffer; without a pipeline there is no exchange. With several micro-batches the
// largest parameter's gradient is also made apart before it is accumulated (not under ZeRO-3,
// which reduces each micro-batch's).
TEST(Planner, TiedWeightExchangeAndAccumulationBuffers) {
  ModelCosts m = costs();
  m.tied_params = 2000;
  PlanJob job;
  job.world = 2, job.batch = 8;
  const Prediction untied = predict(resolved("pipeline(2, schedule=1f1b, micro=4)", 2), costs(), LinkCosts{}, job);
  const Prediction tied = predict(resolved("pipeline(2, schedule=1f1b, micro=4)", 2), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(tied.memory_bytes, tied.state_bytes + std::max(tied.activation_bytes, 2000.0 * 4));
  EXPECT_DOUBLE_EQ(untied.memory_bytes, untied.state_bytes + untied.activation_bytes);
  m.tied_params = 1e6;  // the exchange outweighs the activations
  const Prediction big = predict(resolved("pipeline(2, schedule=1f1b, micro=4)", 2), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(big.memory_bytes, big.state_bytes + 4e6);
  EXPECT_DOUBLE_EQ(predict(resolved("replicate(2)", 2), m, LinkCosts{}, job).memory_bytes,
                   predict(resolved("replicate(2)", 2), costs(), LinkCosts{}, job).memory_bytes);
  m.tied_params = 0;
  m.largest_param = 3000;
  const Prediction acc = predict(resolved("pipeline(2, schedule=1f1b, micro=4)", 2), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(acc.memory_bytes, acc.state_bytes + acc.activation_bytes + 3000.0 * 4);
  job.grad_accum = 2;
  const Prediction z3 = predict(resolved("replicate(2, zero=3)", 2), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(z3.memory_bytes, z3.state_bytes + z3.activation_bytes);
  const Prediction ddp = predict(resolved("replicate(2)", 2), m, LinkCosts{}, job);
  EXPECT_DOUBLE_EQ(ddp.memory_bytes, ddp.state_bytes + ddp.activation_bytes + 3000.0 * 4);
}

TEST(Planner, ShardingShrinksState) {
  ModelCosts m = costs();
  m.largest_param = 3000;
  PlanJob job;
  job.world = 4, job.batch = 8;
  const auto state = [&](int z, const ModelCosts& c) {
    return predict(resolved("replicate(4, zero=" + std::to_string(z) + ")", 4), c, LinkCosts{}, job).state_bytes;
  };
  EXPECT_LT(state(1, m), state(0, m));
  // ZeRO-2 keeps a quarter of the gradients and stages up to three 25 MiB buckets of the rest (the
  // largest parameter, alone in its bucket, reduces from its own gradient): for a model this small
  // that is more than ZeRO-1 holds ...
  EXPECT_DOUBLE_EQ(state(2, m), state(1, m) - 12000.0 * 4 * 3 / 4 + 4 * (12000.0 - 3000));
  // ... and less once the gradients fill more than three buckets.
  ModelCosts big = m;
  big.block_params = 4e6;
  EXPECT_LT(state(2, big), state(1, big));
  EXPECT_DOUBLE_EQ(state(2, big), state(1, big) - (8 * 4e6 + 4000) * 4 * 3 / 4 + 3 * 25.0 * 1048576);
  // ZeRO-3 shards the parameters too, and gathers units: at the head's backward the rest (4000
  // parameters and their whole gradient buffer) and the last block prefetched; in a block's
  // backward the rest's gradient buffer, two blocks gathered and three blocks' gradient buffers.
  EXPECT_DOUBLE_EQ(state(3, m), 12000.0 * 16 / 4 + std::max(4000.0 * 8 + 1000.0 * 4, 4000.0 * 4 + 1000.0 * (8 + 12)));
  // Tensor parallelism alone: each rank a quarter, its gradients made by its backward (one
  // micro-batch, no data-parallel bucket), so not in the state.
  const Prediction tp = predict(resolved("split(4)", 4), m, LinkCosts{1e-5, 1e9}, job);
  EXPECT_DOUBLE_EQ(tp.state_bytes, 12000.0 / 4 * 12);
  EXPECT_GT(tp.tp_comm_s, 0);
}

// DDP's all-reduce beside backward: on a link that overlaps compute only the part longer than the
// last micro-batch's backward (2/3 of its forward + backward) stays on the step, never less than
// one bucket's; a link that does not (CPU ranks) charges it in full; ZeRO-1 is not overlapped.
TEST(Planner, DdpHidesItsAllReduceBehindBackwardWhereTheLinkOverlaps) {
  ModelCosts m = costs();
  m.block_params = 2e6, m.other_params = 4e6;  // 80 MB of fp32 gradients: several buckets
  PlanJob job;
  job.world = 2, job.batch = 8;
  const LinkCosts cpu{1e-5, 1e9, false}, gpu{1e-5, 1e9, true};
  const Prediction full = predict(resolved("replicate(2)", 2), m, cpu, job);
  const Prediction hidden = predict(resolved("replicate(2)", 2), m, gpu, job);
  const double ring = 2 * 1e-5 + 20e6 * 4 / 1e9;  // two ranks: 2(n-1)·lat + 2(n-1)/n · bytes / bw
  EXPECT_NEAR(full.dp_comm_s, ring, 1e-12);
  const double slot = 8 * (0.001 + 0.002 * 4) + (0.004 + 0.003 * 4);
  const double bucket = 2 * 1e-5 + 25.0 * 1048576 / 1e9;
  EXPECT_NEAR(hidden.dp_comm_s, std::max(bucket, ring - 2.0 / 3.0 * slot), 1e-12);
  EXPECT_LT(hidden.step_s, full.step_s);
  m.block_per_seq_s = 1e-6, m.other_per_seq_s = 1e-6, m.block_fixed_s = 1e-6, m.other_fixed_s = 1e-6;
  EXPECT_NEAR(predict(resolved("replicate(2)", 2), m, gpu, job).dp_comm_s, ring - 2.0 / 3.0 * (9 * (1e-6 + 4e-6)),
              1e-12);  // a short backward hides little
  EXPECT_DOUBLE_EQ(predict(resolved("replicate(2, zero=1)", 2), m, gpu, job).dp_comm_s,
                   predict(resolved("replicate(2, zero=1)", 2), m, cpu, job).dp_comm_s);
}

// A split's collectives started early run beside the weight-gradient GEMM where the link
// overlaps compute: per block, min(early · ring, a sixth of the block's time) leaves the step.
TEST(Planner, EarlyTensorParallelCollectivesHideWhereTheLinkOverlaps) {
  ModelCosts m = costs();
  m.splits.push_back({.tp = 2, .block_fixed_s = 0.0005, .block_per_seq_s = 0.001, .other_fixed_s = 0.002,
                      .other_per_seq_s = 0.0015, .early_per_block = 2});
  PlanJob job;
  job.world = 2, job.batch = 4;
  const LinkCosts cpu{1e-5, 1e9, false}, gpu{1e-5, 1e9, true};
  const Prediction full = predict(resolved("split(2)", 2), m, cpu, job);
  const Prediction hidden = predict(resolved("split(2)", 2), m, gpu, job);
  const double ring = 2 * 1e-5 + 4.0 * 64 * 32 * 4 / 1e9;  // [4, 64, 32] f32 over two ranks
  const double block_t = 0.0005 + 0.001 * 4;
  EXPECT_NEAR(full.tp_comm_s - hidden.tp_comm_s, 8 * std::min(2 * ring, block_t / 6), 1e-12);
  EXPECT_NEAR(full.step_s - hidden.step_s, full.tp_comm_s - hidden.tp_comm_s, 1e-12);
  m.splits[0].block_fixed_s = 0, m.splits[0].block_per_seq_s = 1e-5;  // a short block hides at most its sixth
  EXPECT_NEAR(predict(resolved("split(2)", 2), m, cpu, job).tp_comm_s - predict(resolved("split(2)", 2), m, gpu, job).tp_comm_s,
              8 * 4e-5 / 6, 1e-12);
  m.splits[0].early_per_block = 0;  // no early collective (Llama's shared inputs): nothing hidden
  EXPECT_DOUBLE_EQ(predict(resolved("split(2)", 2), m, gpu, job).tp_comm_s, full.tp_comm_s);
}

// Row pieces (split's row_chunks): each of a block's two forward collectives becomes k of a k-th
// of the bytes — k − 1 more latencies — and where the link overlaps compute the first k − 1 run
// beside the next piece's GEMM, up to (k − 1)/k of a row linear's forward (a fourteenth of the
// block's forward + backward).
TEST(Planner, RowPiecesHideForwardCollectivesWhereTheLinkOverlaps) {
  ModelCosts m = costs();
  m.splits.push_back({.tp = 2, .block_fixed_s = 0.0005, .block_per_seq_s = 0.001, .other_fixed_s = 0.002,
                      .other_per_seq_s = 0.0015});
  PlanJob job;
  job.world = 2, job.batch = 4;
  const LinkCosts cpu{1e-5, 1e9, false}, gpu{1e-5, 1e9, true};
  const double bytes = 64 * 32 * 4 * 4.0;  // [4, 64, 32] f32
  const auto ring = [](double b) { return 2 * 1e-5 + b / 1e9; };  // over two ranks
  const double block_t = 0.0005 + 0.001 * 4;
  const Prediction one = predict(resolved("split(2)", 2), m, cpu, job);
  const Prediction four = predict(resolved("split(2, row_chunks=4)", 2), m, cpu, job);
  EXPECT_NEAR(four.tp_comm_s - one.tp_comm_s, 8 * 2 * (4 * ring(bytes / 4) - ring(bytes)), 1e-12);
  EXPECT_NEAR(four.tp_comm_s - one.tp_comm_s, 8 * 2 * 3 * 2e-5, 1e-12);  // only the latencies
  const Prediction gpu_one = predict(resolved("split(2)", 2), m, gpu, job);
  const Prediction gpu_four = predict(resolved("split(2, row_chunks=4)", 2), m, gpu, job);
  const double hidden = std::min(3 * ring(bytes / 4), 0.75 * block_t / 14);
  EXPECT_NEAR(gpu_four.tp_comm_s - gpu_one.tp_comm_s, 8 * 2 * (4 * ring(bytes / 4) - ring(bytes) - hidden), 1e-12);
  EXPECT_LT(gpu_four.step_s, gpu_one.step_s);  // here the bytes outweigh the latencies
  EXPECT_NEAR(gpu_one.step_s - gpu_four.step_s, gpu_one.tp_comm_s - gpu_four.tp_comm_s, 1e-12);
}

TEST(Planner, CandidatesResolveBackToTheirLayouts) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 4, job.batch = 16;
  const auto all = plan(m, LinkCosts{1e-5, 1e9}, job, names(8), /*heads=*/4, /*kv_heads=*/2, /*vocab=*/64);
  ASSERT_GT(all.size(), 10u);
  bool saw_tp = false, saw_pp = false, saw_hybrid = false;
  for (const Prediction& p : all) {
    const Layout l = resolve_layout(parse_annotation(p.text), names(8), 4);
    EXPECT_EQ(l.describe(), p.layout.describe()) << p.text;
    EXPECT_EQ(l.stage_blocks, p.layout.stage_blocks) << p.text;
    saw_tp |= l.tp > 1, saw_pp |= l.pp > 1, saw_hybrid |= l.dp > 1 && l.pp > 1;
    EXPECT_TRUE(l.zero == 0 || (l.tp == 1 && l.pp == 1)) << p.text << ": ZeRO over TP or pipelined replicas";
  }
  EXPECT_TRUE(saw_tp && saw_pp && saw_hybrid);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_LE(all[i - 1].step_s, all[i].step_s);
  // A budget below every layout's memory puts none first as fitting.
  job.memory_budget = 1;
  for (const Prediction& p : plan(m, LinkCosts{}, job, names(8), 4, 2, 64)) EXPECT_FALSE(p.fits);
}

// Heads the degree does not divide (GPT-2 d48's 25 over 2): the split is a candidate with the
// heads apportioned as evenly as they go, its widths in the text, and it resolves back.
TEST(Planner, IndivisibleHeadsGiveUnevenSplitCandidates) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 2, job.batch = 8;
  const auto all = plan(m, LinkCosts{1e-5, 1e9}, job, names(8), /*heads=*/25, /*kv_heads=*/25, /*vocab=*/64);
  int uneven = 0;
  for (const Prediction& p : all) {
    const Layout l = resolve_layout(parse_annotation(p.text), names(8), 2);
    EXPECT_EQ(l.describe(), p.layout.describe()) << p.text;
    if (l.tp != 2) continue;
    ++uneven;
    EXPECT_EQ(p.text, "split(2, widths=[0.52,0.48])");
    EXPECT_EQ(apportion_units(25, 1, l.tp_widths), (std::vector<int64_t>{13, 12}));
  }
  EXPECT_EQ(uneven, 1);
  // Fewer key-value heads than ranks: no split.
  for (const Prediction& p : plan(m, LinkCosts{}, job, names(8), 3, 1, 64)) EXPECT_EQ(p.layout.tp, 1) << p.text;
}

// Under `--parallel auto` every rank probes and keeps each time's slowest value over the ranks.
TEST(Planner, EveryRankTakesTheSlowestRanksTimes) {
  const test::LaunchResult r = test::run_workers("slowest_costs", 3);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

// The probe's bytes per sequence predict what a training step at another batch size keeps.
TEST(Planner, ProbePredictsActivationMemory) {
  auto model = models::build_model(models::resolve_model_config("llama:tiny"), 1);
  const ModelCosts m = measure_model(*model, 1, 16, 1);
  EXPECT_GT(m.block_act_bytes, 0);
  EXPECT_GT(m.other_act_bytes, 0);
  EXPECT_GT(m.block_per_seq_s + m.block_fixed_s, 0);
  EXPECT_GT(m.update_per_param_s, 0);
  EXPECT_EQ(m.blocks, 2);
  Allocator& a = allocator_for(kCPU);
  const int64_t B = 5;
  const Tensor idx = randint(0, model->vocab_size(), {B, 16});
  const int64_t before = a.stats().current_bytes;
  Tensor loss = model->forward(idx, idx).loss;
  const double kept = double(a.stats().current_bytes - before);
  loss.backward();
  // Per sequence, and per micro-batch: llama:tiny's blocks save their concatenated sibling weights
  // (Note [Sibling linears]), the same bytes at any batch size.
  EXPECT_GT(m.block_act_fixed_bytes, 0);
  const double predicted =
      double(B) * (2 * m.block_act_bytes + m.other_act_bytes) + 2 * m.block_act_fixed_bytes + m.other_act_fixed_bytes;
  EXPECT_NEAR(predicted / kept, 1.0, 0.10) << "predicted " << predicted << " bytes, kept " << kept;
}

// Under mixed precision the state counts the compute copies the model keeps, which the probe's
// forwards made: every parameter a forward casts has one (Llama's q/k/v, gate and up as rows of one
// buffer, Note [Sibling linears]); the embeddings gathered in fp32 (GPT-2's positions, Llama's
// untied tokens) have none.
TEST(Planner, ComputeCopyBytesAreTheCopiesKept) {
  const std::map<std::string, std::vector<std::string>> uncast = {{"gpt2:tiny", {"wpe."}},
                                                                   {"llama:tiny", {"embed_tokens."}}};
  for (const auto& [spec, names] : uncast) {
    SCOPED_TRACE(spec);
    auto model = models::build_model(models::resolve_model_config(spec), 1);
    model->set_compute_dtype(DType::bf16);
    const ModelCosts m = measure_model(*model, 1, 16, 1);
    double with_copy = 0;
    for (const auto& [name, p] : model->named_parameters()) {
      bool expected = true;
      for (const std::string& n : names) expected = expected && name.find(n) == std::string::npos;
      bool has = false;
      for (const auto& [param, copy] : model->compute_copies())
        if (param.is_same(p)) has = copy->tensor().defined();
      EXPECT_EQ(has, expected) << name;
      if (has) with_copy += double(p.numel());
    }
    EXPECT_DOUBLE_EQ(m.compute_copy_bytes, 2.0 * with_copy / double(model->num_parameters()));
    EXPECT_LT(m.compute_copy_bytes, 2.0);
  }
}

// One rank's share of split(2), probed on a copy split over the stand-in group: its blocks keep
// fewer bytes per sequence than whole ones, but far more than half (only attention's and the MLP's
// insides are sharded; the norms, the residual stream and the inputs the column-parallel linears
// keep for their weight gradients stay whole: 82% at T = 16); sequence parallelism shards more;
// only it leaves replicated parameters with partial gradients.
TEST(Planner, SplitProbeMeasuresOneRanksShare) {
  const std::string spec = "gpt2:tiny";  // llama:tiny's 101 tokens do not split in two
  auto model = models::build_model(models::resolve_model_config(spec), 1);
  ModelCosts m = measure_model(*model, 2, 16, 1);
  for (bool sp : {false, true}) {
    auto copy = models::build_model(models::resolve_model_config(spec), 1);
    measure_split(m, *copy, 2, sp, 2, 1);
  }
  ASSERT_EQ(m.splits.size(), 2u);
  const ModelCosts::Split &tp = m.splits[0], &sp = m.splits[1];
  EXPECT_EQ(tp.tp, 2);
  EXPECT_FALSE(tp.sequence_parallel);
  EXPECT_TRUE(sp.sequence_parallel);
  EXPECT_LT(tp.block_act_bytes, 0.9 * m.block_act_bytes);
  EXPECT_GT(tp.block_act_bytes, 0.5 * m.block_act_bytes);
  EXPECT_LT(sp.block_act_bytes, tp.block_act_bytes);
  EXPECT_EQ(tp.partial_grad_bytes, 0);
  EXPECT_GT(sp.partial_grad_bytes, 0);
  // GPT-2's c_attn and c_fc each start their input gradient's collective early.
  EXPECT_DOUBLE_EQ(tp.early_per_block, 2.0);
  EXPECT_DOUBLE_EQ(sp.early_per_block, 2.0);
  std::printf("block bytes per sequence: whole %.0f, split(2) %.0f, with sp %.0f\n", m.block_act_bytes,
              tp.block_act_bytes, sp.block_act_bytes);
}

// Unequal stages: the busiest rank sets the steady state, and filling and draining the pipeline
// costs the other rank's slot, not another of the busiest's.
TEST(Planner, UnevenStagesPayTheOtherStagesSlotAsBubble) {
  const ModelCosts m = costs();
  PlanJob job;
  job.world = 2, job.batch = 8;
  const Prediction p = predict(resolved("pipeline(2, schedule=1f1b, micro=4){ stage(h.0-h.5) stage(h.6-h.7) }", 2), m,
                               LinkCosts{}, job);
  const double b = 2, block = 0.001 + 0.002 * b, other = 0.004 + 0.003 * b;
  const double busy = std::max(6 * block, 2 * block + other), idle = std::min(6 * block, 2 * block + other);
  const double p2p = 2 * (b * 64 * 32 * 4) / 1e9;  // an activation and its gradient over the default link
  EXPECT_NEAR(p.bubble_s, idle + p2p, 1e-12);
  EXPECT_NEAR(p.compute_s, 4 * busy, 1e-12);
}

}  // namespace
}  // namespace blu::dist
