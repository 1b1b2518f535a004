// models/activations: every activation policy — selective, mlp, whole-block, every-N-th-block and
// first-K-blocks recompute, offload to host memory, and their combinations — trains GPT-2 (dropout on) and Llama
// for ten AdamW steps with losses and gradients bitwise equal to the plain run; the device memory
// the activations hold after the forward moves by exactly what activation_bytes() predicts, and the
// step's peak falls with it; a recomputed block passes a float64 gradcheck.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>

#include "blu/autograd/checkpoint.h"
#include "blu/blu.h"
#include "blu/memory/host_transfer.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/optim/optimizer.h"
#include "common/checks.h"
#include "common/tiny_gpt.h"
#include "train/train_test_util.h"

namespace blu::test {
namespace {

using models::ActivationPolicy;
using models::CausalLM;

std::unique_ptr<CausalLM> make_model(const std::string& family) {
  if (family == "gpt2") {
    models::GPTConfig c = tiny_gpt();
    c.n_layer = 4;
    c.dropout = 0.1;  // the rebuilt blocks must draw the same masks
    return std::make_unique<models::GPT>(c, 11);
  }
  models::LlamaConfig c = models::LlamaConfig::preset("tiny");
  c.num_hidden_layers = 4;
  return std::make_unique<models::Llama>(c, 11);
}

struct Batch {
  Tensor idx, targets;
};

Batch make_batch(const CausalLM& m, int64_t B, int64_t T) {
  Generator g(5);
  return {randint(0, m.vocab_size(), {B, T}, DType::i64, kCPU, &g), randint(0, m.vocab_size(), {B, T}, DType::i64, kCPU, &g)};
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> grads;  // after the last backward, by parameter
  int64_t rebuilds = 0;
  int64_t offloaded = 0;
};

TrainRun train(const std::string& family, const ActivationPolicy& policy, int steps = 10) {
  auto model = make_model(family);
  model->set_activation_policy(policy);
  const Batch b = make_batch(*model, 2, 16);
  auto opt = optim::make_adamw(optim::decay_groups(model->named_parameters(), 0.1), optim::AdamWOptions{.lr = 3e-3});
  TrainRun r;
  const int64_t rebuilds0 = recompute_rebuild_count();
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    Tensor loss = model->forward(b.idx, b.targets).loss;
    loss.backward();
    r.losses.push_back(loss.item());
    if (s + 1 == steps)
      for (auto& [name, p] : model->named_parameters()) r.grads.push_back(to_vector(p.grad()));
    opt->step();
  }
  r.rebuilds = recompute_rebuild_count() - rebuilds0;
  if (const auto* off = model->activation_offloader()) r.offloaded = off->bytes_offloaded();
  return r;
}


class ActivationPolicies : public ::testing::TestWithParam<std::string> {};

TEST_P(ActivationPolicies, TenStepsBitwiseEqualToThePlainRun) {
  const std::string family = GetParam();
  const TrainRun plain = train(family, ActivationPolicy{});
  EXPECT_EQ(plain.rebuilds, 0);
  EXPECT_LT(plain.losses.back(), plain.losses.front()) << "the run should learn the batch";
  const size_t n_blocks = 4;
  for (bool offload : {false, true}) {
    for (const std::string& name : std::vector<std::string>{"none", "selective", "mlp", "selective+mlp", "block",
                                                            "block:2", "selective+block:2", "mlp+block:2",
                                                            "mlp:2", "selective+mlp:3+block:2", "mlp-first:3",
                                                            "selective+mlp-first:2+block-first:1"}) {
      if (name == "none" && !offload) continue;
      const ActivationPolicy p = ActivationPolicy::parse(name, offload);
      SCOPED_TRACE(family + " --recompute " + name + (offload ? " --offload-activations" : ""));
      const TrainRun r = train(family, p);
      ASSERT_EQ(r.losses.size(), plain.losses.size());
      for (size_t s = 0; s < r.losses.size(); ++s) EXPECT_EQ(r.losses[s], plain.losses[s]) << "loss of step " << s;
      ASSERT_EQ(r.grads.size(), plain.grads.size());
      for (size_t i = 0; i < r.grads.size(); ++i) EXPECT_EQ(r.grads[i], plain.grads[i]) << "gradient " << i;
      // Something was really recomputed / offloaded: one rebuild per recomputed block per step, and
      // in the others one per selective region (GPT-2: the attention core; Llama: it and SwiGLU)
      // and per mlp region where mlp:N puts one (it holds Llama's SwiGLU region, rebuilt with it).
      int64_t want = 0;
      for (size_t i = 0; i < n_blocks; ++i) {
        if (p.recompute_block(i)) want += 1;
        else want += (p.selective ? 1 : 0) + (p.recompute_mlp(i) || (p.selective && family == "llama") ? 1 : 0);
      }
      EXPECT_EQ(r.rebuilds, want * 10);
      EXPECT_EQ(r.offloaded > 0, offload);
    }
  }
}

// Device bytes held after the forward (the loss kept, the logits dropped) and the step's peak above
// what was live before it, on the CPU allocator that plays the device; offloaded copies live in
// host_offload_allocator(). The gradients are kept from the warm-up step (each backward adds into
// them in place), so the peak is the activations' and the backward's temporaries'.
struct Memory {
  int64_t after_forward = 0, peak = 0;
};

Memory step_memory(CausalLM& model, const Batch& b) {
  Allocator& dev = cpu_allocator();
  const int64_t base = dev.stats().current_bytes;
  dev.reset_peak();
  Memory m;
  Tensor loss = model.forward(b.idx, b.targets).loss;
  m.after_forward = dev.stats().current_bytes - base;
  loss.backward();
  m.peak = dev.stats().peak_bytes - base;
  return m;
}

TEST_P(ActivationPolicies, DeviceMemoryFallsByWhatActivationBytesPredicts) {
  const std::string family = GetParam();
  const int64_t B = 4, T = 16;
  auto model = make_model(family);
  const Batch b = make_batch(*model, B, T);
  const size_t n = model->num_blocks();
  step_memory(*model, b);  // warm: lazily made tables, gradients allocated once
  const Memory plain = step_memory(*model, b);
  const std::vector<models::ActivationBytes> plain_bytes = models::activation_bytes(*model, B, T, ActivationPolicy{});
  int64_t plain_kept = 0;
  for (const auto& a : plain_bytes) {
    plain_kept += a.kept;
    EXPECT_EQ(a.offloaded, 0);
    EXPECT_EQ(a.recomputed, 0);
  }
  ASSERT_EQ(plain_bytes.size(), n);
  for (bool offload : {false, true}) {
    for (const std::string& name : std::vector<std::string>{"none", "selective", "mlp", "selective+mlp", "block",
                                                            "block:2", "selective+block:2", "mlp+block:2",
                                                            "mlp:2", "selective+mlp:3+block:2", "mlp-first:3",
                                                            "selective+mlp-first:2+block-first:1"}) {
      if (name == "none" && !offload) continue;
      const ActivationPolicy p = ActivationPolicy::parse(name, offload);
      SCOPED_TRACE(family + " --recompute " + name + (offload ? " --offload-activations" : ""));
      const std::vector<models::ActivationBytes> bytes = models::activation_bytes(*model, B, T, p);
      int64_t kept = 0, off = 0, largest_block = 0;
      for (size_t i = 0; i < n; ++i) {
        kept += bytes[i].kept, off += bytes[i].offloaded;
        EXPECT_EQ(bytes[i].kept + bytes[i].offloaded + bytes[i].recomputed, plain_bytes[i].kept) << "block " << i;
        if (p.recompute_block(i)) {
          EXPECT_GT(bytes[i].recomputed, 0) << "block " << i;
        }
        largest_block = std::max(largest_block, plain_bytes[i].kept);
      }
      EXPECT_LT(kept, plain_kept);
      model->set_activation_policy(p);
      const int64_t host0 = host_offload_allocator().stats().current_bytes;
      const Memory m = step_memory(*model, b);
      EXPECT_EQ(host_offload_allocator().stats().current_bytes, host0) << "host copies outlived the step";
      model->set_activation_policy(ActivationPolicy{});
      // After the forward: exactly the predicted difference.
      EXPECT_EQ(plain.after_forward - m.after_forward, plain_kept - kept);
      // The peak: lower by the prediction, less at most what is back on the device during one
      // block's backward: its rebuilt activations (one block's worth) when it recomputes, and
      // blocks i and i-1 fetched back when offloading.
      const int64_t drop = plain_kept - kept;
      const int64_t slack = ((p.block.any() || p.selective || p.mlp.any() ? 1 : 0) + (offload ? 2 : 0)) * largest_block;
      EXPECT_LE(m.peak, plain.peak - drop + slack) << "peak " << m.peak << ", plain " << plain.peak << ", drop " << drop;
      EXPECT_LT(m.peak, plain.peak);
      // The planner's totals agree with the per-block numbers.
      const models::ActivationTotals tot = models::activation_totals(*model, B, T, p);
      EXPECT_EQ(tot.blocks, int64_t(n));
      EXPECT_EQ(tot.kept_blocks + tot.offloaded_blocks + tot.recomputed_blocks, int64_t(n));
      EXPECT_EQ(tot.host_bytes, off);
      EXPECT_GE(tot.device_bytes, kept);
      EXPECT_LE(tot.device_bytes, kept + slack);
      std::cout << "[ memory ] " << family << " " << name << (offload ? " +offload" : "") << ": after forward "
                << m.after_forward << " B (plain " << plain.after_forward << "), peak " << m.peak << " B (plain "
                << plain.peak << "), predicted drop " << drop << " B, offloaded " << off << " B\n";
    }
  }
}

// A block's rebuild comes in backward after every later block has let its activations go, so the
// blocks to rebuild are the first ones: at the same count, mlp-first:K's peak is no higher than
// mlp:N's, whose set reaches further down the stack. A first-K past the model's blocks is refused.
TEST_P(ActivationPolicies, TheFirstBlocksAreTheOnesToRebuild) {
  const std::string family = GetParam();
  auto model = make_model(family);
  const Batch b = make_batch(*model, 4, 16);
  step_memory(*model, b);
  const auto peak = [&](const char* recompute) {
    model->set_activation_policy(ActivationPolicy::parse(recompute));
    const int64_t p = step_memory(*model, b).peak;
    std::cout << "[ memory ] " << family << " " << recompute << ": peak " << p << " B\n";
    return p;
  };
  const int64_t plain = peak("none"), every2 = peak("mlp:2"), first2 = peak("mlp-first:2"), first3 = peak("mlp-first:3");
  EXPECT_LT(every2, plain);
  EXPECT_LE(first2, every2);
  EXPECT_LE(first3, first2);
  EXPECT_NE(error_of([&] { model->set_activation_policy(ActivationPolicy::parse("mlp-first:5")); })
                .find("MLP recompute on the first 5 blocks, but the model has 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model->set_activation_policy(ActivationPolicy::parse("block-first:9")); })
                .find("block recompute on the first 9 blocks, but the model has 4"),
            std::string::npos);
}

// The trainer's options (--recompute, --offload-activations) reach the model: fp32 and bf16 (compute
// copies, wide gradients), gradient accumulation, dropout on — the same losses as the plain run.
TEST(ActivationPolicy, TrainerRunsWithTheSameLosses) {
  constexpr int64_t kVocab = 128;
  TempDir data;
  train::test_util::write_toy_shards(data.path(), kVocab, 4096, 16384);
  for (const char* precision : {"fp32", "bf16"}) {
    auto losses = [&](const std::string& recompute, bool offload) {
      train::TrainOptions o = train::test_util::toy_run(data.path(), "", kVocab, precision);
      o.model["n_layer"] = 3, o.model["n_head"] = 2, o.model["n_embd"] = 32, o.model["block_size"] = 16;
      o.model["dropout"] = 0.1;
      o.batch_size = 2, o.seq_len = 16, o.grad_accum = 2, o.steps = 5, o.val_pattern = "";
      o.recompute = recompute;
      o.offload_activations = offload;
      std::vector<double> l;
      train::TrainCallbacks cb;
      cb.on_step = [&](const train::StepStats& s) { l.push_back(s.loss); };
      train::Trainer(o, cb).run();
      return l;
    };
    const std::vector<double> plain = losses("none", false);
    ASSERT_EQ(plain.size(), 5u);
    EXPECT_EQ(losses("selective+block:2", false), plain) << precision;
    EXPECT_EQ(losses("block", true), plain) << precision;
    EXPECT_EQ(losses("selective", true), plain) << precision;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ActivationPolicies, ::testing::Values("gpt2", "llama"));

TEST(ActivationPolicy, ParsesTheFlagValues) {
  EXPECT_EQ(ActivationPolicy::parse("none"), ActivationPolicy{});
  EXPECT_EQ(ActivationPolicy::parse("selective").selective, true);
  EXPECT_EQ(ActivationPolicy::parse("block").block, models::BlockSet::all());
  EXPECT_EQ(ActivationPolicy::parse("block:3").block.every, 3);
  const ActivationPolicy both = ActivationPolicy::parse("selective+block:2", true);
  EXPECT_TRUE(both.selective && both.offload);
  EXPECT_EQ(both.block.every, 2);
  EXPECT_TRUE(both.recompute_block(0) && !both.recompute_block(1) && both.recompute_block(2));
  const ActivationPolicy mlp = ActivationPolicy::parse("mlp+block:4");
  EXPECT_TRUE(mlp.mlp == models::BlockSet::all() && !mlp.selective && mlp.any());
  EXPECT_EQ(mlp.block.every, 4);
  const ActivationPolicy some = ActivationPolicy::parse("mlp:3");
  EXPECT_EQ(some.mlp.every, 3);
  EXPECT_TRUE(some.any() && some.recompute_mlp(0) && !some.recompute_mlp(1) && !some.recompute_mlp(2) &&
              some.recompute_mlp(3));
  const ActivationPolicy first = ActivationPolicy::parse("mlp-first:2+block-first:1");
  EXPECT_TRUE(first.mlp.first == 2 && first.mlp.every == 0 && first.block.first == 1 && first.any());
  EXPECT_TRUE(first.recompute_mlp(0) && first.recompute_mlp(1) && !first.recompute_mlp(2) && !first.recompute_mlp(3));
  EXPECT_TRUE(first.recompute_block(0) && !first.recompute_block(1));
  for (const char* s : {"none", "selective", "mlp", "mlp:12", "selective+mlp", "block", "block:4", "selective+block",
                        "selective+block:2", "mlp+block:2", "selective+mlp+block:3", "selective+mlp:2+block:4",
                        "mlp-first:9", "selective+mlp-first:1+block-first:12", "mlp:2+block-first:3"})
    EXPECT_EQ(ActivationPolicy::parse(s).recompute_name(), s);
  EXPECT_EQ(ActivationPolicy::parse("mlp:1").recompute_name(), "mlp");
  for (const char* bad : {"", "blocks", "block:", "block:0", "block:x", "selective+", "full", "block+selective",
                          "mlp+selective", "block+mlp", "mlp+mlp", "+mlp", "mlps", "mlp:", "mlp:0", "mlp:-1",
                          "mlp:2+mlp", "block:2+mlp:2", "mlp-first", "mlp-first:", "mlp-first:0", "mlp-first2",
                          "mlp-first:x", "mlp-last:2", "block-first:2+mlp", "mlp-first:2+mlp:2", "block-first"})
    EXPECT_NE(error_of([&] { ActivationPolicy::parse(bad); }).find("expected none, or selective, mlp, mlp:N, mlp-first:K"),
              std::string::npos)
        << bad;
}

// A recomputed block's gradients, in float64, against central finite differences, and bitwise
// against the plain block's analytic ones.
TEST(ActivationPolicy, RecomputedBlockPassesGradcheck) {
  for (const std::string family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    auto model = make_model(family);
    model->to(DType::f64);
    model->eval();  // finite differences need a deterministic block (no dropout)
    const int64_t C = model->token_embedding().weight.size(1);
    Generator g(3);
    const Tensor x0 = randn({1, 3, C}, DType::f64, kCPU, &g), w = randn({1, 3, C}, DType::f64, kCPU, &g);
    auto loss_of = [&](const Tensor& x) { return sum(mul(model->block(1, x), w)); };
    auto grads = [&](const ActivationPolicy& p) {
      model->set_activation_policy(p);
      for (auto& [n, prm] : model->named_parameters()) prm.zero_grad();
      Tensor leaf = x0.detach();
      leaf.set_requires_grad(true);
      loss_of(mul(leaf, 1.0)).backward();
      std::vector<std::vector<double>> out{to_vector(leaf.grad())};
      for (auto& [n, prm] : model->named_parameters())
        if (prm.grad().defined()) out.push_back(to_vector(prm.grad()));
      return out;
    };
    const int64_t rebuilds0 = recompute_rebuild_count();
    const auto rec = grads(ActivationPolicy::parse("block"));
    EXPECT_EQ(recompute_rebuild_count() - rebuilds0, 1);
    const auto sel = grads(ActivationPolicy::parse("selective"));
    const auto plain = grads(ActivationPolicy{});
    EXPECT_EQ(rec, plain);
    EXPECT_EQ(sel, plain);
    // d loss / d x by central differences.
    model->set_activation_policy(ActivationPolicy::parse("block"));
    NoGradGuard no_grad;
    std::vector<double> xv = to_vector(x0);
    const double eps = 1e-6;
    double worst = 0.0;
    for (size_t i = 0; i < xv.size(); ++i) {
      std::vector<double> up = xv, dn = xv;
      up[i] += eps, dn[i] -= eps;
      const double fd = (loss_of(from_vector(up, x0.shape(), DType::f64)).item() -
                         loss_of(from_vector(dn, x0.shape(), DType::f64)).item()) / (2 * eps);
      worst = std::max(worst, std::abs(fd - rec[0][i]) / (1e-6 + std::abs(fd)));
    }
    EXPECT_LT(worst, 1e-5) << "largest relative error of the recomputed block's input gradient";
  }
}

}  // namespace
}  // namespace blu::test
