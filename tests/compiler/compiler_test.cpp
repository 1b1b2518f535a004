// The compiler's MLIR-free half on the CPU (compiler/: capture, graph, memory plan, runtime, guard):
// - ten training steps of the tiny GPT-2 and the tiny Llama (AdamW, clipping, a changing lr) run
//   compiled give bitwise the eager losses and weights: the replay runs the eager kernels in the
//   eager order over the arena;
// - capture runs no kernel: under a Capture the parameters and the optimizer state do not change;
// - the graph has views and in-place effects, and its dump and structure are stable step to step;
// - the memory plan never overlaps two live buffers (check_plan), and with every freed region
//   poisoned (0xFF = NaN) right after its last use the replay still equals eager, while the
//   deliberately broken plan (debug_overlap) under the same poison does not;
// - a guard failure (a new batch shape) is logged with its reason; past max_variants the step runs
//   eager, logged each time.
// TrainRun: ctest -R Compiler, or build-cpu/tests/test_compiler.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <cstring>
#include <iostream>
#include <sstream>
#include <tuple>

#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/memory/allocator.h"
#include "blu/dist/ddp.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "common/tiny_gpt.h"

namespace blu::compiler {
namespace {

// Token ids of step `step`'s batch: a fixed pseudo-random pattern.
std::pair<Tensor, Tensor> batch(int64_t step, int64_t B, int64_t T, int64_t vocab) {
  std::vector<double> in, tg;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in.push_back(double((step * 131 + b * 31 + t * 7) % vocab));
      tg.push_back(double((step * 131 + b * 31 + t * 7 + 5) % vocab));
    }
  return {from_vector(in, {B, T}, DType::i32), from_vector(tg, {B, T}, DType::i32)};
}

std::unique_ptr<models::CausalLM> make_model(const std::string& family, int64_t loss_chunks = 0) {
  std::unique_ptr<models::CausalLM> m;
  if (family == "gpt2") m = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 7);
  else m = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
  m->set_loss_chunks(loss_chunks);
  return m;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<Tensor> params;
};

// Ten steps of `family`; compiled when `opts` is given. Batch shape per step from `T_of`.
// `reshape_batch`, when given, replaces step s's batch by another layout or dtype of it.
TrainRun train(const std::string& family, const CompileOptions* opts, CompiledStep** out_step = nullptr,
          int steps = 10, const std::function<int64_t(int)>& T_of = nullptr, int64_t loss_chunks = 0,
          const std::function<Tensor(int, const Tensor&)>& reshape_batch = nullptr, DType state_dtype = DType::f32) {
  auto model = make_model(family, loss_chunks);
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{},
                       dist::OptimizerConfig{.lr = 3e-3, .state_dtype = state_dtype});
  std::unique_ptr<CompiledStep> cs;
  if (opts) {
    cs = std::make_unique<CompiledStep>(*opts);
    cs->set_named(BufferKind::parameter, model->named_parameters());
  }
  TrainRun r;
  for (int s = 0; s < steps; ++s) {
    const int64_t T = T_of ? T_of(s) : 8;
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(s, 2, T, 101);
    if (reshape_batch) {
      idx = reshape_batch(s, idx);
      tg = reshape_batch(s, tg);
    }
    const double lr = 3e-3 * (1.0 - 0.05 * s);
    dist::StepValues v;
    auto step = [&] {
      v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, lr, 1.0);
    };
    if (cs)
      cs->run({idx, tg}, step);
    else
      step();
    r.losses.push_back(strat.read(v, false).loss);
  }
  for (const Tensor& p : model->parameters()) r.params.push_back(clone(p.detach()));
  if (out_step) *out_step = cs.release();
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

void expect_bitwise(const TrainRun& eager, const TrainRun& compiled, const std::string& what) {
  ASSERT_EQ(eager.losses.size(), compiled.losses.size());
  for (size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_EQ(eager.losses[i], compiled.losses[i]) << what << ": loss of step " << i + 1;
  ASSERT_EQ(eager.params.size(), compiled.params.size());
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(same_bits(eager.params[i], compiled.params[i])) << what << ": parameter " << i << " after the run";
}

class CompiledVsEager : public ::testing::TestWithParam<std::string> {};

TEST_P(CompiledVsEager, TenStepsBitwise) {
  const TrainRun eager = train(GetParam(), nullptr);
  std::ostringstream log;
  CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  CompiledStep* raw = nullptr;
  const TrainRun compiled = train(GetParam(), &o, &raw);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, GetParam());
  EXPECT_EQ(cs->counts().eager, 1);  // the warm-up step
  EXPECT_EQ(cs->counts().compiled, 9) << log.str();
  EXPECT_EQ(cs->counts().streamed, 8) << "steps 3-10 replay while captured (Note [Streamed replay])";
  EXPECT_EQ(cs->counts().guard_failures, 0) << log.str();
  {  // The same without streaming: every replay after the capture.
    CompileOptions whole = o;
    whole.stream = false;
    CompiledStep* raw2 = nullptr;
    const TrainRun after = train(GetParam(), &whole, &raw2);
    std::unique_ptr<CompiledStep> cs2(raw2);
    expect_bitwise(eager, after, GetParam() + " without streaming");
    EXPECT_EQ(cs2->counts().streamed, 0);
    EXPECT_EQ(cs2->counts().compiled, 9);
  }
  ASSERT_EQ(cs->variants().size(), 1u);
  const Graph& g = cs->variants()[0]->graph;
  EXPECT_GT(g.ops.size(), 100u);
  // Effects are explicit: views, in-place writes (AdamW's update of the parameters).
  bool has_view = false, has_inplace = false;
  for (const Op& op : g.ops) {
    has_view |= !op.views.empty() && op.writes.empty();
    has_inplace |= !op.writes.empty();
  }
  EXPECT_TRUE(has_view);
  EXPECT_TRUE(has_inplace);
  EXPECT_NE(log.str().find("memory plan: peak"), std::string::npos) << log.str();
  const MemoryPlan& plan = cs->variants()[0]->runtime->plan();
  EXPECT_EQ(check_plan(g, plan), "");
  EXPECT_GE(plan.arena_bytes(), plan.peak_live_bytes);
  EXPECT_GT(plan.arena_buffers, 50);
}

// AdamW's moments in bf16 (Note [Stochastic bf16 moments]): the update keeps the library's kernel
// inside the compiled step, which equals the eager run bit for bit; the moments did change dtype
// (the run differs from the fp32-moment one).
TEST_P(CompiledVsEager, Bf16MomentsBitwise) {
  const TrainRun eager = train(GetParam(), nullptr, nullptr, 10, nullptr, 0, nullptr, DType::bf16);
  CompileOptions o;
  CompiledStep* raw = nullptr;
  const TrainRun compiled = train(GetParam(), &o, &raw, 10, nullptr, 0, nullptr, DType::bf16);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, GetParam() + " with bf16 moments");
  EXPECT_EQ(cs->counts().compiled, 9);
  const TrainRun f32 = train(GetParam(), nullptr);
  EXPECT_EQ(f32.losses[0], eager.losses[0]);
  EXPECT_NE(f32.losses.back(), eager.losses.back());
}

INSTANTIATE_TEST_SUITE_P(Compiler, CompiledVsEager, ::testing::Values("gpt2", "llama"));

// The compiler's save-or-recompute pass (compiler/remat.h, Note [Recompute where it is free]):
// the step with recomputed buffers gives bitwise the eager losses and weights (streamed, whole,
// and with every freed region poisoned), its plan never overlaps two live buffers, its peak is
// below the plain compiled step's, and the CPU allocator's peak during a replay matches it.
TEST_P(CompiledVsEager, RecomputeChosenByTheCompilerIsBitwiseWithALowerPeak) {
  const TrainRun eager = train(GetParam(), nullptr);
  CompileOptions plain;
  CompiledStep* raw = nullptr;
  (void)train(GetParam(), &plain, &raw, 3);
  std::unique_ptr<CompiledStep> plain_step(raw);
  const MemoryPlan& plain_plan = plain_step->variants()[0]->runtime->plan();
  for (const bool poison : {false, true})
    for (const bool stream : {true, false}) {
      SCOPED_TRACE(GetParam() + (poison ? ", poisoned" : "") + (stream ? ", streamed" : ", whole"));
      std::ostringstream log;
      CompileOptions o;
      o.remat = true;
      o.log = true;
      o.log_stream = &log;
      o.stream = stream;
      o.runtime.poison_freed = poison;
      const TrainRun compiled = train(GetParam(), &o, &raw);
      std::unique_ptr<CompiledStep> cs(raw);
      expect_bitwise(eager, compiled, GetParam());
      EXPECT_EQ(cs->counts().compiled, 9) << log.str();
      EXPECT_EQ(cs->counts().guard_failures, 0) << log.str();
      const Variant& v = *cs->variants()[0];
      EXPECT_GT(v.remat_buffers, 0) << log.str();
      EXPECT_NE(log.str().find("recompute: " + v.remat), std::string::npos) << log.str();
      const MemoryPlan& plan = v.runtime->plan();
      EXPECT_EQ(check_plan(v.runtime->graph(), plan), "");
      EXPECT_LT(plan.peak_live_bytes, plain_plan.peak_live_bytes);
      EXPECT_LT(plan.arena_bytes(), plain_plan.arena_bytes());
      if (!poison && stream)
        std::cout << GetParam() << ": " << v.remat << "; arena " << plain_plan.arena_bytes() << " B → "
                  << plan.arena_bytes() << " B, plan peak " << plain_plan.peak_bytes() << " B → " << plan.peak_bytes()
                  << " B\n";
    }
}

// The head's loss in row pieces (ops/fused.h, Note [Chunked loss]) compiled: bitwise the eager
// run with the same pieces (streamed, whole, poisoned, with the compiler's recompute), and no
// value of the captured step has the logits' shape [B·T, V'].
TEST_P(CompiledVsEager, ChunkedLossIsBitwiseAndHoldsNoWholeLogits) {
  const int64_t chunks = 3;
  const TrainRun eager = train(GetParam(), nullptr, nullptr, 10, nullptr, chunks);
  for (const bool poison : {false, true})
    for (const bool remat : {false, true}) {
      SCOPED_TRACE(GetParam() + (poison ? ", poisoned" : "") + (remat ? ", remat" : ""));
      std::ostringstream log;
      CompileOptions o;
      o.log = true;
      o.log_stream = &log;
      o.remat = remat;
      o.runtime.poison_freed = poison;
      CompiledStep* raw = nullptr;
      const TrainRun compiled = train(GetParam(), &o, &raw, 10, nullptr, chunks);
      std::unique_ptr<CompiledStep> cs(raw);
      expect_bitwise(eager, compiled, GetParam());
      EXPECT_EQ(cs->counts().compiled, 9) << log.str();
      EXPECT_EQ(cs->counts().guard_failures, 0) << log.str();
      const Variant& v = *cs->variants()[0];
      EXPECT_EQ(check_plan(v.runtime->graph(), v.runtime->plan()), "");
      int linear_ce = 0;
      for (const Op& op : v.graph.ops) linear_ce += op.name == "linear_weight_grad_into" && op.attrs.has("accumulate");
      EXPECT_EQ(linear_ce, chunks - 1) << "the w-gradient accumulates over the pieces";
      const int64_t N = 2 * 8, Vp = make_model(GetParam())->output_weight().size(0);
      for (const Value& val : v.graph.values)
        EXPECT_FALSE(val.shape == Shape({N, Vp}) || val.shape == Shape({2, 8, Vp})) << "a whole logits value";
    }
  // The pieces change only the order of the w-gradient's sums: the eager losses stay near the
  // whole logits' (fp32).
  const TrainRun whole = train(GetParam(), nullptr);
  for (size_t i = 0; i < whole.losses.size(); ++i)
    EXPECT_NEAR(eager.losses[i], whole.losses[i], 1e-5 * std::abs(whole.losses[i])) << "step " << i + 1;
}

TEST(Compiler, CaptureRunsNoKernel) {
  auto model = make_model("gpt2");
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
  std::tie(idx, tg) = batch(0, 2, 8, 101);
  auto one = [&] { (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0); };
  one();  // eager: the optimizer's state exists
  std::vector<Tensor> before;
  for (const Tensor& p : model->parameters()) before.push_back(clone(p.detach()));
  std::string dump1, dump2;
  {
    Capture cap;
    one();
    dump1 = cap.finish().dump();
    EXPECT_NE(dump1.find("kernel matmul"), std::string::npos);
    EXPECT_NE(dump1.find("writes(input 0)"), std::string::npos);
  }
  size_t i = 0;
  for (const Tensor& p : model->parameters()) EXPECT_TRUE(same_bits(p, before[i++])) << "parameter " << i - 1;
  {
    Capture cap;
    one();
    dump2 = cap.finish().dump();
  }
  // The next step's capture has the same text but for the per-step scalars (AdamW's step, lr).
  EXPECT_EQ(std::count(dump1.begin(), dump1.end(), '\n'), std::count(dump2.begin(), dump2.end(), '\n'));
}

// Classes shared across captures (CompiledStep keeps its named tensors' classes from step to step)
// name the buffers they hold; classify()'s, made for this capture, win where both name one.
TEST(Compiler, SharedClassesNameBuffersAndTheCapturesOwnWin) {
  const Tensor w = from_vector({1.0, 2.0}, {2}, DType::f32), x = from_vector({3.0, 4.0}, {2}, DType::f32);
  BufferClasses shared;
  shared[w.storage().get()] = {BufferKind::parameter, "w"};
  shared[x.storage().get()] = {BufferKind::parameter, "x"};
  Capture cap;
  cap.classify_all(&shared);
  cap.classify(x, BufferKind::step_input, "batch");
  (void)add(w, x);
  const Graph& g = cap.finish();
  std::map<std::string, BufferKind> kinds;
  for (const Buffer& b : g.buffers) kinds[b.name] = b.kind;
  ASSERT_EQ(kinds.count("w"), 1u) << g.dump();
  EXPECT_EQ(kinds["w"], BufferKind::parameter);
  ASSERT_EQ(kinds.count("batch"), 1u) << g.dump();
  EXPECT_EQ(kinds["batch"], BufferKind::step_input);
  EXPECT_EQ(kinds.count("x"), 0u);
}

// The named tensors' classes are built once and rebuilt when a named tensor's storage changes: a
// parameter given new storage between compiled steps is still a parameter (the guard holds) and
// the run stays bitwise eager.
TEST(Compiler, ParameterGivenNewStorageIsClassifiedAgain) {
  auto run = [](bool compiled) {
    auto model = make_model("gpt2");
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    std::unique_ptr<CompiledStep> cs;
    if (compiled) {
      cs = std::make_unique<CompiledStep>(CompileOptions{});
      cs->set_named(BufferKind::parameter, model->named_parameters());
    }
    TrainRun r;
    for (int s = 0; s < 6; ++s) {
      if (s == 3) {  // a new storage under the first parameter, same values
        Tensor p = model->parameters().front();
        const Tensor fresh = clone(p.detach());
        p.impl_ptr()->storage = fresh.storage();
      }
      Tensor idx, tg;
      std::tie(idx, tg) = batch(s, 2, 8, 101);
      dist::StepValues v;
      auto step = [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 3e-3, 1.0); };
      if (cs) cs->run({idx, tg}, step);
      else step();
      r.losses.push_back(strat.read(v, false).loss);
    }
    for (const Tensor& p : model->parameters()) r.params.push_back(clone(p.detach()));
    if (cs) {  // a parameter classified as a constant would change the structure: a guard failure
      EXPECT_EQ(cs->counts().guard_failures, 0);
      EXPECT_EQ(cs->counts().compiled, 5);
      EXPECT_EQ(cs->counts().fallback, 0);
    }
    return r;
  };
  expect_bitwise(run(false), run(true), "a parameter with new storage");
}

// Note [Deferred collective waits]: a captured DDP step waits for each bucket's all-reduce where
// finish() waits — after the rest of backward — not where backward issues it, so its replay
// overlaps them as eager does; a collective nobody waits for is waited for at the end of the step.
// (CompileCliDp.GlooDataParallelEqualsEagerBitwise replays such steps over two Gloo ranks.)
TEST(Compiler, CollectivesAreWaitedForWhereTheCallerWaits) {
  dist::TcpStore store{"127.0.0.1", 0, true, std::chrono::milliseconds(10000)};
  const auto pg = capturable(dist::make_gloo_group(
      store, 0, 1, dist::GlooOptions{.timeout = std::chrono::milliseconds(10000), .hostname = "", .prefix = "default_pg"}));
  models::GPT model(::blu::test::tiny_gpt(), 7);
  dist::DistributedDataParallel ddp(model, pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001});
  Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
  std::tie(idx, tg) = batch(0, 2, 8, 101);
  Capture cap;
  model.forward(idx, tg).loss.backward();
  ddp.finish();
  dist::WorkPtr unwaited = pg->barrier();
  const Graph& g = cap.finish();
  std::vector<size_t> issued, waits;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::collective) (g.ops[i].name == "wait" ? waits : issued).push_back(i);
  ASSERT_GE(issued.size(), 3u) << g.summary();
  ASSERT_EQ(waits.size(), issued.size()) << "one wait per collective";
  // The first bucket is issued early in backward and waited for after the last bucket is issued,
  // with the rest of backward's kernels in between.
  const auto kernels_between = std::count_if(g.ops.begin() + std::ptrdiff_t(issued.front()),
                                             g.ops.begin() + std::ptrdiff_t(waits.front()),
                                             [](const Op& op) { return op.kind == OpKind::kernel; });
  EXPECT_GT(waits.front(), issued[issued.size() - 2]) << g.summary();
  EXPECT_GT(kernels_between, 20) << g.summary();
  // The barrier's Work was dropped unwaited: its wait ends the step.
  EXPECT_EQ(g.ops.back().name, "wait");
  EXPECT_EQ(issued.back(), g.ops.size() - 2);
}

// The poison test: freed regions filled with 0xFF right after their last use.
TEST(Compiler, PoisonedFreedRegionsStillMatchEager) {
  const TrainRun eager = train("gpt2", nullptr, nullptr, 4);
  CompileOptions o;
  o.runtime.poison_freed = true;
  const TrainRun compiled = train("gpt2", &o, nullptr, 4);
  expect_bitwise(eager, compiled, "poisoned");
}

TEST(Compiler, PoisonCatchesABrokenPlan) {
  const TrainRun eager = train("gpt2", nullptr, nullptr, 4);
  CompileOptions o;
  o.runtime.poison_freed = true;
  o.plan.debug_overlap = true;  // every temporary at offset 0
  CompiledStep* raw = nullptr;
  const TrainRun broken = train("gpt2", &o, &raw, 4);
  std::unique_ptr<CompiledStep> cs(raw);
  EXPECT_NE(check_plan(cs->variants()[0]->graph, cs->variants()[0]->runtime->plan()), "");
  bool differs = false;
  for (size_t i = 1; i < eager.losses.size(); ++i) differs |= !(eager.losses[i] == broken.losses[i]);
  EXPECT_TRUE(differs) << "a plan that overlaps live buffers went unnoticed";
}

TEST(Compiler, GuardFailureIsLoggedAndBounded) {
  // Steps 1..8 with seq len 8, 6, 4, 2, 8, 6, 4, 2: step 1 (T=8) is the warm-up; T=6 compiles
  // variant 1; T=4 and T=2 fail the guard (logged) and become variants 2 and 3; with
  // max_variants 3, step 5 (T=8) fails it again and runs eager (logged); steps 6..8 replay.
  const auto T_of = [](int s) { return int64_t(8 - 2 * (s % 4)); };
  const TrainRun eager = train("gpt2", nullptr, nullptr, 8, T_of);
  std::ostringstream log;
  CompileOptions o;
  o.max_variants = 3;
  o.log_stream = &log;
  CompiledStep* raw = nullptr;
  const TrainRun compiled = train("gpt2", &o, &raw, 8, T_of);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, "with guard failures");
  EXPECT_EQ(cs->variants().size(), 3u);
  EXPECT_EQ(cs->counts().eager, 2) << log.str();  // the warm-up and step 5
  EXPECT_EQ(cs->counts().compiled, 6) << log.str();
  EXPECT_EQ(cs->counts().guard_failures, 3) << log.str();
  const std::string text = log.str();
  EXPECT_NE(text.find("guard failed at step 3: no compiled variant for [2, 4] i32"), std::string::npos) << text;
  EXPECT_NE(text.find("limit of 3 variants is reached; the step runs eager"), std::string::npos) << text;
}

// A timing, not a check: the host time of capturing one step of the tiny model (BENCH_FAMILY,
// default llama), the best of five rounds of 500 captures (docs/performance.md, "Where the timed
// step waits"). Run with --gtest_also_run_disabled_tests --gtest_filter='*CaptureTiming'.
TEST(Compiler, DISABLED_CaptureTiming) {
  const char* family = std::getenv("BENCH_FAMILY");
  auto model = make_model(family && *family ? family : "llama");
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  Tensor idx, tg;
  std::tie(idx, tg) = batch(0, 2, 8, 101);
  const auto one = [&] { (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 3e-3, 1.0); };
  one();  // eager: the optimizer state and the model's tables exist
  double best = 1e30;
  size_t ops = 0;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 500; ++i) {
      Capture cap;
      one();
      ops = cap.finish().ops.size();
    }
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 500);
  }
  std::printf("capture of one step: %zu ops, %.1f us\n", ops, best);
}

// Note [Tied rows on one device] (dist/strategy.cpp): a single-device Strategy adds the tied
// embedding's rows into its gradient in place for a step of one micro-batch — the captured step
// has embedding_backward_add_ and no dense embedding_backward for it — and its gradient has the plain
// loop's bits (model.forward, backward, no Strategy); with two micro-batches the dense path stays.
TEST(Compiler, TiedEmbeddingRowsAreAddedInPlaceOnOneDevice) {
  const auto op_count = [](const Graph& g, const std::string& name) {
    return std::count_if(g.ops.begin(), g.ops.end(), [&](const Op& op) { return op.name == name; });
  };
  Tensor idx, tg;
  std::tie(idx, tg) = batch(0, 2, 8, 101);
  const auto batch_of = [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; };
  for (int64_t micro : {1, 2}) {
    SCOPED_TRACE(std::to_string(micro) + " micro-batches");
    auto model = make_model("gpt2");
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    (void)strat.step(micro, batch_of, 3e-3, 1.0);  // eager: the optimizer state exists
    Capture cap;
    (void)strat.step(micro, batch_of, 3e-3, 1.0);
    const Graph& g = cap.finish();
    EXPECT_EQ(op_count(g, "embedding_backward_add_"), micro == 1 ? 1 : 0);
    // The position embedding (not tied) keeps its dense gradient: one a micro-batch.
    EXPECT_EQ(op_count(g, "embedding_backward"), micro == 1 ? 1 : 2 * micro);
  }
  // The gradient's bits against the plain loop's (one micro-batch, no update: max_norm 0 keeps
  // the step from scaling, lr 0 from moving the weights).
  auto plain = make_model("gpt2");
  auto ours = make_model("gpt2");
  plain->forward(idx, tg).loss.backward();
  dist::Strategy strat(*ours, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 0.0});
  (void)strat.step(1, batch_of, 0.0, 0.0);
  const auto grad_of = [](models::CausalLM& m, const std::string& name) {
    for (const auto& [n, p] : m.named_parameters())
      if (n == name) return p.grad();
    return Tensor();
  };
  const Tensor a = grad_of(*plain, "wte.weight"), b = grad_of(*ours, "wte.weight");
  ASSERT_TRUE(a.defined() && b.defined());
  EXPECT_TRUE(same_bits(a, b)) << "wte.weight's gradient";
}

// The guard's key is kept from step to step while the inputs' layout is the same: an input with
// the same shape but other strides (step 4: a narrowed view of a wider batch) or another dtype
// (step 6: i64) is a new variant, logged, and the run stays bitwise eager.
TEST(Compiler, InputWithOtherStridesOrDtypeIsANewVariant) {
  const auto reshape = [](int s, const Tensor& t) {
    if (s == 3) {  // the same values in the first 8 of 16 columns
      Tensor wide = zeros({t.size(0), 16}, t.dtype());
      copy_(narrow(wide, 1, 0, 8), t);
      return narrow(wide, 1, 0, 8);
    }
    return s == 5 ? to_dtype(t, DType::i64) : t;
  };
  const TrainRun eager = train("gpt2", nullptr, nullptr, 8, nullptr, 0, reshape);
  std::ostringstream log;
  CompileOptions o;
  o.log_stream = &log;
  CompiledStep* raw = nullptr;
  const TrainRun compiled = train("gpt2", &o, &raw, 8, nullptr, 0, reshape);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, "with strided and i64 batches");
  const std::string text = log.str();
  EXPECT_NE(text.find("guard failed at step 4: no compiled variant for [2, 8] i32 strides [16, 1]"), std::string::npos)
      << text;
  EXPECT_NE(text.find("guard failed at step 6: no compiled variant for [2, 8] i64"), std::string::npos) << text;
  EXPECT_EQ(cs->variants().size(), 3u) << text;
  EXPECT_EQ(cs->counts().guard_failures, 2) << text;
}

// Note [Plan against the allocator]: on the CPU every byte a compiled step holds comes from the CPU
// allocator — the parameters, AdamW's moments and the step inputs (held), the arena (allocated once
// by the Runtime), the step outputs (the loss, the gradients kept as .grad, allocated at binding) —
// so the allocator's peak during a replayed step is the plan's peak plus what lives outside the
// step: the previous step's read-out values and host-side tensors the test keeps (a few hundred
// bytes), and nothing else. Eagerly, by contrast, the peak is what the caching-free allocator sees
// of the step's own order of frees. The bound: within 2% of the plan's peak (measured: see
// docs/compiler.md, "Memory plan against the allocator").
// With an op excluded (compiler/exclude.h) its temporaries live outside the arena, each from
// right before its first launch to right after its last: the plan counts their live peak, the
// runtime frees each after its last launch, and the allocator's peak stays the plan's.
TEST(Compiler, PlanPeakMatchesTheCpuAllocatorsPeak) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"gpt2", ""}, {"llama", ""}, {"gpt2", "gelu"}, {"llama", "swiglu"}};
  for (const auto& [family, excluded] : cases) {
    SCOPED_TRACE(family + (excluded.empty() ? "" : ", " + excluded + " excluded"));
    auto model = make_model(family);
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    set_excluded_ops(excluded.empty() ? std::vector<std::string>{} : std::vector<std::string>{excluded});
    CompiledStep cs;
    cs.set_named(BufferKind::parameter, model->named_parameters());
    Allocator& alloc = allocator_for(kCPU);
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(0, 2, 8, 101);
    int64_t measured = 0, before = 0;
    for (int s = 0; s < 4; ++s) {
      const Tensor fresh_idx = batch(s, 2, 8, 101).first, fresh_tg = batch(s, 2, 8, 101).second;
      std::memcpy(idx.raw_data(), fresh_idx.raw_data(), idx.nbytes());
      std::memcpy(tg.raw_data(), fresh_tg.raw_data(), tg.nbytes());
      dist::StepValues v;
      if (s == 3) {
        alloc.reset_peak();
        before = alloc.stats().current_bytes;
      }
      cs.run({idx, tg}, [&] {
        v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0);
      });
      if (s == 3) measured = alloc.stats().peak_bytes;
      (void)strat.read(v, false);
    }
    ASSERT_EQ(cs.counts().compiled, 3);
    const Runtime& runtime = *cs.variants()[0]->runtime;
    const MemoryPlan& plan = runtime.plan();
    const double ratio = double(measured) / double(plan.peak_bytes());
    std::cout << family << " " << excluded << ": plan peak " << plan.peak_bytes() << " B (" << plan.summary()
              << "); allocator peak " << measured << " B (live before the step " << before << " B); ratio " << ratio
              << "\n";
    EXPECT_NEAR(ratio, 1.0, 0.02) << plan.summary();
    set_excluded_ops({});
    if (excluded.empty()) {
      EXPECT_EQ(plan.excluded_buffers, 0);
      EXPECT_EQ(runtime.stats().released, 0);
      continue;
    }
    size_t all_excluded = 0;
    for (size_t b = 0; b < plan.placements.size(); ++b)
      if (!plan.placements[b].in_arena && plan.placements[b].first >= 0 &&
          runtime.graph().buffers[b].kind == BufferKind::temporary)
        all_excluded += plan.placements[b].nbytes;
    ASSERT_EQ(plan.excluded_buffers, 2);  // one per layer
    EXPECT_EQ(runtime.stats().released, 3 * plan.excluded_buffers);  // every one, every compiled step
    // GPT-2's MLP computes its GELU again in backward, so each forward GELU output dies at once:
    // one is live at a time. Llama's SwiGLU output is down_proj's saved input: both are live when
    // backward starts.
    EXPECT_EQ(all_excluded, (family == "gpt2" ? 2 : 1) * plan.excluded_bytes) << plan.summary();
  }
}

// Recompute regions rebuild their forward inside backward on leaves of their own; once the step is
// over only the capture holds that rebuilt graph, and its gradient accumulators hold the leaves
// and so the activations they view. The capture drops the autograd state of what only it holds
// (as the eager step drops those tensors), so the recomputed step has the step outputs of the
// plain one, and its plan the lower peak that recompute is for, matched by the allocator.
TEST(Compiler, RecomputedStepsPlanTheirLowerPeak) {
  std::map<std::string, size_t> peak, outputs;
  for (const std::string recompute : {"none", "selective", "mlp", "block"}) {
    auto model = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
    model->set_activation_policy(models::ActivationPolicy::parse(recompute, false));
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    CompiledStep cs;
    cs.set_named(BufferKind::parameter, model->named_parameters());
    Allocator& alloc = allocator_for(kCPU);
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(0, 32, 64, 101);
    int64_t measured = 0;
    for (int s = 0; s < 4; ++s) {
      dist::StepValues v;
      if (s == 3) alloc.reset_peak();
      cs.run({idx, tg}, [&] {
        v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0);
        strat.optimizer().zero_grad();
      });
      if (s == 3) measured = alloc.stats().peak_bytes;
      (void)strat.read(v, false);
    }
    ASSERT_EQ(cs.counts().compiled, 3) << recompute;
    const MemoryPlan& plan = cs.variants()[0]->runtime->plan();
    peak[recompute] = plan.peak_bytes();
    outputs[recompute] = plan.output_bytes;
    std::cout << recompute << ": " << plan.summary() << "; allocator peak " << measured << " B\n";
    EXPECT_NEAR(double(measured) / double(plan.peak_bytes()), 1.0, 0.02) << recompute << ": " << plan.summary();
  }
  EXPECT_EQ(outputs["selective"], outputs["none"]);
  EXPECT_EQ(outputs["mlp"], outputs["none"]);
  EXPECT_EQ(outputs["block"], outputs["none"]);
  EXPECT_LT(peak["selective"], peak["none"] * 0.9);
  EXPECT_LT(peak["mlp"], peak["none"]);  // the tiny model's peak is mostly its attention probabilities
  EXPECT_LT(peak["block"], peak["selective"]);
}

// The captured step runs the eager step's kernels, one for one: the tests of sole ownership that
// choose kernels (Note [Donated buffers]: the logits take their own gradient; a parameter keeps
// its first gradient without a copy) read the counts of the eager step, not the recorder's
// handles. Without that the captured step ran cross_entropy_backward instead of
// cross_entropy_backward_ and a clone per parameter, and its plan held the logits twice.
TEST(Compiler, CaptureMakesTheEagerStepsOwnershipChoices) {
  for (const std::string recompute : {"none", "selective", "block"})
  for (const std::string family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family + ", recompute " + recompute);
    auto model = make_model(family);
    model->set_activation_policy(models::ActivationPolicy::parse(recompute, false));
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(0, 2, 8, 101);
    auto one = [&] { (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0); };
    one();  // the optimizer's state
    std::vector<std::string> eager;
    const int obs = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
      if (!op.view) eager.push_back(op.name);
    });
    one();
    remove_op_observer(obs);
    Capture cap;
    one();
    const Graph& g = cap.finish();
    std::vector<std::string> captured;
    for (const Op& op : g.ops)
      if (op.kind == OpKind::kernel) captured.push_back(op.name);
    EXPECT_EQ(captured, eager) << family;
    EXPECT_EQ(std::count(captured.begin(), captured.end(), "cross_entropy_backward_"), 1) << family;
    // The logits' gradient is written over the logits: one buffer of that size in the plan.
    for (const Op& op : g.ops) {
      if (op.name == "cross_entropy_backward_") {
        EXPECT_EQ(g.values[size_t(op.outputs[0])].buffer, g.values[size_t(op.inputs[0])].buffer) << family;
      }
    }
  }
}

TEST(Compiler, ParseOpListAndExcludedBuffersStayOutOfTheArena) {
  EXPECT_EQ(parse_op_list(" gelu, matmul,,gelu ,"), (std::vector<std::string>{"gelu", "matmul"}));
  EXPECT_TRUE(parse_op_list("").empty());
  auto model = make_model("gpt2");
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
  std::tie(idx, tg) = batch(0, 2, 8, 101);
  auto one = [&] { (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0); };
  one();
  Capture cap;
  one();
  const Graph& g = cap.finish();
  const MemoryPlan all = plan_memory(g);
  PlanOptions o;
  o.exclude = {"gelu"};
  const MemoryPlan some = plan_memory(g, o);
  int gelu_outputs = 0;
  for (const Op& op : g.ops)
    if (op.name == "gelu")
      for (int v : op.outputs) {
        const int b = g.values[size_t(v)].buffer;
        if (g.buffers[size_t(b)].kind != BufferKind::temporary) continue;
        ++gelu_outputs;
        EXPECT_FALSE(some.placements[size_t(b)].in_arena) << "gelu's output buf" << b;
        EXPECT_TRUE(all.placements[size_t(b)].in_arena) << "gelu's output buf" << b;
      }
  EXPECT_GT(gelu_outputs, 0);
  EXPECT_EQ(some.excluded_buffers, gelu_outputs);
  EXPECT_EQ(some.arena_buffers + some.excluded_buffers, all.arena_buffers);
  EXPECT_EQ(check_plan(g, some), "");
  set_excluded_ops({"gelu"});
  EXPECT_TRUE(op_excluded("gelu"));
  EXPECT_FALSE(op_excluded("matmul"));
  set_excluded_ops({});
  EXPECT_FALSE(op_excluded("gelu"));
}

// The compile log's live site: at the plan's peak op the groups add up to the live peak and no op
// has more bytes live; at the optimizer's first update every parameter's gradient (fp32, as the
// parameters) is live and counted as a gradient, and nothing else is.
TEST(Compiler, LiveSiteNamesThePeakAndCountsEveryGradientAtTheUpdate) {
  for (const std::string family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    auto model = make_model(family);
    dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(0, 2, 8, 101);
    // As the trainer's compiled step: the gradients dropped inside the step are its temporaries.
    auto one = [&] {
      (void)strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 1e-3, 1.0);
      strat.optimizer().zero_grad();
    };
    one();
    Capture cap;
    size_t param_bytes = 0;
    for (const auto& [name, t] : model->named_parameters()) {
      cap.classify(t, BufferKind::parameter, name);
      param_bytes += t.nbytes();
    }
    one();
    const Graph& g = cap.finish();
    const MemoryPlan plan = plan_memory(g);
    ASSERT_GE(plan.peak_op, 0);
    std::vector<size_t> live(g.ops.size(), 0);
    for (const Placement& p : plan.placements)
      if (p.in_arena)
        for (int i = p.first; i <= p.last; ++i) live[size_t(i)] += p.nbytes;
    EXPECT_EQ(live[size_t(plan.peak_op)], plan.peak_live_bytes);
    EXPECT_EQ(*std::max_element(live.begin(), live.end()), plan.peak_live_bytes);
    const LiveSite peak = live_site(g, plan);
    size_t sum = peak.gradients.bytes;
    for (const LiveGroup& grp : peak.rest) sum += grp.bytes;
    EXPECT_EQ(peak.bytes, plan.peak_live_bytes);
    EXPECT_EQ(sum, plan.peak_live_bytes);
    const std::string text = peak.describe(g);
    EXPECT_NE(text.find("at op " + std::to_string(plan.peak_op) + " of " + std::to_string(g.ops.size())), std::string::npos)
        << text;
    int update = -1;
    for (size_t i = 0; i < g.ops.size() && update < 0; ++i)
      if (g.ops[i].name == "adamw_step") update = int(i);
    ASSERT_GE(update, 0);
    const LiveSite at_update = live_site(g, plan, update);
    EXPECT_EQ(at_update.gradients.bytes, param_bytes) << at_update.describe(g);
    EXPECT_EQ(at_update.gradients.buffers, int(model->parameters().size())) << at_update.describe(g);
  }
}

// Note [Streamed replay]: a streamed step that leaves the compiled structure part-way — at step 6
// the loss passes through one more op (times 1, the same value) between forward and backward, or
// one more op follows the step — has its forward already running when the capture meets the new
// op; what has run stays, the rest runs unplanned, and the run stays bitwise the eager one.
// A compiled step over `model`'s parameters whose log goes to `log` (the streamed tests).
std::unique_ptr<CompiledStep> logged_step(const nn::Module& model, std::ostringstream& log) {
  CompileOptions o;
  o.log_stream = &log;
  auto cs = std::make_unique<CompiledStep>(o);
  cs->set_named(BufferKind::parameter, model.named_parameters());
  return cs;
}

TEST(Compiler, StreamedStepThatLeavesTheStructureCompletesUnplanned) {
  // With --compile-remat too: leaving between forward and backward finds the dropped norm outputs'
  // bytes reused, and the salvage makes them again from their producers' held inputs.
  for (const bool remat : {false, true})
  for (const bool middle : {true, false}) {
    SCOPED_TRACE(remat ? "remat" : "plain");
    auto run = [&](bool compiled, CompiledStep** out) {
      auto model = make_model("gpt2");
      dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
      std::ostringstream log;
      std::unique_ptr<CompiledStep> cs;
      if (compiled) {
        CompileOptions o;
        o.log_stream = &log;
        o.remat = remat;
        cs = std::make_unique<CompiledStep>(o);
        cs->set_named(BufferKind::parameter, model->named_parameters());
      }
      TrainRun r;
      for (int s = 0; s < 9; ++s) {
        Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
        std::tie(idx, tg) = batch(s, 2, 8, 101);
        const bool odd = s == 5;
        dist::StepValues v;
        Tensor extra;
        auto step = [&] {
          v = strat.step(1, [&](int64_t) {
            Tensor loss = model->forward(idx, tg).loss;
            return odd && middle ? mul(loss, 1.0) : loss;
          }, 3e-3, 1.0);
          if (odd && !middle) extra = mul(v.loss_sum, 2.0);
        };
        if (cs)
          cs->run({idx, tg}, step);
        else
          step();
        r.losses.push_back(strat.read(v, false).loss);
      }
      for (const Tensor& p : model->parameters()) r.params.push_back(clone(p.detach()));
      if (out) *out = cs.release();
      return r;
    };
    const TrainRun eager = run(false, nullptr);
    CompiledStep* raw = nullptr;
    const TrainRun compiled = run(true, &raw);
    std::unique_ptr<CompiledStep> cs(raw);
    const std::string what = middle ? "left in the middle" : "left at the end";
    expect_bitwise(eager, compiled, what);
    EXPECT_EQ(cs->counts().fallback, 1) << what;
    EXPECT_EQ(cs->counts().streamed, 6) << what;  // steps 3-5 and 7-9
    ASSERT_EQ(cs->guard_failures().size(), 1u) << what;
    EXPECT_NE(cs->guard_failures()[0].find("of its launches had run, the rest runs unplanned"), std::string::npos)
        << cs->guard_failures()[0];
    if (middle) {
      EXPECT_EQ(cs->guard_failures()[0].find(" 0 of its launches"), std::string::npos) << cs->guard_failures()[0];
    }
    if (remat && middle) {
      EXPECT_GT(cs->variants()[0]->runtime->stats().remade, 0);
    }
    std::cout << what << ": " << cs->guard_failures()[0] << "\n";
  }
}

// A streamed DDP step that leaves the structure after backward, while the buckets' all-reduces
// are issued and not yet waited for: the salvage waits for them before the arena's values move
// (wait_issued_collectives), the rest runs unplanned, and every step stays bitwise eager.
TEST(Compiler, StreamedDdpStepThatLeavesTheStructureWithCollectivesInFlight) {
  auto run = [](bool compiled, CompiledStep** out) {
    dist::TcpStore store{"127.0.0.1", 0, true, std::chrono::milliseconds(10000)};
    const auto pg = capturable(dist::make_gloo_group(
        store, 0, 1, dist::GlooOptions{.timeout = std::chrono::milliseconds(10000), .hostname = "", .prefix = "default_pg"}));
    models::GPT model(::blu::test::tiny_gpt(), 7);
    dist::DistributedDataParallel ddp(model, pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001});
    auto opt = optim::make_adamw({{model.named_parameters(), 0.0}}, {.lr = 3e-3});
    std::ostringstream log;
    std::unique_ptr<CompiledStep> cs = compiled ? logged_step(model, log) : nullptr;
    TrainRun r;
    for (int s = 0; s < 9; ++s) {
      Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
      std::tie(idx, tg) = batch(s, 2, 8, 101);
      Tensor loss;
      auto step = [&] {
        opt->zero_grad();
        loss = model.forward(idx, tg).loss;
        loss.backward();
        if (s == 5) (void)mul(loss, 1.0);  // an op the compiled step lacks, with the buckets in flight
        ddp.finish();
        opt->step();
      };
      if (cs)
        cs->run({idx, tg}, step);
      else
        step();
      r.losses.push_back(to_vector(loss)[0]);
    }
    for (const Tensor& p : model.parameters()) r.params.push_back(clone(p.detach()));
    if (out) *out = cs.release();
    return r;
  };
  const TrainRun eager = run(false, nullptr);
  CompiledStep* raw = nullptr;
  const TrainRun compiled = run(true, &raw);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, "DDP, left after backward");
  EXPECT_EQ(cs->counts().fallback, 1);
  EXPECT_GE(cs->counts().streamed, 5);
  ASSERT_EQ(cs->guard_failures().size(), 1u);
  EXPECT_NE(cs->guard_failures()[0].find("of its launches had run, the rest runs unplanned"), std::string::npos)
      << cs->guard_failures()[0];
}

TEST(Compiler, CaptureDifferenceFallsBackToEagerKernels) {
  // The first step creates AdamW's state: with no warm-up that step's capture has ops the next
  // ones lack. Variant 1 is compiled from it (its zeros_like fills included); step 2's capture
  // differs, fails the guard after capture, is logged and runs its kernels unplanned.
  const TrainRun eager = train("gpt2", nullptr, nullptr, 3);
  std::ostringstream log;
  CompileOptions o;
  o.warmup_steps = 0;
  o.log_stream = &log;
  CompiledStep* raw = nullptr;
  const TrainRun compiled = train("gpt2", &o, &raw, 3);
  std::unique_ptr<CompiledStep> cs(raw);
  expect_bitwise(eager, compiled, "fallback");
  EXPECT_EQ(cs->counts().fallback, 2) << log.str();
  EXPECT_NE(log.str().find("the step's capture differs from the compiled graph"), std::string::npos) << log.str();
}

}  // namespace
}  // namespace blu::compiler
