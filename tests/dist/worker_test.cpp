// The worker side of the multi-process tests: DistWorker.Run does nothing unless the parent test
// set BLU_DIST_SCENARIO (dist_test_util.h); then it is one rank of that scenario.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <cstdlib>
#include <thread>

#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/hetero.h"
#include "blu/dist/mesh.h"
#include "blu/dist/planner.h"
#include "blu/models/registry.h"
#include "blu/dist/process_group.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tcp_store.h"
#include "blu/train/layout_setup.h"
#include "blu/optim/loss_scaler.h"
#include "ddp_harness.h"
#include "pipeline_harness.h"
#include "reshard_harness.h"
#include "tp_harness.h"
#include "train_harness.h"
#include "zero_gate_harness.h"
#include "common/checks.h"

namespace blu::dist {
namespace {

using blu::test::error_of;

using namespace std::chrono_literals;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

struct Rank {
  DistEnv env = detect_env();
  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  explicit Rank(std::chrono::milliseconds timeout) {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, env.rank == 0, 10000ms);
    pg = make_gloo_group(*store, env.rank, env.world_size, GlooOptions{.timeout = timeout, .hostname = "", .prefix = "default_pg"});
  }
};

std::vector<double> values(const Tensor& t) { return to_vector(t); }

// 8 ranks as dp=2 × pp=2 × tp=2: each of the 7 groups a rank belongs to sums (rank + 1) over its
// members; the sum must be that of the ranks group_ranks names, and the group's size and this
// rank's place in it must match.
// Rank 1 sleeps before every block (a hook the probe does not know of); the probe's times must
// show the injected seconds within 20%, and the speeds must favour rank 0.
void probe_speeds() {
  Rank rk(20000ms);
  // A small vocabulary keeps the step short beside the delay, so two ranks sharing cores with
  // other work still see it.
  auto model = models::build_model(models::resolve_model_config("llama:tiny"), 1);
  const double delay = 0.05;  // seconds per block
  if (rk.env.rank == 1)
    model->add_block_hooks([&](size_t, const Tensor& x) {
      std::this_thread::sleep_for(std::chrono::duration<double>(delay));
      return x;
    }, nullptr);
  const std::vector<double> t = probe_step_times(*model, *rk.pg, 2, 32, 5);
  ASSERT_EQ(t.size(), 2u);
  const double injected = delay * double(model->num_blocks());
  EXPECT_NEAR(t[1] - t[0], injected, 0.2 * injected) << "probe times " << t[0] << " and " << t[1] << " s";
  const std::vector<double> s = speeds_from_times(t);
  EXPECT_GT(s[0], s[1]);
}

// The hardware-aware split end to end: rank 1 sleeps 12 ms per row of every block's input (a slower
// device, hidden from the splitter). The probe's speeds give the replicas their rows of one global
// batch of 8; the steps then take less time than with 4 rows each, and both splits train the same
// losses as one process on the whole batch (each replica's gradient weighted by its rows).
void hetero_train() {
  Rank rk(60000ms);
  const int rank = rk.env.rank;
  nlohmann::json cfg = models::resolve_model_config("llama:tiny");
  const int64_t T = 16, global = 8;
  const double per_row = 0.012;  // seconds per row and block on rank 1 (outweighs a sanitized block)
  auto slowed = [&](models::CausalLM& m) {
    if (rank == 1)
      m.add_block_hooks([=](size_t, const Tensor& x) {
        std::this_thread::sleep_for(std::chrono::duration<double>(per_row * double(x.size(0))));
        return x;
      }, nullptr);
  };
  Generator gen(7);
  const Tensor idx = randint(0, 101, {global, T}, DType::i64, kCPU, &gen);
  const Tensor tgt = randint(0, 101, {global, T}, DType::i64, kCPU, &gen);
  const int steps = 6;
  // One process on the whole batch: the losses every split must reproduce.
  std::vector<double> ref;
  {
    auto model = models::build_model(cfg, 3);
    Strategy s(*model, nullptr, StrategyConfig{}, OptimizerConfig{.lr = 1e-3});
    for (int i = 0; i < steps; ++i) ref.push_back(s.read(s.step(1, [&](int64_t) { return std::make_pair(idx, tgt); }, 1e-3, 1.0), false).loss);
  }
  auto run = [&](const std::vector<double>& weights, std::vector<double>& losses) {
    auto model = models::build_model(cfg, 3);
    slowed(*model);
    const std::vector<int64_t> rows = proportional_split(global, weights);
    const int64_t first = rank == 0 ? 0 : rows[0];
    const Tensor x = narrow(idx, 0, first, rows[size_t(rank)]), y = narrow(tgt, 0, first, rows[size_t(rank)]);
    StrategyConfig sc;
    sc.batch_share = double(rows[size_t(rank)]) / double(global);
    Strategy s(*model, rk.pg, sc, OptimizerConfig{.lr = 1e-3});
    std::vector<double> times;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      losses.push_back(s.read(s.step(1, [&](int64_t) { return std::make_pair(x, y); }, 1e-3, 1.0), false).loss);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin() + 1, times.end());
    return times[size_t(steps / 2 + 1)];
  };
  std::vector<double> even_losses, aware_losses;
  const double even = run({0.5, 0.5}, even_losses);
  std::vector<double> speeds;
  {
    auto probe_model = models::build_model(cfg, 3);
    slowed(*probe_model);
    speeds = speeds_from_times(probe_step_times(*probe_model, *rk.pg, 2, T, 3));
  }
  const double aware = run(speeds, aware_losses);
  const std::vector<int64_t> rows = proportional_split(global, speeds);
  if (rank == 0)
    std::printf("hetero: speeds %.3f/%.3f -> rows %lld/%lld; median step even %.1f ms, aware %.1f ms (%.2fx)\n",
                speeds[0], speeds[1], static_cast<long long>(rows[0]), static_cast<long long>(rows[1]), even * 1e3,
                aware * 1e3, even / aware);
  EXPECT_GT(speeds[0], speeds[1]);
  EXPECT_GT(rows[0], rows[1]);
  EXPECT_LT(aware, 0.9 * even) << "even " << even << " s, aware " << aware << " s";
  for (int i = 0; i < steps; ++i) {
    EXPECT_NEAR(even_losses[size_t(i)], ref[size_t(i)], 1e-5 * ref[size_t(i)]) << "step " << i;
    EXPECT_NEAR(aware_losses[size_t(i)], ref[size_t(i)], 1e-5 * ref[size_t(i)]) << "step " << i;
  }
}

// `--parallel auto` on unequal ranks (train::decide_layout, as the trainer and bench call it):
// rank 1 sleeps 6 ms per row of every block's input, hidden from the planner. The ranks' probed
// step times show it, the planner weighs the replicas weighted by their speeds against the even
// ones, and picks a weighted layout that gives rank 0 the larger share; its predicted step is
// below the even replicate(2)'s.
void hetero_auto() {
  Rank rk(60000ms);
  const int rank = rk.env.rank;
  auto model = models::build_model(models::resolve_model_config("llama:tiny"), 3);
  const double per_row = 0.006;
  if (rank == 1)
    model->add_block_hooks([=](size_t, const Tensor& x) {
      std::this_thread::sleep_for(std::chrono::duration<double>(per_row * double(x.size(0))));
      return x;
    }, nullptr);
  const int64_t T = 16, rows_per_rank = 4;
  ModelCosts costs = measure_model(*model, 2, T, 3, rk.pg.get());
  take_slowest(costs, *rk.pg, kCPU);
  const LinkCosts link = measure_link(*rk.pg, kCPU, 5);
  const train::LayoutDecision d =
      train::decide_layout("auto", *model, costs, link, rk.pg.get(), rk.store.get(), rank, 2, rows_per_rank, T, 0);
  ASSERT_EQ(d.probe_ms.size(), 2u);
  EXPECT_GT(d.probe_ms[1], d.probe_ms[0]);
  const Layout l = resolve_layout(parse_annotation(d.text), {"model.layers.0", "model.layers.1"}, 2);
  ASSERT_EQ(l.replica_weights.size(), 2u) << d.text;
  EXPECT_NE(d.text.find("weights=["), std::string::npos) << d.text;
  EXPECT_GT(l.replica_weights[0], l.replica_weights[1]) << d.text;
  // d.plan holds the five fastest: the even replicate(2) ranks below the pick, or not among them.
  EXPECT_EQ(d.plan[0]["layout"].get<std::string>(), d.text);
  std::string even = "not among the five fastest";
  for (const auto& p : d.plan)
    if (p["layout"] == "replicate(2)") {
      EXPECT_LT(d.plan[0]["step_ms"].get<double>(), p["step_ms"].get<double>()) << d.plan.dump();
      even = std::to_string(p["step_ms"].get<double>()) + " ms";
    }
  if (rank == 0)
    std::printf("hetero auto: probe %.1f / %.1f ms -> %s (predicted %.1f ms; replicate(2): %s)\n", d.probe_ms[0],
                d.probe_ms[1], d.text.c_str(), d.plan[0]["step_ms"].get<double>(), even.c_str());
}

// Pipeline stages by measured time (pipeline(2, balance=time); Note [Stages by time] in
// train/layout_setup.cpp): rank 1 sleeps 8 ms per row of every block's input, hidden from the
// splitter. decide_layout states the stages from the probe, more blocks on rank 0; the balanced
// pipeline's median step is at least 10% shorter than the even one's, and both train the same
// losses (the same arithmetic in another split: within 1e-6). Under a memory budget that the
// unbounded first stage exceeds, the stages move blocks to rank 1 and each fits the budget as the
// planner predicts it; a budget no split fits is refused with the numbers.
void hetero_stages() {
  Rank rk(60000ms);
  const int rank = rk.env.rank;
  models::GPTConfig cfg = test::tp_gpt_config();
  cfg.n_layer = 8;
  const int64_t rows = 2, micro = 2, T = 16;
  const double per_row = 0.008;  // more than a block's compute, under the sanitizers too
  auto build = [&] {
    auto m = std::make_unique<models::GPT>(cfg, 5);
    if (rank == 1)
      m->add_block_hooks([=](size_t, const Tensor& x) {
        std::this_thread::sleep_for(std::chrono::duration<double>(per_row * double(x.size(0))));
        return x;
      }, nullptr);
    return m;
  };
  const std::string text = "pipeline(2, balance=time, micro=2)";
  std::vector<std::string> names;
  for (int i = 0; i < cfg.n_layer; ++i) names.push_back("h." + std::to_string(i));
  auto probe = build();
  ModelCosts costs = measure_model(*probe, rows, T, 3, rk.pg.get());
  take_slowest(costs, *rk.pg, kCPU);
  const train::LayoutDecision d =
      train::decide_layout(text, *probe, costs, LinkCosts{}, rk.pg.get(), rk.store.get(), rank, 2, rows, T, 0);
  const Layout l = resolve_layout(parse_annotation(d.text), names, 2);
  ASSERT_EQ(l.stage_blocks.size(), 2u) << d.text;
  const int64_t n0 = l.stage_blocks[0].second + 1;
  EXPECT_GT(n0, 4) << d.text;  // the fast rank takes more than half
  ASSERT_EQ(d.probe_ms.size(), 2u);
  EXPECT_GT(d.probe_ms[1], d.probe_ms[0]);

  Generator gen(11);
  const Tensor idx = randint(0, cfg.vocab_size, {micro * rows, T}, DType::i64, kCPU, &gen);
  const Tensor tgt = randint(0, cfg.vocab_size, {micro * rows, T}, DType::i64, kCPU, &gen);
  const int steps = 6;
  auto run = [&](std::vector<int64_t> layers, std::vector<double>& losses) {
    auto model = build();
    PipelineOptions po;
    po.micro_batches = micro;
    po.layers = std::move(layers);
    Strategy s(*model, rk.pg, po, StrategyConfig{}, OptimizerConfig{.lr = 1e-3});
    std::vector<double> times;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const StepValues v = s.step(micro, [&](int64_t m) {
        return std::make_pair(narrow(idx, 0, m * rows, rows), narrow(tgt, 0, m * rows, rows));
      }, 1e-3, 1.0);
      losses.push_back(s.read(v, false).loss);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin() + 1, times.end());
    return times[size_t(steps / 2 + 1)];
  };
  std::vector<double> even_losses, aware_losses;
  const double even = run({4, 4}, even_losses);
  const double aware = run({n0, cfg.n_layer - n0}, aware_losses);
  if (rank == 0)
    std::printf("balance=time: probe %.1f / %.1f ms -> %s; median step even %.1f ms, balanced %.1f ms (%.2fx)\n",
                d.probe_ms[0], d.probe_ms[1], d.text.c_str(), even * 1e3, aware * 1e3, even / aware);
  EXPECT_LT(aware, 0.9 * even) << "even " << even << " s, balanced " << aware << " s";
  for (int i = 0; i < steps; ++i)
    EXPECT_NEAR(aware_losses[size_t(i)], even_losses[size_t(i)], 1e-6 * std::abs(even_losses[size_t(i)])) << "step " << i;

  // A budget between what the first stage holds with n0 and with n0 - 1 blocks.
  auto stage_bytes = [&](int64_t first) {
    Layout m = l;
    m.stage_blocks = {{0, first - 1}, {first, cfg.n_layer - 1}};
    PlanJob job;
    job.world = 2, job.batch = rows * micro;
    return predict(m, costs, LinkCosts{}, job).stage_memory_bytes;
  };
  const double budget = 0.5 * (stage_bytes(n0)[0] + stage_bytes(n0 - 1)[0]);
  const train::LayoutDecision bounded =
      train::decide_layout(text, *probe, costs, LinkCosts{}, rk.pg.get(), rk.store.get(), rank, 2, rows, T, budget);
  const Layout lb = resolve_layout(parse_annotation(bounded.text), names, 2);
  const int64_t b0 = lb.stage_blocks[0].second + 1;
  EXPECT_LT(b0, n0) << bounded.text;
  const std::vector<double> fits = stage_bytes(b0);
  for (double bytes : fits) EXPECT_LE(bytes, budget) << bounded.text;
  if (rank == 0)
    std::printf("balance=time under %.0f bytes per stage: %s (stages predicted %.0f and %.0f bytes)\n", budget,
                bounded.text.c_str(), fits[0], fits[1]);
  const std::string e = error_of([&] {
    train::decide_layout(text, *probe, costs, LinkCosts{}, rk.pg.get(), rk.store.get(), rank, 2, rows, T, 1000.0);
  });
  EXPECT_NE(e.find("balance=time: 8 blocks do not fit the stages' memory"), std::string::npos) << e;
}

// Tensor parallelism on unequal ranks: rank 1 sleeps 0.4 ms per MLP column it holds in every
// block's forward (more than the compute, under the sanitizers too) (a device slower in proportion to its share, hidden from the splitter). The probe
// of the whole model on each rank gives the speeds; split(2) with even widths and with the
// probe's train the same losses as one process, the aware one in a shorter median step.
void hetero_tp() {
  Rank rk(60000ms);
  const int rank = rk.env.rank;
  models::GPTConfig cfg = test::tp_gpt_config();
  cfg.n_head = 8, cfg.n_embd = 64;  // 8 heads, 256 MLP columns: room for an uneven cut
  const int64_t B = 4, T = 16;
  const double per_column = 400e-6;
  auto slowed = [&](models::GPT& m) {
    if (rank == 1)
      m.add_block_hooks([&m, per_column](size_t i, const Tensor& x) {
        const auto* fc = dynamic_cast<nn::Linear*>(m.find_module("h." + std::to_string(i) + ".mlp.c_fc"));
        std::this_thread::sleep_for(std::chrono::duration<double>(per_column * double(fc->out_features)));
        return x;
      }, nullptr);
  };
  Generator gen(7);
  const Tensor idx = randint(0, 101, {B, T}, DType::i64, kCPU, &gen);
  const Tensor tgt = randint(0, 101, {B, T}, DType::i64, kCPU, &gen);
  const int steps = 6;
  const OptimizerConfig oc{.lr = 1e-3};
  std::vector<double> ref;
  {
    models::GPT model(cfg, 3);
    Strategy s(model, nullptr, StrategyConfig{}, oc);
    for (int i = 0; i < steps; ++i) ref.push_back(s.read(s.step(1, [&](int64_t) { return model.forward(idx, tgt).loss; }, 1e-3, 1.0), false).loss);
  }
  auto run = [&](const std::vector<double>& widths, std::vector<double>& losses) {
    models::GPT model(cfg, 3);
    apply_tensor_parallel(model, rk.pg, TPOptions{.widths = widths});
    slowed(model);
    StrategyConfig sc;
    sc.tp = rk.pg;
    Strategy s(model, nullptr, sc, oc);
    std::vector<double> times;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      losses.push_back(s.read(s.step(1, [&](int64_t) { return model.forward(idx, tgt).loss; }, 1e-3, 1.0), false).loss);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin() + 1, times.end());
    return times[size_t(steps / 2 + 1)];
  };
  std::vector<double> even_losses, aware_losses;
  const double even = run({}, even_losses);
  std::vector<double> speeds;
  {
    models::GPT probe_model(cfg, 3);
    slowed(probe_model);
    speeds = speeds_from_times(probe_step_times(probe_model, *rk.pg, B, T, 3));
  }
  const double aware = run(speeds, aware_losses);
  const std::vector<int64_t> heads = apportion_units(cfg.n_head, 1, speeds), cols = apportion_units(4 * cfg.n_embd, 1, speeds);
  if (rank == 0)
    std::printf("hetero tp: speeds %.3f/%.3f -> heads %lld/%lld, MLP columns %lld/%lld; median step even %.1f ms, "
                "aware %.1f ms (%.2fx)\n",
                speeds[0], speeds[1], static_cast<long long>(heads[0]), static_cast<long long>(heads[1]),
                static_cast<long long>(cols[0]), static_cast<long long>(cols[1]), even * 1e3, aware * 1e3, even / aware);
  EXPECT_GT(speeds[0], speeds[1]);
  EXPECT_GT(cols[0], cols[1]);
  EXPECT_LT(aware, 0.9 * even) << "even " << even << " s, aware " << aware << " s";
  for (int i = 0; i < steps; ++i) {
    EXPECT_NEAR(even_losses[size_t(i)], ref[size_t(i)], 1e-5 * ref[size_t(i)]) << "step " << i;
    EXPECT_NEAR(aware_losses[size_t(i)], ref[size_t(i)], 1e-5 * ref[size_t(i)]) << "step " << i;
  }
}

void mesh() {
  const DistEnv env = detect_env();
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 10000ms);
  const DeviceMesh m(store, env.rank, env.world_size, {{"dp", 2}, {"pp", 2}, {"tp", 2}},
                     gloo_group_factory(GlooOptions{.timeout = 20000ms}));
  const std::vector<std::vector<std::string>> subsets = {
      {"dp"}, {"pp"}, {"tp"}, {"dp", "pp"}, {"dp", "tp"}, {"pp", "tp"}, {"dp", "pp", "tp"}};
  for (const auto& dims : subsets) {
    const std::vector<int> members = m.group_ranks(dims);
    ProcessGroup& g = m.group(dims);
    ASSERT_EQ(g.size(), int(members.size()));
    ASSERT_EQ(members[size_t(g.rank())], env.rank);
    Tensor t = from_vector({double(env.rank + 1)}, {1}, DType::f64);
    g.all_reduce(t)->wait();
    double want = 0;
    for (int r : members) want += r + 1;
    ASSERT_EQ(t.item(), want) << "group over " << dims.size() << " dims";
  }
  ASSERT_EQ(&m.world(), &m.group({"tp", "pp", "dp"}));
}

// Each collective on f32 and f64, checked against its definition. Rank r's tensors hold
// values that depend on r so a wrong source shows.
void collectives() {
  Rank rk(5000ms);
  ProcessGroup& pg = *rk.pg;
  const int r = pg.rank(), W = pg.size();
  // 16-bit floats: moved as their bits, reduced in f32 and rounded once (these values are exact).
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    const int64_t n = 7;
    auto mine = [&](int rank) {
      std::vector<double> v;
      for (int64_t i = 0; i < n * W; ++i) v.push_back(double(rank + 1) * 0.5 + double(i));
      return v;
    };
    // all_reduce sum / avg / max
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      Tensor t = from_vector(mine(r), {n * W}, dt);
      const uint64_t v0 = t.storage()->version();
      pg.all_reduce(t, op)->wait();
      ASSERT_EQ(t.storage()->version(), v0 + 1);  // Note [Storage versions]: a collective's write counts
      std::vector<double> got = values(t);
      for (int64_t i = 0; i < n * W; ++i) {
        double s = 0, m = -1e30;
        for (int q = 0; q < W; ++q) s += mine(q)[size_t(i)], m = std::max(m, mine(q)[size_t(i)]);
        const double want = op == ReduceOp::sum ? s : op == ReduceOp::avg ? s / W : m;
        ASSERT_NEAR(got[size_t(i)], want, 1e-5 * std::abs(want)) << reduce_op_name(op) << " " << dt << " i=" << i;
      }
    }
    // reduce_scatter: chunk r of the sum
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
      Tensor in = from_vector(mine(r), {n * W}, dt), out = zeros({n}, dt);
      const uint64_t in0 = in.storage()->version(), out0 = out.storage()->version();
      pg.reduce_scatter(out, in, op)->wait();
      ASSERT_EQ(in.storage()->version(), in0);
      ASSERT_EQ(out.storage()->version(), out0 + 1);
      std::vector<double> got = values(out);
      for (int64_t i = 0; i < n; ++i) {
        double s = 0;
        for (int q = 0; q < W; ++q) s += mine(q)[size_t(r * n + i)];
        if (op == ReduceOp::avg) s /= W;
        ASSERT_NEAR(got[size_t(i)], s, 1e-5 * std::abs(s)) << "reduce_scatter " << dt << " i=" << i;
      }
    }
    // all_gather
    {
      Tensor in = full({n}, double(r) + 0.25, dt), out = zeros({n * W}, dt);
      const uint64_t in0 = in.storage()->version(), out0 = out.storage()->version();
      pg.all_gather(out, in)->wait();
      ASSERT_EQ(in.storage()->version(), in0);
      ASSERT_EQ(out.storage()->version(), out0 + 1);
      std::vector<double> got = values(out);
      for (int q = 0; q < W; ++q)
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[size_t(q * n + i)], double(q) + 0.25);
    }
    // broadcast from the last rank
    {
      Tensor t = full({n}, double(r), dt);
      const uint64_t v0 = t.storage()->version();
      pg.broadcast(t, W - 1)->wait();
      ASSERT_EQ(t.storage()->version(), v0 + 1);  // also on the root: conservative
      for (double v : values(t)) ASSERT_EQ(v, double(W - 1));
    }
    // send/recv around a ring: every rank sends first, then receives (p2p does not queue)
    {
      Tensor s = full({n}, double(r) * 10, dt), got = zeros({n}, dt);
      const uint64_t got0 = got.storage()->version();
      const int right = (r + 1) % W, left = (r + W - 1) % W;
      WorkPtr a = pg.send(s, right, 5);
      WorkPtr b = pg.recv(got, left, 5);
      a->wait();
      b->wait();
      for (double v : values(got)) ASSERT_EQ(v, double(left) * 10);
      ASSERT_EQ(got.storage()->version(), got0 + 1);
    }
  }
  // Many queued operations complete in order; is_completed turns true.
  std::vector<Tensor> ts;
  std::vector<WorkPtr> ws;
  for (int i = 0; i < 20; ++i) {
    ts.push_back(full({3}, double(i), DType::f32));
    ws.push_back(pg.all_reduce(ts.back(), ReduceOp::sum));
  }
  ws.push_back(pg.barrier());
  for (auto& w : ws) w->wait();
  for (int i = 0; i < 20; ++i) ASSERT_EQ(values(ts[size_t(i)])[0], double(i) * W);
  ASSERT_TRUE(ws.back()->is_completed());
  // Argument errors are immediate and name what was expected.
  std::string e = error_of([&] { pg.all_reduce(zeros({2}, DType::u8)); });
  EXPECT_NE(e.find("expected dtype f32, f64, bf16, f16, i32 or i64, got u8"), std::string::npos) << e;
  e = error_of([&] { pg.all_reduce(transpose(zeros({2, 3}), 0, 1)); });
  EXPECT_NE(e.find("expected a contiguous tensor"), std::string::npos) << e;
  e = error_of([&] { pg.all_gather(zeros({5}), zeros({2})); });
  EXPECT_NE(e.find("output must hold size"), std::string::npos) << e;
  e = error_of([&] { pg.broadcast(zeros({1}), W); });
  EXPECT_NE(e.find("broadcast root must be a rank in [0, " + std::to_string(W) + ")"), std::string::npos) << e;
  pg.barrier()->wait();
}

// Rank 1 leaves after one all-reduce; the others must get an error from their next collective
// within the timeout (2 s) and say so.
void peer_dies() {
  Rank rk(2000ms);
  ProcessGroup& pg = *rk.pg;
  Tensor t = ones({4});
  pg.all_reduce(t)->wait();
  if (pg.rank() == 1) {
    std::fflush(nullptr);
    ::_exit(0);  // exit 0, so the launcher lets the others report
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string e;
  try {
    for (int i = 0; i < 1000; ++i) pg.all_reduce(t)->wait();
  } catch (const Error& err) {
    e = err.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("survivor error after %.2f s: %s\n", s, e.c_str());
  ASSERT_FALSE(e.empty()) << "no error although rank 1 exited";
  EXPECT_NE(e.find("gloo all_reduce failed on rank " + std::to_string(pg.rank())), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1 is lost: it did not answer the group's roll call within 500 ms"), std::string::npos) << e;
  EXPECT_LT(s, 2.0 + 1.5);
  // The group is broken now: later calls fail too, at once.
  const std::string again = error_of([&] { pg.barrier()->wait(); });
  EXPECT_NE(again.find("failed earlier"), std::string::npos) << again;
  std::fflush(nullptr);
  ::_exit(::testing::Test::HasFailure() ? 1 : 0);  // skip the group's destructor (its peer is gone)
}

// Rank 1 stops answering (alive, sockets open) for longer than the timeout (1 s, lowered to 0.7 s
// for the operations issued after set_timeout): the others must fail by that timeout, not hang, and
// say during what.
void peer_stalls() {
  Rank rk(1000ms);
  ProcessGroup& pg = *rk.pg;
  Tensor t = ones({4});
  pg.all_reduce(t)->wait();
  if (pg.rank() == 1) {
    std::this_thread::sleep_for(2500ms);
    std::fflush(nullptr);
    ::_exit(0);
  }
  pg.set_timeout(700ms);
  pg.set_phase("the test's second all-reduce");
  EXPECT_EQ(pg.timeout(), 700ms);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] { pg.all_reduce(t)->wait(); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("survivor error after %.2f s: %s\n", s, e.c_str());
  EXPECT_NE(e.find("during the test's second all-reduce (timeout 700 ms"), std::string::npos) << e;
  EXPECT_GE(s, 0.6);
  EXPECT_LT(s, 2.4);
  std::fflush(nullptr);
  ::_exit(::testing::Test::HasFailure() ? 1 : 0);
}

// fp16 loss scaling where each rank checks its own gradients (as under ZeRO-2): only the last rank
// overflows, and with the all-reduced verdict every rank skips the step and halves its scale.
void scaler_agree() {
  Rank rk(5000ms);
  ProcessGroup& pg = *rk.pg;
  const bool last = pg.rank() == pg.size() - 1;
  Tensor p = zeros({3});
  p.set_requires_grad(true);
  p.set_grad(from_vector({1.0, last ? std::numeric_limits<double>::infinity() : 2.0, 3.0}, {3}));
  optim::LossScaler s(1024.0, 2000);
  const bool finite = s.unscale_and_check({p}, [&](bool local) {
    const Tensor bad = full({1}, local ? 0.0 : 1.0);
    pg.all_reduce(bad, ReduceOp::max)->wait();
    return bad.item() == 0.0;
  });
  EXPECT_FALSE(finite) << "rank " << pg.rank();
  EXPECT_EQ(s.scale(), 512.0);
  EXPECT_EQ(s.skipped_steps(), 1);
  pg.barrier()->wait();
}

// Each rank's costs, slower with its rank (the update slowest on rank 0): every rank ends with
// each time's largest.
void slowest_costs() {
  Rank rk(5000ms);
  ProcessGroup& pg = *rk.pg;
  const double r = pg.rank(), last = pg.size() - 1;
  ModelCosts m;
  m.block_per_seq_s = 0.01 * (r + 1);
  m.other_fixed_s = 0.5 - 0.1 * r;
  m.update_per_param_s = r == 0 ? 5.0 : 1.0;
  m.block_act_bytes = 1000;
  m.splits.push_back({.tp = 2, .block_fixed_s = 0.2 * (r + 1), .embed_per_seq_s = 3 - r});
  take_slowest(m, pg, kCPU);
  EXPECT_DOUBLE_EQ(m.block_per_seq_s, 0.01 * (last + 1));
  EXPECT_DOUBLE_EQ(m.other_fixed_s, 0.5);
  EXPECT_DOUBLE_EQ(m.update_per_param_s, 5.0);
  EXPECT_DOUBLE_EQ(m.block_act_bytes, 1000);
  EXPECT_DOUBLE_EQ(m.splits[0].block_fixed_s, 0.2 * (last + 1));
  EXPECT_DOUBLE_EQ(m.splits[0].embed_per_seq_s, 3);
  pg.barrier()->wait();
}

TEST(DistWorker, Run) {
  const std::string scenario = env_or("BLU_DIST_SCENARIO", "");
  if (scenario.empty()) GTEST_SKIP() << "only runs as a rank of a multi-process test";
  if (scenario == "collectives") return collectives();
  if (scenario == "mesh") return mesh();
  if (scenario == "probe_speeds") return probe_speeds();
  if (scenario == "hetero_train") return hetero_train();
  if (scenario == "hetero_auto") return hetero_auto();
  if (scenario == "hetero_tp") return hetero_tp();
  if (scenario == "hetero_stages") return hetero_stages();
  if (scenario == "peer_dies") return peer_dies();
  if (scenario == "peer_stalls") return peer_stalls();
  if (scenario == "train") return test::train_worker();
  if (scenario == "ddp_grads") return test::ddp_grads_worker();
  if (scenario == "scaler_agree") return scaler_agree();
  if (scenario == "slowest_costs") return slowest_costs();
  if (scenario == "zero_gate") return test::zero_gate_worker();
  if (scenario == "pipeline") return test::pipeline_worker();
  if (scenario == "tp_train") return test::tp_train_worker();
  if (scenario == "tp_ce") return test::tp_ce_worker();
  if (scenario == "tp_check") return test::tp_check_worker();
  if (scenario == "reshard") return test::reshard_worker();
  if (scenario == "reshard_fixture") return test::reshard_fixture_worker();
  FAIL() << "unknown scenario " << scenario;
}

}  // namespace
}  // namespace blu::dist
