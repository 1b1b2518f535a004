// ZeroAdamW stage 2 in one process (a one-rank Gloo group; the multi-rank runs are in
// train_test.cpp): the bucket layout follows the reduction order, backward releases every gradient
// into the buckets as it goes (Note [ZeRO-2 buckets]), the updates are bitwise those of optim's
// AdamW, accumulation under set_sync(false) reduces once, and a gradient set by hand is reduced by
// reduce_gradients(). Memory against DDP and ZeRO-1 on 2 ranks: DataParallel.ZeroStagesMatchDDP.
// The norm gate (norm_gate + step(gate)) against clip_grad_norm + step(): on one rank here, on 2
// and 3 ranks for both stages in ZeroGate.MatchesClipThenStepOnSeveralRanks (zero_gate_harness.h).
#include <gtest/gtest.h>

#include <set>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/dist/zero.h"
#include "blu/models/gpt2/gpt2.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

using namespace std::chrono_literals;

struct OneRank {
  TcpStore store{"127.0.0.1", 0, true, 10000ms};
  std::shared_ptr<ProcessGroup> pg =
      make_gloo_group(store, 0, 1, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
};

models::GPTConfig config() {
  models::GPTConfig c = ::blu::test::tiny_gpt();
  c.n_layer = 4;
  return c;
}

std::vector<std::string> reverse_names(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& [name, t] : m.named_parameters()) out.insert(out.begin(), name);
  return out;
}

const optim::AdamWOptions kAdam{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};

std::unique_ptr<ZeroAdamW> make_zero2(models::GPT& model, const std::shared_ptr<ProcessGroup>& pg) {
  return std::make_unique<ZeroAdamW>(optim::decay_groups(model.named_parameters(), 0.1), kAdam, pg, 2,
                                     zero_options_for(model, 0.05, model.wte.get()));
}

// Batch `k` of 4 rows × 16 tokens.
std::pair<Tensor, Tensor> batch(int k) {
  std::vector<double> in, tg;
  for (int i = 0; i < 4 * 17; ++i) (i % 17 < 16 ? in : tg).push_back(double((i * 37 + k * 11) % 101));
  std::vector<double> targets;
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < 16; ++t) targets.push_back(t + 1 < 16 ? in[size_t(r * 16 + t + 1)] : tg[size_t(r)]);
  return {from_vector(in, {4, 16}, DType::i32), from_vector(targets, {4, 16}, DType::i32)};
}

TEST(Zero2, BucketsFollowTheReductionOrder) {
  OneRank one;
  models::GPT model(config(), 7);
  auto opt = make_zero2(model, one.pg);
  const auto layout = opt->bucket_layout();
  EXPECT_GE(layout.size(), 4u);
  std::vector<std::string> flat;
  for (const auto& b : layout) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, reverse_names(model));
  EXPECT_EQ(layout.back(), std::vector<std::string>{"wte.weight"});  // solo: alone, and last
  EXPECT_THROW(ZeroAdamW(optim::decay_groups(model.named_parameters(), 0.1), kAdam, one.pg, 2,
                         ZeroOptions{.bucket_mib = 1, .reduce_order = {}, .solo = {"no.such"}}),
               Error);
  EXPECT_EQ(opt->shard_numel(), model.num_parameters());  // one rank: the whole vector
}

// Two steps, the second with two micro-batches: ZeRO-2 on one rank gives bitwise the weights of
// optim's AdamW on the same gradients, and no parameter keeps a gradient after a synced backward.
TEST(Zero2, ReleasesGradientsAndMatchesAdamW) {
  OneRank one;
  models::GPT a(config(), 7), b(config(), 7);
  auto zero = make_zero2(a, one.pg);
  auto plain = optim::make_adamw(optim::decay_groups(b.named_parameters(), 0.1), kAdam);
  for (int step = 0; step < 2; ++step) {
    zero->zero_grad();
    plain->zero_grad();
    const int micro = step + 1;
    for (int m = 0; m < micro; ++m) {
      const auto [idx, tgt] = batch(step * 2 + m);
      zero->set_sync(m + 1 == micro);
      mul(a.forward(idx, tgt).loss, 1.0 / micro).backward();
      mul(b.forward(idx, tgt).loss, 1.0 / micro).backward();
      for (const auto& [name, t] : a.named_parameters())
        EXPECT_EQ(t.grad().defined(), m + 1 < micro) << name << " after micro-batch " << m;
    }
    zero->step();
    plain->step();
  }
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(to_vector(pa[i].second), to_vector(pb[i].second)) << pa[i].first;
  // A parameter with a gradient but no backward (set by hand) is reduced by reduce_gradients().
  zero->zero_grad();
  Tensor w = a.named_parameters()[0].second;
  w.set_grad(full(w.shape(), 2.0, DType::f32));
  EXPECT_NEAR(zero->clip_grad_norm(1e9), 2.0 * std::sqrt(double(w.numel())), 1e-6);
  EXPECT_FALSE(w.grad().defined());
}

// One rank, stage 2: norm_gate + step(gate) equals clip_grad_norm + step() bit for bit with
// clipping active, and a gradient set by hand is reduced by norm_gate as by clip_grad_norm.
TEST(Zero2, NormGateMatchesClipThenStep) {
  OneRank one;
  models::GPT a(config(), 7), b(config(), 7);
  auto ref = make_zero2(a, one.pg), gated = make_zero2(b, one.pg);
  for (int step = 0; step < 2; ++step) {
    const auto [idx, tgt] = batch(step);
    a.forward(idx, tgt).loss.backward();
    b.forward(idx, tgt).loss.backward();
    const double norm = ref->clip_grad_norm(0.05);
    EXPECT_GT(norm, 0.05);  // clipping active
    ref->step();
    const NormGate gate = gated->norm_gate(0.05);
    EXPECT_EQ(gate.sum_squares.dim(), 0);
    EXPECT_EQ(gate.max_norm, 0.05);
    gated->step(gate);
    EXPECT_EQ(optim::gate_norm(gate), norm);
  }
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(::blu::test::bitwise_equal(pa[i].second, pb[i].second)) << pa[i].first;
  Tensor w = b.named_parameters()[0].second;
  w.set_grad(full(w.shape(), 2.0, DType::f32));
  EXPECT_NEAR(optim::gate_norm(gated->norm_gate(1e9)), 2.0 * std::sqrt(double(w.numel())), 1e-6);
  EXPECT_FALSE(w.grad().defined());
}

// Several ranks, both stages (zero_gate_harness.h): the gated path equals clip_grad_norm + step()
// step after step, clipping active and not, and a NaN on one rank leaves every rank's parameters
// and moments as they were; no host read on the gated path.
TEST(ZeroGate, MatchesClipThenStepOnSeveralRanks) {
  for (const auto& [stage, ranks] : std::vector<std::pair<int, int>>{{1, 2}, {2, 2}, {2, 3}}) {
    const LaunchResult r = run_workers("zero_gate", ranks, {{"BLU_DIST_STAGE", std::to_string(stage)}});
    EXPECT_EQ(r.status, 0) << "stage " << stage << ", " << ranks << " ranks\nstdout:\n" << r.out << "\nstderr:\n"
                           << r.err;
  }
}

}  // namespace
}  // namespace blu::dist::test
