// DistributedDataParallel's buckets: the first bucket's capacity option, gradients that are views
// of the bucket buffers (after construction, backward, zero_grad and finish), unused parameters,
// gradient accumulation under no_sync against one process on the concatenated batch, and .grad
// tensors replaced by the user. One-rank groups run in this process; the rest under dist::launch.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/dist/ddp.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/nn/layers.h"
#include "common/checks.h"
#include "ddp_harness.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

using namespace std::chrono_literals;

// A Gloo group of one rank inside this process.
struct OneRank {
  TcpStore store{"127.0.0.1", 0, true, 10000ms};
  std::shared_ptr<ProcessGroup> pg = make_gloo_group(store, 0, 1, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
};

bool aliases(const Tensor& g, const Tensor& buffer) { return g.defined() && g.storage() == buffer.storage(); }

// Checks the bucket rule: buckets cover the parameters in reverse registration order; bucket 0
// holds at most first_mib MiB, the others at most bucket_mib (or one parameter alone); and each
// bucket closed because the next parameter would have overflowed it.
void expect_layout(const nn::Module& model, const DistributedDataParallel& ddp, double first_mib, double bucket_mib) {
  std::map<std::string, double> bytes;
  std::vector<std::string> reverse;
  for (const auto& [name, t] : model.named_parameters()) {
    bytes[name] = double(t.nbytes());
    reverse.insert(reverse.begin(), name);
  }
  const auto layout = ddp.bucket_layout();
  std::vector<std::string> flat;
  for (size_t b = 0; b < layout.size(); ++b) {
    const double cap = (b == 0 ? first_mib : bucket_mib) * 1024 * 1024;
    double sum = 0;
    for (const auto& n : layout[b]) sum += bytes[n];
    // The buffer holds the gradients, each starting on a 16-byte boundary.
    EXPECT_GE(double(ddp.bucket_buffer(b).nbytes()), sum) << "bucket " << b;
    EXPECT_LT(double(ddp.bucket_buffer(b).nbytes()), sum + 16.0 * double(layout[b].size())) << "bucket " << b;
    EXPECT_TRUE(sum <= cap || layout[b].size() == 1) << "bucket " << b << " holds " << sum << " bytes, cap " << cap;
    if (b + 1 < layout.size()) {
      EXPECT_GT(sum + bytes[layout[b + 1][0]], cap) << "bucket " << b << " closed early";
    }
    flat.insert(flat.end(), layout[b].begin(), layout[b].end());
  }
  EXPECT_EQ(flat, reverse);
}

TEST(DdpBuckets, FirstBucketFollowsTheOption) {
  OneRank rk;
  models::GPT model(::blu::test::tiny_gpt(), 1);
  {  // 1 KiB first bucket: only the last layer norm and the last projection's bias fit
    DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001});
    expect_layout(model, ddp, 0.001, 0.02);
    EXPECT_EQ(ddp.bucket_layout()[0], (std::vector<std::string>{"ln_f.bias", "ln_f.weight", "h.1.mlp.c_proj.bias"}));
  }
  {  // a first bucket larger than the others
    DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.1});
    expect_layout(model, ddp, 0.1, 0.02);
    EXPECT_GT(ddp.bucket_layout()[0].size(), 4u);
  }
  {  // first_bucket_mib = bucket_mib: no special first bucket
    DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.05, .first_bucket_mib = 0.05});
    expect_layout(model, ddp, 0.05, 0.05);
  }
  {  // the default is PyTorch's: 1 MiB first, 25 MiB after (the tiny model fits in the first)
    const DDPOptions d;
    EXPECT_EQ(d.first_bucket_mib, 1.0);
    EXPECT_EQ(d.bucket_mib, 25.0);
  }
  blu::test::expect_error([&] { DistributedDataParallel(model, rk.pg, {.bucket_mib = 1, .first_bucket_mib = 0}); },
                     {"first_bucket_mib must be > 0"});
}

// Over three steps with zero_grad(): every .grad aliases its bucket after construction (a
// gradient that existed moves in), after backward and after finish(), and equals, bit for bit, the
// gradient of the same model without DDP (one rank: the average is the gradient itself). The
// linear layers' GEMMs write their gradients straight into the buckets, with 16-bit compute too.
void grads_alias_buckets(DType compute) {
  OneRank rk;
  const models::GPTConfig cfg = ::blu::test::tiny_gpt();
  models::GPT model(cfg, 7), plain(cfg, 7);
  model.set_compute_dtype(compute);
  plain.set_compute_dtype(compute);
  const std::vector<Tensor> params = model.parameters(), plain_params = plain.parameters();
  Tensor first = params[0];
  first.set_grad(full(first.shape(), 0.5));
  DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001});
  std::map<std::string, Tensor> buffer_of;
  const auto layout = ddp.bucket_layout();
  for (size_t b = 0; b < layout.size(); ++b)
    for (const auto& n : layout[b]) buffer_of[n] = ddp.bucket_buffer(b);
  const auto named = model.named_parameters();
  int64_t n_direct = 0;
  for (const auto& [name, p] : named) n_direct += name.find(".c_") != std::string::npos || name == "wte.weight";
  EXPECT_EQ(n_direct, 8 * cfg.n_layer + 1);
  EXPECT_TRUE(aliases(first.grad(), buffer_of[named[0].first]));
  EXPECT_EQ(to_vector(first.grad())[0], 0.5);
  for (size_t i = 1; i < params.size(); ++i) EXPECT_FALSE(params[i].grad().defined()) << named[i].first;

  for (int64_t step = 0; step < 3; ++step) {
    auto [in, tg] = micro_batch(step, 0, 0, kRows);
    model.zero_grad();
    plain.zero_grad();
    const Tensor loss = model.forward(in, tg).loss, plain_loss = plain.forward(in, tg).loss;
    int64_t allocs = cpu_allocator().stats().allocs;
    loss.backward();
    const int64_t ddp_allocs = cpu_allocator().stats().allocs - allocs;
    allocs = cpu_allocator().stats().allocs;
    plain_loss.backward();
    const int64_t plain_allocs = cpu_allocator().stats().allocs - allocs;
    // The linear layers (and the tied LM head) write their weight and bias gradients straight
    // into the buckets (Note [Wide gradients]: offered as destinations, through the 16-bit casts
    // too): one allocation fewer each than without DDP; the others are copied into their slots.
    EXPECT_LE(ddp_allocs, plain_allocs - n_direct) << "step " << step;
    // After backward (before finish) the gradients are already the views: nothing was copied.
    for (size_t i = 0; i < params.size(); ++i)
      ASSERT_TRUE(aliases(params[i].grad(), buffer_of[named[i].first])) << "step " << step << " " << named[i].first;
    ddp.finish();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(aliases(params[i].grad(), buffer_of[named[i].first])) << "step " << step << " " << named[i].first;
      EXPECT_EQ(to_vector(params[i].grad()), to_vector(plain_params[i].grad())) << "step " << step << " " << named[i].first;
    }
  }
  EXPECT_EQ(ddp.copied_gradients(), 0);
}

// Llama in bf16: q/k/v and gate/up run as one GEMM over compute copies side by side (Note
// [Sibling linears]); each weight's rows of the joined gradient are copied into its bucket slot,
// and every gradient is its bucket view and equals, bit for bit, the plain model's.
TEST(DdpGradViews, LlamaSiblingGradsLandInTheBuckets) {
  OneRank rk;
  const models::LlamaConfig cfg = models::LlamaConfig::preset("tiny");
  models::Llama model(cfg, 7), plain(cfg, 7);
  model.set_compute_dtype(DType::bf16);
  plain.set_compute_dtype(DType::bf16);
  DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001});
  std::map<std::string, Tensor> buffer_of;
  const auto layout = ddp.bucket_layout();
  for (size_t b = 0; b < layout.size(); ++b)
    for (const auto& n : layout[b]) buffer_of[n] = ddp.bucket_buffer(b);
  const auto named = model.named_parameters(), plain_named = plain.named_parameters();
  Generator data(3);
  for (int64_t step = 0; step < 2; ++step) {
    const Tensor in = randint(0, cfg.vocab_size, {2, 8}, DType::i64, kCPU, &data);
    const Tensor tg = randint(0, cfg.vocab_size, {2, 8}, DType::i64, kCPU, &data);
    model.zero_grad();
    plain.zero_grad();
    model.forward(in, tg).loss.backward();
    plain.forward(in, tg).loss.backward();
    ddp.finish();
    for (size_t i = 0; i < named.size(); ++i) {
      const Tensor g = named[i].second.grad();
      ASSERT_TRUE(aliases(g, buffer_of[named[i].first])) << "step " << step << " " << named[i].first;
      EXPECT_EQ(to_vector(g), to_vector(plain_named[i].second.grad())) << "step " << step << " " << named[i].first;
    }
  }
}

TEST(DdpGradViews, GradsAliasTheBucketBuffersThroughSteps) { grads_alias_buckets(DType::f32); }
TEST(DdpGradViews, GradsAliasTheBucketBuffersWithBf16Compute) { grads_alias_buckets(DType::bf16); }

// A module whose second layer is unused: after finish() its gradients are zeros (bucket views),
// and the optimizer reads them through .grad as usual.
struct TwoLinear : nn::Module {
  std::shared_ptr<nn::Linear> used = std::make_shared<nn::Linear>(4, 3), unused = std::make_shared<nn::Linear>(4, 3);
  TwoLinear() {
    register_module("used", used);
    register_module("unused", unused);
  }
};

TEST(DdpGradViews, UnusedParametersGetZeroGradientsInTheirBuckets) {
  OneRank rk;
  TwoLinear model;
  DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 1e-4, .first_bucket_mib = 1e-4});
  for (int step = 0; step < 2; ++step) {
    model.zero_grad();
    sum(model.used->forward(ones({2, 4}))).backward();
    ddp.finish();
    for (const auto& [name, p] : model.named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      if (name.rfind("unused", 0) == 0) {
        for (double v : to_vector(p.grad())) EXPECT_EQ(v, 0.0) << name;
      }
    }
  }
  EXPECT_EQ(to_vector(model.used->bias.grad()), (std::vector<double>{2, 2, 2}));
  // 3-element biases: the next gradient in a bucket still starts 16-byte aligned.
  for (const auto& [name, p] : model.named_parameters())
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.grad().raw_data()) % 16, 0u) << name;
  EXPECT_EQ(ddp.copied_gradients(), 0);
}

TEST(DdpGradViews, DestroyedDdpRemovesItsGradSlots) {
  OneRank rk;
  models::GPT model(::blu::test::tiny_gpt(), 3);
  {
    DistributedDataParallel ddp(model, rk.pg);
    for (const Tensor& p : model.parameters()) EXPECT_TRUE(p.grad_slot().defined());
  }
  for (const Tensor& p : model.parameters()) EXPECT_FALSE(p.grad_slot().defined());
  auto [in, tg] = micro_batch(0, 0, 0, 2);
  model.forward(in, tg).loss.backward();  // inert hooks, ordinary gradients
  for (const Tensor& p : model.parameters()) EXPECT_TRUE(p.grad().defined());
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  f.seekg(0, std::ios::end);
  std::vector<float> v(size_t(f.tellg()) / sizeof(float));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(float)));
  return v;
}

// The worker's averaged gradients against one process on the concatenated batch.
void expect_reference_grads(const std::string& path, int n, const std::string& what) {
  const std::vector<float> got = read_floats(path), want = reference_grads();
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, double(std::abs(got[i] - want[i])));
    scale = std::max(scale, double(std::abs(want[i])));
  }
  std::printf("%s, %d ranks: max |grad diff| %.3g (largest gradient %.3g)\n", what.c_str(), n, worst, scale);
  EXPECT_LE(worst, 1e-6 * scale) << what;
}

TEST(DdpGradViews, NoSyncAccumulationOverThreeMicroBatchesMatchesConcatenatedBatch) {
  TempDir dir;
  for (int n : {2, 4}) {
    const std::string out = dir.str() + "/views" + std::to_string(n);
    const LaunchResult r = run_workers("ddp_grads", n, {{"BLU_DIST_OUT", out}});
    ASSERT_EQ(r.status, 0) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
    expect_reference_grads(out + ".grads", n, "no_sync x3");
  }
}

// Buckets that travel in bf16 (DDPOptions::reduce_dtype): the averages are the reference's rounded
// through bf16 — off by more than fp32's order-of-sums noise (the cast ran), within bf16's.
TEST(DdpGradViews, Bf16WireAveragesWithinBf16Rounding) {
  TempDir dir;
  const std::string out = dir.str() + "/wire";
  const LaunchResult r = run_workers("ddp_grads", 2, {{"BLU_DIST_OUT", out}, {"BLU_DIST_REDUCE_DTYPE", "bf16"}});
  ASSERT_EQ(r.status, 0) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
  const std::vector<float> got = read_floats(out + ".grads"), want = reference_grads();
  ASSERT_EQ(got.size(), want.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(double(got[i]) - double(want[i])));
    scale = std::max(scale, double(std::abs(want[i])));
  }
  std::printf("bf16 wire, 2 ranks: max |grad diff| %.3g (largest gradient %.3g)\n", worst, scale);
  // Each rank's gradient and the average are rounded to bf16 (2^-9 relative each); where the ranks'
  // gradients cancel the error is relative to them, not to the average: bounded by the largest.
  EXPECT_GT(worst, 1e-6 * scale) << "the buckets did not travel in bf16";
  EXPECT_LE(worst, scale / 64) << "beyond bf16's rounding";
}

TEST(DdpRowExchange, GatheredAndDenseRowsMatchConcatenatedBatch) {
  TempDir dir;
  for (const char* path : {"gather", "dense"})
    for (int n : {2, 4}) {
      const std::string out = dir.str() + "/rows_" + path + std::to_string(n);
      const LaunchResult r = run_workers("ddp_grads", n, {{"BLU_DIST_OUT", out}, {"BLU_DIST_ROWS", path}});
      ASSERT_EQ(r.status, 0) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
      EXPECT_EQ(r.err.find("row exchange for"), std::string::npos) << r.err;  // the dense part came first
      expect_reference_grads(out + ".grads", n, std::string("rows ") + path + ", no_sync x3");
    }
}

// The exchanged weight's bucket is alone and first; the others follow the usual rule; the sink
// is removed with the DDP; a weight outside the model, or listed twice, is refused.
TEST(DdpRowExchange, OwnFirstBucketAndSinkLifetime) {
  OneRank rk;
  models::GPT model(::blu::test::tiny_gpt(), 1);
  {
    DistributedDataParallel ddp(model, rk.pg, {.bucket_mib = 0.02, .first_bucket_mib = 0.001,
                                               .exchange_rows = {model.wte.get()}});
    const auto layout = ddp.bucket_layout();
    EXPECT_EQ(layout[0], std::vector<std::string>{"wte.weight"});
    EXPECT_EQ(layout[1], (std::vector<std::string>{"ln_f.bias", "ln_f.weight", "h.1.mlp.c_proj.bias"}));
    EXPECT_TRUE(model.wte->has_row_grad_sink());
    EXPECT_EQ(ddp.row_exchange_paths(), std::vector<std::string>{""});
    nn::Embedding other(8, 4);
    blu::test::expect_error([&] { DistributedDataParallel(model, rk.pg, {.exchange_rows = {&other}}); },
                            {"exchange_rows embedding", "is not part of the wrapped model"});
    blu::test::expect_error(
        [&] { DistributedDataParallel(model, rk.pg, {.exchange_rows = {model.wte.get()}}); },
        {"'wte.weight' already has a row sink"});
  }
  EXPECT_FALSE(model.wte->has_row_grad_sink());
}

TEST(DdpGradViews, ReplacedGradsAreStillAveraged) {
  TempDir dir;
  const std::string out = dir.str() + "/replaced";
  const LaunchResult r = run_workers("ddp_grads", 2, {{"BLU_DIST_OUT", out}, {"BLU_DIST_REPLACE", "1"}});
  ASSERT_EQ(r.status, 0) << "stdout:\n" << r.out << "\nstderr:\n" << r.err;
  EXPECT_NE(r.err.find("is not its bucket view (was .grad replaced?)"), std::string::npos) << r.err;
  expect_reference_grads(out + ".grads", 2, "replaced .grad");
}

}  // namespace
}  // namespace blu::dist::test
