// Tensor and sequence parallelism end to end: N processes on loopback train a tiny GPT-2 (tied,
// padded vocabulary) and a tiny Llama (GQA, untied head) tensor-parallel — TP 2 and 4, with and
// without sequence parallelism — and must match one process on the plain model, step by step
// and in the final gathered weights; the vocabulary-parallel cross-entropy matches the plain one;
// a split the model's sizes do not allow is refused, naming the numbers, before anything changes.
//
// Tolerance (fp32): the sharded step computes the same sums in another order — a row-parallel
// GEMM's K split across ranks and summed by the all-reduce, the cross-entropy's sum of
// exponentials split by vocabulary, the gradient norm's squares summed per shard — so each op
// differs by a few ulps (≈1e-7 relative). Ten AdamW steps at lr 1e-3 move weights by ≲ 1e-2, and
// Adam's m/√v turns a relative gradient error ε into an update error ≈ lr·ε — except for an
// element whose gradient stays near zero, where m/√v is the ratio of two rounding-sized numbers
// and its update can differ by a good part of lr. Measured (printed by the tests): losses and
// gradient norms within 1.2e-7 relative; weights within 2.5e-6 for GPT-2, and for Llama the same
// but for single SwiGLU elements at up to 1.7e-5. Bounds: 1e-5 relative for losses and norms,
// 5e-5 absolute for weights (0.05·lr: far below what one wrong shard or a missing reduction
// gives, which moves whole tensors by ~lr per step).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>

#include "blu/dist/tensor_parallel.h"
#include "common/checks.h"
#include "dist_test_util.h"
#include "tp_harness.h"

namespace blu::dist::test {
namespace {

struct TPRun {
  std::vector<double> losses, norms;
  std::vector<double> columns;  // column inputs: collectives started early, linears that shared one, blocks
  std::vector<float> params;
  double rebuilds = 0;  // recompute regions rank 0 rebuilt
};

std::vector<double> read_doubles(const std::string& path) {
  std::vector<double> v;
  std::ifstream f(path);
  for (double x; f >> x;) v.push_back(x);
  return v;
}

TPRun run(const TempDir& dir, const std::string& family, int n, bool plain, bool sp, const std::string& widths = "",
          int row_chunks = 1, const std::string& recompute = "none") {
  std::string policy = recompute;
  std::replace(policy.begin(), policy.end(), ':', '_');
  const std::string tag = family + (plain ? "_plain" : "_tp" + std::to_string(n) + (sp ? "_sp" : "")) +
                          (widths.empty() ? "" : "_uneven") + (row_chunks > 1 ? "_rows" + std::to_string(row_chunks) : "") +
                          (recompute == "none" ? "" : "_" + policy);
  const std::string out = dir.str() + "/" + tag;
  const LaunchResult r = run_workers("tp_train", n,
                                     {{"BLU_TP_FAMILY", family},
                                      {"BLU_TP_PLAIN", plain ? "1" : "0"},
                                      {"BLU_TP_SP", sp ? "1" : "0"},
                                      {"BLU_TP_WIDTHS", widths},
                                      {"BLU_TP_ROW_CHUNKS", std::to_string(row_chunks)},
                                      {"BLU_TP_RECOMPUTE", recompute},
                                      {"BLU_DIST_STEPS", "10"},
                                      {"BLU_DIST_OUT", out}});
  EXPECT_EQ(r.status, 0) << tag << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  TPRun t;
  t.losses = read_doubles(out + ".losses");
  t.norms = read_doubles(out + ".norms");
  t.columns = read_doubles(out + ".columns");
  if (const std::vector<double> rb = read_doubles(out + ".rebuilds"); !rb.empty()) t.rebuilds = rb[0];
  std::ifstream pf(out + ".params", std::ios::binary);
  pf.seekg(0, std::ios::end);
  t.params.resize(size_t(pf.tellg()) / 4);
  pf.seekg(0);
  pf.read(reinterpret_cast<char*>(t.params.data()), std::streamsize(t.params.size() * 4));
  return t;
}

constexpr double kLossRel = 1e-5, kParamAbs = 5e-5;

void expect_matches(const TPRun& ref, const TPRun& got, const std::string& what) {
  ASSERT_EQ(ref.losses.size(), 10u) << what;
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  ASSERT_EQ(got.norms.size(), ref.norms.size()) << what;
  double worst_loss = 0, worst_norm = 0, worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], kLossRel * std::abs(ref.losses[i])) << what << " step " << i;
    EXPECT_NEAR(got.norms[i], ref.norms[i], kLossRel * std::abs(ref.norms[i])) << what << " norm, step " << i;
    worst_loss = std::max(worst_loss, std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
    worst_norm = std::max(worst_norm, std::abs(got.norms[i] - ref.norms[i]) / std::abs(ref.norms[i]));
  }
  // The loss must move: a run that does not train would match itself trivially.
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 1e-3) << what;
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  ASSERT_FALSE(ref.params.empty()) << what;
  for (size_t i = 0; i < ref.params.size(); ++i) worst = std::max(worst, double(std::abs(got.params[i] - ref.params[i])));
  EXPECT_LE(worst, kParamAbs) << what;
  std::printf("%s: max relative loss diff %.3g, norm diff %.3g, max |param diff| %.3g\n", what.c_str(), worst_loss,
              worst_norm, worst);
}

// Column inputs (Note [Early input gradients], ops/early_grad.h): GPT-2's c_attn and c_fc are
// their inputs' only consumers, so both input-gradient collectives of a block start early, inside
// the linear's backward; Llama's k/v_proj share q_proj's input and up_proj gate_proj's, so a
// block runs two such collectives instead of five, none early.
// Row pieces (Note [Row chunks]): each block's two row linears issue `row_chunks` forward
// collectives each, and all but the last of them are still running when the next piece's GEMM is
// issued; with one piece no forward collective has a GEMM beside it.
void expect_columns(const TPRun& got, const std::string& family, const std::string& what, int row_chunks = 1) {
  ASSERT_EQ(got.columns.size(), 5u) << what;
  const double blocks = got.columns[2], steps = double(got.losses.size());
  const double early = family == "gpt2" ? 2 * blocks * steps : 0, shared = family == "gpt2" ? 0 : 3 * blocks * steps;
  EXPECT_EQ(got.columns[0], early) << what << ": input-gradient collectives started early";
  EXPECT_EQ(got.columns[1], shared) << what << ": column linears that shared another's input";
  const double pieces = row_chunks > 1 ? 2 * blocks * steps * row_chunks : 0;
  EXPECT_EQ(got.columns[3], pieces) << what << ": forward collectives issued per row piece";
  EXPECT_EQ(got.columns[4], 2 * blocks * steps * (row_chunks - 1)) << what << ": forward collectives beside a GEMM";
}

void check_family(const std::string& family) {
  TempDir dir;
  const TPRun plain = run(dir, family, 1, true, false);
  for (int n : {2, 4})
    for (bool sp : {false, true}) {
      const std::string what = family + " TP=" + std::to_string(n) + (sp ? " + SP" : "") + " vs one process";
      const TPRun got = run(dir, family, n, false, sp);
      expect_matches(plain, got, what);
      expect_columns(got, family, what);
    }
}

TEST(TensorParallel, Gpt2MatchesOneProcess) { check_family("gpt2"); }
TEST(TensorParallel, LlamaGqaMatchesOneProcess) { check_family("llama"); }

// Uneven widths: every split cut by them (apportion_units). GPT-2's 4 heads and 128 MLP columns go
// 3/1 and 96/32 over [0.75, 0.25], 2/1/1 and 64/32/32 over [0.5, 0.25, 0.25]; its 101 real
// vocabulary rows 76/25 and 51/25/25, the 27 padding rows to the last rank. Llama's 4 kv heads go
// 3/1 and 2/1/1, their query heads following (6/2, 4/2/2).
TEST(TensorParallel, UnevenWidthsMatchOneProcess) {
  TempDir dir;
  for (const std::string family : {"gpt2", "llama"}) {
    const TPRun plain = run(dir, family, 1, true, false);
    for (bool sp : {false, true})
      expect_matches(plain, run(dir, family, 2, false, sp, "0.75,0.25"),
                     family + " TP=2 widths [0.75, 0.25]" + (sp ? " + SP" : "") + " vs one process");
    expect_matches(plain, run(dir, family, 3, false, false, "0.5,0.25,0.25"),
                   family + " TP=3 widths [0.5, 0.25, 0.25] vs one process");
  }
}

// The row linears' forward in pieces: 3 pieces of the 64 flattened rows (22/21/21), or under
// sequence parallelism of the 4 batch rows (2/1/1). The weight gradients are sums of the pieces'
// GEMMs — the same products summed in another order — so the bounds are the same fp32 ones.
TEST(TensorParallel, RowPiecesOverlapTheForwardAndMatchOneProcess) {
  TempDir dir;
  for (const std::string family : {"gpt2", "llama"}) {
    const TPRun plain = run(dir, family, 1, true, false);
    for (bool sp : {false, true}) {
      const std::string what = family + " TP=2" + (sp ? " + SP" : "") + ", row_chunks=3, vs one process";
      const TPRun got = run(dir, family, 2, false, sp, "", 3);
      expect_matches(plain, got, what);
      expect_columns(got, family, what, 3);
    }
  }
}

// A rank killed in the middle of a tensor-parallel step (entering its second block's forward,
// step 3): every survivor's next collective fails, and its error names the lost rank by its job
// rank (Note [Roll call], process_group_gloo.cpp) within the group's timeout (10 s) — on three
// ranks (uneven widths: GPT-2's 4 heads do not split in three) and on two.
// Recompute under tensor and sequence parallelism (models/activations.h): the rebuilt regions run
// the sharded ops and their collectives again in backward, so the run is bitwise the one that
// keeps everything — selective (the attention core), mlp (the MLP's column-parallel input
// projection, whose sequence-parallel all-gather is inside the region) and whole blocks.
TEST(TensorParallel, RecomputeUnderSequenceParallelismIsBitwise) {
  for (const std::string family : {"gpt2", "llama"}) {
    TempDir dir;
    const TPRun keep = run(dir, family, 2, false, true);
    for (const std::string recompute : {"selective+mlp", "mlp+block:2"}) {
      const std::string what = family + " TP=2 + SP, --recompute " + recompute;
      const TPRun got = run(dir, family, 2, false, true, "", 1, recompute);
      EXPECT_EQ(got.losses, keep.losses) << what;
      EXPECT_EQ(got.norms, keep.norms) << what;
      EXPECT_EQ(got.params, keep.params) << what;
      EXPECT_EQ(got.losses.size(), 10u) << what;
      EXPECT_GT(got.rebuilds, 0) << what << ": nothing was recomputed";
    }
    EXPECT_EQ(keep.rebuilds, 0) << family;
  }
}

TEST(TensorParallel, KilledRankIsNamedByEverySurvivor) {
  TempDir dir;
  for (int n : {3, 2}) {
    const std::string out = dir.str() + "/kill" + std::to_string(n);
    std::vector<std::pair<std::string, std::string>> env = {{"BLU_TP_FAMILY", "gpt2"}, {"BLU_TP_PLAIN", "0"}, {"BLU_TP_SP", "0"},
               {"BLU_TP_WIDTHS", n == 3 ? "0.5,0.25,0.25" : ""}, {"BLU_DIST_STEPS", "10"},
               {"BLU_DIST_OUT", out}, {"BLU_TP_KILL", "1:2"}};
    if (const char* tsan = std::getenv("TSAN_OPTIONS")) env.emplace_back("TSAN_OPTIONS", std::string(tsan) + ":report_thread_leaks=0");
    const LaunchResult r = run_workers("tp_train", n, env);
    std::printf("TP=%d, rank 1 killed: launch took %.2f s\n%s", n, r.seconds, r.out.c_str());
    for (int q = 0; q < n; ++q) {
      if (q == 1) continue;
      std::ifstream f(out + ".rank" + std::to_string(q) + ".error");
      std::stringstream ss;
      ss << f.rdbuf();
      EXPECT_NE(ss.str().find("rank 1 is lost: it did not answer the group's roll call"), std::string::npos)
          << "TP=" << n << ", rank " << q << ": " << ss.str() << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
    }
    EXPECT_LT(r.seconds, 10.0 + 8.0) << "TP=" << n;  // the timeout, plus start-up and steps on two shared cores
  }
}

TEST(TensorParallel, ApportionUnitsByLargestRemainderInGroups) {
  EXPECT_EQ(apportion_units(25, 1, {0.5, 0.5}), (std::vector<int64_t>{13, 12}));  // GPT-2 d48's heads over 2
  EXPECT_EQ(apportion_units(4, 1, {0.75, 0.25}), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(apportion_units(8, 2, {0.75, 0.25}), (std::vector<int64_t>{6, 2}));  // query heads in kv groups
  EXPECT_EQ(apportion_units(4, 1, {0.97, 0.01, 0.02}), (std::vector<int64_t>{2, 1, 1}));  // one group each
  EXPECT_EQ(apportion_units(128, 1, {0.5, 0.25, 0.25}), (std::vector<int64_t>{64, 32, 32}));
  EXPECT_THROW(apportion_units(2, 1, {0.5, 0.25, 0.25}), Error);  // fewer groups than ranks
  EXPECT_THROW(apportion_units(9, 2, {0.5, 0.5}), Error);         // not whole groups
}

TEST(TensorParallel, VocabParallelCrossEntropyMatchesPlain) {
  for (int n : {2, 4}) {
    const LaunchResult r = run_workers("tp_ce", n);
    EXPECT_EQ(r.status, 0) << n << " ranks\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  }
}

TEST(TensorParallel, EveryOpRunsOnPlacementsItsRuleAccepts) {
  for (int n : {2, 4}) {
    const LaunchResult r = run_workers("tp_check", n);
    EXPECT_EQ(r.status, 0) << n << " ranks\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
    std::printf("%s", r.out.c_str());
  }
}

// GPT-2's fused q|k|v: rank 1 of 2 holds rows [2, 4) of each of the three segments of 12 rows.
TEST(TensorParallel, ShardInfoNamesThePiecesOfTheFullTensor) {
  ShardInfo info;
  info.dim = 0, info.parts = 3, info.offset = 2, info.length = 2, info.full_shape = {12, 3};
  EXPECT_EQ(info.ranges(), (std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {6, 2}, {10, 2}}));
  std::vector<double> v;
  for (int i = 0; i < 36; ++i) v.push_back(i);
  const Tensor shard = shard_of_full(from_vector(v, {12, 3}), info);
  ASSERT_EQ(shard.shape(), (Shape{6, 3}));
  const std::vector<double> got = to_vector(shard);
  const std::vector<int> rows{2, 3, 6, 7, 10, 11};
  for (size_t r = 0; r < rows.size(); ++r)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(got[r * 3 + size_t(c)], rows[r] * 3 + c);
  EXPECT_TRUE(ShardInfo{}.ranges().empty());  // replicated: the whole tensor
}

// A group that only reports its size: the rewrite's checks run before any collective.
class SizeOnlyGroup final : public ProcessGroup {
 public:
  explicit SizeOnlyGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return "none"; }
  void set_timeout(std::chrono::milliseconds) override {}
  std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(0); }
  void set_phase(std::string) override {}
  WorkPtr all_reduce(const Tensor&, ReduceOp) override { return fail(); }
  WorkPtr reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { return fail(); }
  WorkPtr all_gather(const Tensor&, const Tensor&) override { return fail(); }
  WorkPtr broadcast(const Tensor&, int) override { return fail(); }
  WorkPtr send(const Tensor&, int, int) override { return fail(); }
  WorkPtr recv(const Tensor&, int, int) override { return fail(); }
  WorkPtr barrier() override { return fail(); }

 private:
  static WorkPtr fail() {
    ADD_FAILURE() << "a collective was called";
    return nullptr;
  }
  int size_;
};

TEST(TensorParallel, RefusesSplitsTheSizesDoNotAllow) {
  using blu::test::expect_error;
  {
    models::GPTConfig c = tp_gpt_config();
    c.n_head = 2, c.n_embd = 32;  // 2 heads over 4 ranks
    models::GPT m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(4)); },
                 {"tensor parallelism over 4 ranks", "h.0.attn.c_attn", "n_head 2 is not divisible by 4",
                  "split(4, widths=[…]) cuts it unevenly"});
    // Nothing changed: the plain modules are still there, and the model is not marked sharded.
    EXPECT_EQ(dynamic_cast<ParallelLinear*>(m.find_module("h.0.attn.c_attn")), nullptr);
    EXPECT_FALSE(m.sharded.active());
  }
  {
    models::GPTConfig c = tp_gpt_config();
    c.padded_vocab_size = 130;
    models::GPT m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(4)); },
                 {"wte", "padded_vocab_size 130 is not divisible by 4"});
  }
  {
    models::LlamaConfig c = tp_llama_config();
    c.num_key_value_heads = 2;  // 8 query heads divide by 4, 2 kv heads do not
    models::Llama m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(4)); },
                 {"model.layers.0.self_attn.k_proj", "num_key_value_heads 2 is not divisible by 4"});
  }
  {
    models::LlamaConfig c = tp_llama_config();
    c.num_attention_heads = 6, c.num_key_value_heads = 2, c.hidden_size = 48;
    models::Llama m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(4)); },
                 {"q_proj", "num_attention_heads 6 is not divisible by 4"});
  }
  {
    models::LlamaConfig c = tp_llama_config();
    c.vocab_size = 101;
    models::Llama m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(2)); },
                 {"model.embed_tokens", "vocab_size 101 is not divisible by 2"});
  }
  {
    models::GPTConfig c = tp_gpt_config();
    c.vocab_size = 20, c.padded_vocab_size = 128;  // shards 2..7 of 8 (rows 32..127) are all padding
    c.n_head = 8, c.n_embd = 64;
    models::GPT m(c, 1);
    expect_error([&] { apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(8)); },
                 {"rank 2's rows [32, 48)", "none of the 20 real tokens"});
  }
  {
    models::GPTConfig c = tp_gpt_config();  // 4 heads: an uneven cut still gives each rank one
    models::GPT m(c, 1);
    expect_error([&] {
      apply_tensor_parallel(m, std::make_shared<SizeOnlyGroup>(4), TPOptions{.widths = {0.25, 0.25, 0.25}});
    }, {"tensor parallelism over 4 ranks", "3 widths given"});
    c.n_head = 2, c.n_embd = 32;
    models::GPT m2(c, 1);
    expect_error([&] {
      apply_tensor_parallel(m2, std::make_shared<SizeOnlyGroup>(4), TPOptions{.widths = {0.25, 0.25, 0.25, 0.25}});
    }, {"h.0.attn.c_attn", "n_head 2 in groups of 1 cannot give every rank one"});
  }
}

}  // namespace
}  // namespace blu::dist::test
