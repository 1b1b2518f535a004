// NCCL process group, DDP and ZeRO on two GPUs (fp32 against one GPU; bf16: gradients are bucket
// views). Skipped unless at least two CUDA devices are visible — except NcclOneRank.*, ZeRO-2 as a
// one-rank NCCL group on one GPU: its buckets, staging buffers, row exchange and all-gather on the
// device and the communication stream (the collectives themselves are copies at one rank).
// The parent test re-runs this binary as 2 ranks under dist::launch (tests/dist/dist_test_util.h)
// with --gtest_filter=NcclWorker.Run and BLU_NCCL_SCENARIO naming what the ranks do; each rank
// uses cuda:LOCAL_RANK and reports through its exit status.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "common/tiny_gpt.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/dist/ddp.h"
#include "blu/dist/strategy.h"
#include "blu/dist/env.h"
#include "blu/dist/process_group.h"
#include "blu/dist/tcp_store.h"
#include "blu/dist/zero.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/optim/optimizer.h"
#include "blu/train/trainer.h"
#include "dist/dist_test_util.h"

namespace blu::dist {
namespace {

using namespace std::chrono_literals;

std::string scenario() {
  const char* v = std::getenv("BLU_NCCL_SCENARIO");
  return v ? v : "";
}

std::vector<double> host(const Tensor& t) { return to_vector(to_device(t, kCPU)); }

struct Rank {
  DistEnv env = detect_env();
  Device dev{DeviceType::cuda, 0};
  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  Rank() {
    dev = Device(DeviceType::cuda, env.local_rank);
    cuda::set_device(dev.index);
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, env.rank == 0, 20000ms);
    pg = make_nccl_group(*store, env.rank, env.world_size, NcclOptions{.timeout = 60000ms, .device = dev.index});
  }
};

// Every collective on device tensors of several dtypes, checked against its definition. Values
// are small integers (exact in bf16/f16) that depend on the rank, so a wrong source shows.
void collectives() {
  Rank rk;
  ProcessGroup& pg = *rk.pg;
  ASSERT_EQ(pg.backend(), "nccl");
  const int r = pg.rank(), W = pg.size();
  const int64_t n = 6;
  auto mine = [&](int rank) {
    std::vector<double> v;
    for (int64_t i = 0; i < n * W; ++i) v.push_back(double(rank + 1) + double(i));
    return v;
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64}) {
    SCOPED_TRACE(dtype_name(dt));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
      if (op == ReduceOp::avg && !is_floating(dt)) continue;
      Tensor t = to_device(from_vector(mine(r), {n * W}, dt), rk.dev);
      pg.all_reduce(t, op)->wait();
      const std::vector<double> got = host(t);
      for (int64_t i = 0; i < n * W; ++i) {
        double want = 0;
        for (int q = 0; q < W; ++q) want = op == ReduceOp::max ? std::max(want, mine(q)[i]) : want + mine(q)[i];
        if (op == ReduceOp::avg) want /= W;
        EXPECT_EQ(got[i], want) << reduce_op_name(op) << " at " << i;
      }
    }
    {  // all_gather: rank q's n elements land at [q·n, (q+1)·n)
      const std::vector<double> m = mine(r);
      Tensor in = to_device(from_vector(std::vector<double>(m.begin(), m.begin() + n), {n}, dt), rk.dev);
      Tensor out = zeros({n * W}, dt, rk.dev);
      pg.all_gather(out, in)->wait();
      const std::vector<double> got = host(out);
      for (int q = 0; q < W; ++q)
        for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[q * n + i], mine(q)[i]) << "all_gather";
    }
    {  // reduce_scatter: chunk r of the sum
      Tensor in = to_device(from_vector(mine(r), {n * W}, dt), rk.dev);
      Tensor out = zeros({n}, dt, rk.dev);
      pg.reduce_scatter(out, in, ReduceOp::sum)->wait();
      const std::vector<double> got = host(out);
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        for (int q = 0; q < W; ++q) want += mine(q)[r * n + i];
        EXPECT_EQ(got[i], want) << "reduce_scatter";
      }
    }
    {  // broadcast from the last rank
      Tensor t = to_device(from_vector(mine(r), {n * W}, dt), rk.dev);
      pg.broadcast(t, W - 1)->wait();
      EXPECT_EQ(host(t), mine(W - 1)) << "broadcast";
    }
  }
  // Point to point: rank 0 sends to rank 1.
  if (W >= 2 && r < 2) {
    Tensor t = r == 0 ? to_device(from_vector(mine(0), {n * W}, DType::f32), rk.dev) : zeros({n * W}, DType::f32, rk.dev);
    WorkPtr w = r == 0 ? pg.send(t, 1) : pg.recv(t, 0);
    w->wait();
    if (r == 1) {
      EXPECT_EQ(host(t), mine(0)) << "send/recv";
    }
  }
  // Wrong device / dtype are argument errors, not hangs.
  EXPECT_THROW(pg.all_reduce(zeros({2}, DType::f32, kCPU)), Error);
  EXPECT_THROW(pg.reduce_scatter(zeros({2}, DType::f32, rk.dev), zeros({3}, DType::f32, rk.dev)), Error);
  pg.barrier()->wait();
}

// Tiny GPT, 3 AdamW steps on a fixed global batch of 8 rows × 16 tokens: DDP over the ranks (rank
// r takes rows [r·8/W, (r+1)·8/W)) against one GPU training on all 8 rows (rank 0 runs it too).
constexpr int64_t kRows = 8, kT = 16, kSteps = 3;

int32_t token(int64_t step, int64_t row, int64_t t) {
  uint64_t x = uint64_t(step * 1000003 + row * 131 + t) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return int32_t(x % 101);
}

Tensor batch(int64_t step, int64_t row0, int64_t rows, int64_t shift, Device dev) {
  std::vector<double> v;
  for (int64_t row = row0; row < row0 + rows; ++row)
    for (int64_t t = 0; t < kT; ++t) v.push_back(token(step, row, t + shift));
  return to_device(from_vector(v, {rows, kT}, DType::i32), dev);
}

// Row exchange of the tied embedding for a DDP of its own: "" off, "gather" or "dense" forced.
DDPOptions ddp_options(models::GPT& model, const std::string& rows, DDPOptions o) {
  if (rows.empty()) return o;
  o.exchange_rows = {model.wte.get()};
  o.rows_gather_limit = rows == "gather" ? 1e9 : 0.0;
  return o;
}

// Through dist::Strategy, as the trainer runs it. Row exchange of the tied embedding (dist/ddp.h):
// "" off, "gather" or "dense" forced.
std::vector<double> train(models::GPT& model, ProcessGroup* pg, int zero, const std::string& row_path, int r, int W,
                          Device dev) {
  std::shared_ptr<ProcessGroup> shared(pg, [](ProcessGroup*) {});
  StrategyConfig sc;
  sc.zero = zero;
  sc.row_exchange = !row_path.empty();
  sc.rows_gather_limit = row_path == "gather" ? 1e9 : 0.0;
  sc.ddp.bucket_mib = 0.02;
  sc.zero_bucket_mib = 0.02;  // small buckets, as the CPU tests: parameters split across buckets and chunks
  Strategy strategy(model, pg ? shared : nullptr, sc,
                    OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  const int64_t rows = kRows / W;
  for (int64_t step = 0; step < kSteps; ++step) {
    strategy.step(1, [&](int64_t) {
      return model.forward(batch(step, r * rows, rows, 0, dev), batch(step, r * rows, rows, 1, dev)).loss;
    }, 1e-3, 1.0);
    if (pg && !row_path.empty()) {
      EXPECT_EQ(strategy.ddp() ? strategy.ddp()->row_exchange_paths() : strategy.zero()->row_exchange_paths(),
                std::vector<std::string>{row_path});
    }
  }
  std::vector<double> all;
  for (const Tensor& p : model.parameters())
    for (double v : host(p)) all.push_back(v);
  return all;
}

void ddp_matches_single(int zero, const std::string& row_path = "") {
  Rank rk;
  const int r = rk.env.rank, W = rk.env.world_size;
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  models::GPT model(cfg, 1234 + uint64_t(r));  // different per rank on purpose: DDP broadcasts rank 0's
  model.to(rk.dev);
  model.train();
  train::apply_precision(model, "fp32");  // IEEE matmuls: the comparison is at fp32 tolerance
  const std::vector<double> dist_params = train(model, rk.pg.get(), zero, row_path, r, W, rk.dev);
  if (r == 0) {
    models::GPT ref(cfg, 1234);
    ref.to(rk.dev);
    ref.train();
    const std::vector<double> ref_params = train(ref, nullptr, 0, "", 0, 1, rk.dev);
    ASSERT_EQ(dist_params.size(), ref_params.size());
    double worst = 0;
    for (size_t i = 0; i < ref_params.size(); ++i) worst = std::max(worst, std::abs(dist_params[i] - ref_params[i]));
    EXPECT_LT(worst, 2e-4) << "largest parameter difference, " << (zero ? "ZeRO-" + std::to_string(zero) : "DDP")
                           << " (" << W << " GPUs, rows '" << row_path << "') vs one GPU";
    std::printf("%s on %d GPU(s), rows '%s': largest parameter difference vs one GPU %.3g\n",
                zero ? ("ZeRO-" + std::to_string(zero)).c_str() : "DDP", W, row_path.c_str(), worst);
  }
  rk.pg->barrier()->wait();
}

// bf16 compute under DDP on the GPUs: every .grad is a view of a bucket buffer after finish()
// (the master weights' casts wrote into the buckets; nothing had to be copied), and the averaged
// gradients match one GPU's on the whole batch to bf16 accuracy — with the embedding's rows
// exchanged apart too (`rows`).
void ddp_bf16_views(const std::string& row_path) {
  Rank rk;
  const int r = rk.env.rank, W = rk.env.world_size;
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  models::GPT model(cfg, 1234 + uint64_t(r));
  model.to(rk.dev);
  model.set_compute_dtype(DType::bf16);
  DistributedDataParallel ddp(model, rk.pg, ddp_options(model, row_path, {.bucket_mib = 0.02, .first_bucket_mib = 0.001}));
  std::vector<const Storage*> buckets;
  for (size_t b = 0; b < ddp.bucket_layout().size(); ++b) buckets.push_back(ddp.bucket_buffer(b).storage().get());
  models::GPT ref(cfg, 1234);
  ref.to(rk.dev);
  ref.set_compute_dtype(DType::bf16);
  const int64_t rows = kRows / W;
  for (int64_t step = 0; step < 2; ++step) {
    model.zero_grad();
    model.forward(batch(step, r * rows, rows, 0, rk.dev), batch(step, r * rows, rows, 1, rk.dev)).loss.backward();
    ddp.finish();
    for (const auto& [name, p] : model.named_parameters()) {
      const Tensor g = p.grad();
      ASSERT_TRUE(g.defined()) << name;
      EXPECT_NE(std::find(buckets.begin(), buckets.end(), g.storage().get()), buckets.end())
          << name << " is not a bucket view";
    }
    if (r != 0) continue;
    ref.zero_grad();
    ref.forward(batch(step, 0, kRows, 0, rk.dev), batch(step, 0, kRows, 1, rk.dev)).loss.backward();
    double worst = 0, scale = 0;
    const auto got = model.parameters(), want = ref.parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      const std::vector<double> a = host(got[i].grad()), b = host(want[i].grad());
      for (size_t k = 0; k < b.size(); ++k) {
        worst = std::max(worst, std::abs(a[k] - b[k]));
        scale = std::max(scale, std::abs(b[k]));
      }
    }
    EXPECT_LE(worst, 0.05 * scale) << "step " << step << ": DDP bf16 gradients vs one GPU";
  }
  EXPECT_EQ(ddp.copied_gradients(), 0);
  rk.pg->barrier()->wait();
}

// All-reduces through the peer window (dist/nccl_peer_window.h) against NCCL's own on the same
// inputs, bitwise: a 1 MiB window, so the ring wraps and operations wait for the peer to have
// consumed a region; several in flight before the first wait, as DDP's buckets; one tensor larger
// than the window (NCCL's path); every float dtype, sum and average.
void peer_window() {
  Rank rk;
  std::shared_ptr<ProcessGroup> win = make_nccl_group(
      *rk.store, rk.env.rank, rk.env.world_size,
      NcclOptions{.timeout = 60000ms, .device = rk.dev.index, .prefix = "peer", .peer_window_mib = 1.0});
  Generator gen(1234);  // the same on both ranks: each rank offsets its inputs by its rank
  std::vector<std::pair<Tensor, Tensor>> pairs;  // (through the window, through NCCL)
  std::vector<WorkPtr> works;
  for (int i = 0; i < 120; ++i) {
    const DType dt = std::array{DType::f32, DType::bf16, DType::f16, DType::f64}[size_t(i % 4)];
    const int64_t n = i == 77 ? int64_t(1) << 19 : 1 + (int64_t(i) * 7919) % 60000;  // #77: 1-4 MiB
    const ReduceOp op = i % 3 == 0 ? ReduceOp::sum : ReduceOp::avg;
    const Tensor x = to_dtype(add(randn({n}, DType::f32, kCPU, &gen), double(rk.env.rank) * 0.25), dt);
    Tensor a = to_device(x, rk.dev), b = to_device(x, rk.dev);
    works.push_back(win->all_reduce(a, op));
    works.push_back(rk.pg->all_reduce(b, op));
    pairs.emplace_back(a, b);
    if (i % 8 == 7)
      for (WorkPtr& w : std::exchange(works, {})) w->wait();
  }
  for (WorkPtr& w : works) w->wait();
  for (size_t i = 0; i < pairs.size(); ++i)
    ASSERT_EQ(host(pairs[i].first), host(pairs[i].second)) << "all-reduce " << i << " " << pairs[i].first.str();
  win->barrier()->wait();
}

TEST(NcclWorker, Run) {
  const std::string s = scenario();
  if (s.empty()) GTEST_SKIP() << "only runs as a rank of a multi-GPU test";
  if (s == "collectives") return collectives();
  if (s == "peer_window") return peer_window();
  if (s == "ddp") return ddp_matches_single(0);
  if (s == "zero1") return ddp_matches_single(1);
  if (s == "ddp_bf16_views") return ddp_bf16_views("");
  if (s == "ddp_bf16_views_rows") return ddp_bf16_views("gather");
  if (s == "ddp_rows_gather") return ddp_matches_single(0, "gather");
  if (s == "ddp_rows_dense") return ddp_matches_single(0, "dense");
  if (s == "zero1_rows") return ddp_matches_single(1, "gather");
  if (s == "zero2") return ddp_matches_single(2);
  if (s == "zero2_rows_gather") return ddp_matches_single(2, "gather");
  if (s == "zero2_rows_dense") return ddp_matches_single(2, "dense");
  FAIL() << "unknown scenario " << s;
}

void run_ranks(const std::string& s, int n, const std::string& peer_window_mib = "",
               test::LaunchResult* out = nullptr) {
  if (cuda::device_count() < n) GTEST_SKIP() << "needs " << n << " GPUs, " << cuda::device_count() << " visible";
  test::LaunchResult res = test::run_command(
      n, {test::self_exe(), "--gtest_filter=NcclWorker.Run", "--gtest_brief=1"},
      {{"BLU_NCCL_SCENARIO", s}, {"OMP_NUM_THREADS", "2"}, {"BLU_NCCL_PEER_WINDOW_MIB", peer_window_mib}});
  EXPECT_EQ(res.status, 0) << "stdout:\n" << res.out << "\nstderr:\n" << res.err;
  if (out) *out = std::move(res);
}
void run_two_ranks(const std::string& s) { run_ranks(s, 2); }

TEST(Nccl, CollectivesOnDeviceTensors) { run_two_ranks("collectives"); }
TEST(Nccl, PeerWindowAllReduceIsNcclsBitForBit) {
  test::LaunchResult r;
  run_ranks("peer_window", 2, "", &r);
  EXPECT_EQ(r.err.find("no peer window"), std::string::npos) << r.err;
}
// DDP's buckets through a 64 MiB peer window (BLU_NCCL_PEER_WINDOW_MIB), against one GPU.
TEST(Nccl, DdpThroughThePeerWindowMatchesSingleGpu) {
  test::LaunchResult r;
  run_ranks("ddp", 2, "64", &r);
  EXPECT_EQ(r.err.find("no peer window"), std::string::npos) << r.err;
}
TEST(Nccl, DdpMatchesSingleGpu) { run_two_ranks("ddp"); }
TEST(Nccl, Zero1MatchesSingleGpu) { run_two_ranks("zero1"); }
TEST(Nccl, DdpBf16GradsAreBucketViews) { run_two_ranks("ddp_bf16_views"); }
// The tied embedding's rows exchanged apart (DDPOptions::exchange_rows), gathered or dense.
TEST(Nccl, DdpRowExchangeGatherMatchesSingleGpu) { run_two_ranks("ddp_rows_gather"); }
TEST(Nccl, DdpRowExchangeDenseMatchesSingleGpu) { run_two_ranks("ddp_rows_dense"); }
TEST(Nccl, Zero1RowExchangeMatchesSingleGpu) { run_two_ranks("zero1_rows"); }
TEST(Nccl, DdpRowExchangeBf16GradsAreBucketViews) { run_two_ranks("ddp_bf16_views_rows"); }
// ZeRO-2 (gradients reduce-scattered during backward), without and with the row exchange.
TEST(Nccl, Zero2MatchesSingleGpu) { run_two_ranks("zero2"); }
TEST(Nccl, Zero2RowExchangeGatherMatchesSingleGpu) { run_two_ranks("zero2_rows_gather"); }
TEST(Nccl, Zero2RowExchangeDenseMatchesSingleGpu) { run_two_ranks("zero2_rows_dense"); }
TEST(NcclOneRank, Zero2MatchesPlainAdamW) { run_ranks("zero2", 1); }
TEST(NcclOneRank, Zero2RowExchangeGatherMatchesPlainAdamW) { run_ranks("zero2_rows_gather", 1); }
TEST(NcclOneRank, Zero2RowExchangeDenseMatchesPlainAdamW) { run_ranks("zero2_rows_dense", 1); }

}  // namespace
}  // namespace blu::dist
