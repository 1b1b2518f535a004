// Tensor and sequence parallelism for the multi-process tests (tp_test.cpp):
//   tp_train_worker: a tiny GPT-2 or a tiny Llama with GQA (BLU_TP_FAMILY) trained for
//     BLU_DIST_STEPS AdamW steps on a fixed batch of 4 rows × 16 tokens — one process on the plain
//     model (BLU_TP_PLAIN=1), or every rank tensor-parallel over the whole world (BLU_TP_SP=1:
//     with sequence parallelism) through dist::Strategy. Rank 0 writes <out>.losses, <out>.norms
//     (the gradient norm of each step) and <out>.params (the full parameters, gathered, sorted
//     by name, f32). BLU_TP_ROW_CHUNKS: TPOptions::row_chunks. BLU_TP_RECOMPUTE: the model's
//     activation policy (--recompute's values; default none); <out>.rebuilds: the recompute
//     regions rank 0 rebuilt.
//   tp_check_worker: one forward and backward of each family, TP over the world with and without
//     sequence parallelism, under dist::ShardingCheck: no op may refuse its placements, and the
//     rules must have run (rank 0 prints how many ops were checked).
//   tp_ce_worker: the vocabulary-parallel cross-entropy against the plain one on the full logits:
//     values and gradients, f32 and f64, with ignored targets and padded columns.
#pragma once
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/sharding_check.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tensor_parallel.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "train_harness.h"

namespace blu::dist::test {

// GPT-2: 4 heads of 8 (TP 2 and 4 divide them), vocabulary 101 padded to 128 (the last shard
// holds padded rows). Llama: 8 query heads over 4 kv heads (GQA, groups of 2), MLP 96, vocabulary
// 96, an untied head.
inline models::GPTConfig tp_gpt_config() {
  models::GPTConfig c;
  c.block_size = 16, c.vocab_size = 101, c.padded_vocab_size = 128;
  c.n_layer = 2, c.n_head = 4, c.n_embd = 32;
  return c;
}
inline models::LlamaConfig tp_llama_config() {
  models::LlamaConfig c = models::LlamaConfig::preset("tiny");
  c.hidden_size = 64, c.num_attention_heads = 8, c.num_key_value_heads = 4, c.intermediate_size = 96;
  c.vocab_size = 96, c.tie_word_embeddings = false;
  c.validate();
  return c;
}
inline std::unique_ptr<models::CausalLM> tp_model(const std::string& family, uint64_t seed) {
  if (family == "gpt2") return std::make_unique<models::GPT>(tp_gpt_config(), seed);
  return std::make_unique<models::Llama>(tp_llama_config(), seed);
}

inline void write_doubles(const std::string& path, const std::vector<double>& v) {
  std::ofstream f(path);
  char buf[64];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, "%.17g\n", x);
    f << buf;
  }
}

// Wraps the TP group and watches the ops: a collective counts as beside compute when at least one
// GEMM ("linear") ran between its issue and its first wait. Only forwards run "linear" (backward
// formulas run matmul and linear_weight_grad), so on a training step this counts the forward's
// collectives that overlap a GEMM: row pieces' (Note [Row chunks]) and nothing else.
class OverlapWatch final : public ProcessGroup {
 public:
  explicit OverlapWatch(std::shared_ptr<ProcessGroup> pg) : pg_(std::move(pg)) {
    observer_ = add_op_observer([this](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
      if (std::string(op.name) == "linear") ++gemms_;
    });
  }
  ~OverlapWatch() override { remove_op_observer(observer_); }
  int64_t beside_compute() const { return beside_; }
  int rank() const override { return pg_->rank(); }
  int size() const override { return pg_->size(); }
  std::string backend() const override { return pg_->backend(); }
  void set_timeout(std::chrono::milliseconds t) override { pg_->set_timeout(t); }
  std::chrono::milliseconds timeout() const override { return pg_->timeout(); }
  void set_phase(std::string phase) override { pg_->set_phase(std::move(phase)); }
  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override { return watch(pg_->all_reduce(t, op)); }
  WorkPtr reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) override {
    return watch(pg_->reduce_scatter(out, in, op));
  }
  WorkPtr all_gather(const Tensor& out, const Tensor& in) override { return watch(pg_->all_gather(out, in)); }
  WorkPtr broadcast(const Tensor& t, int root) override { return pg_->broadcast(t, root); }
  WorkPtr send(const Tensor& t, int dst, int tag) override { return pg_->send(t, dst, tag); }
  WorkPtr recv(const Tensor& t, int src, int tag) override { return pg_->recv(t, src, tag); }
  WorkPtr barrier() override { return pg_->barrier(); }

 private:
  struct Watched final : Work {
    WorkPtr inner;
    OverlapWatch* watch;
    int64_t gemms_at_issue;
    bool waited = false;
    void wait() override {
      if (!waited && watch->gemms_ > gemms_at_issue) ++watch->beside_;
      waited = true;
      inner->wait();
    }
    bool is_completed() const override { return inner->is_completed(); }
  };
  WorkPtr watch(WorkPtr w) {
    auto x = std::make_shared<Watched>();
    x->inner = std::move(w), x->watch = this, x->gemms_at_issue = gemms_;
    return x;
  }
  std::shared_ptr<ProcessGroup> pg_;
  int observer_ = -1;
  int64_t gemms_ = 0, beside_ = 0;
};

inline void tp_train_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const std::string family = getenv_or("BLU_TP_FAMILY", "gpt2");
  const bool plain = getenv_or("BLU_TP_PLAIN", "0") == "1", sp = getenv_or("BLU_TP_SP", "0") == "1";
  const int64_t steps = std::stoll(getenv_or("BLU_DIST_STEPS", "10"));
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  const int r = env.rank, W = env.world_size;
  ASSERT_TRUE(!plain || W == 1);
  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<OverlapWatch> watch;
  std::unique_ptr<models::CausalLM> model = tp_model(family, 1234);  // the same full weights on every rank
  if (!plain) {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    watch = std::make_shared<OverlapWatch>(
        make_gloo_group(*store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"}));
    pg = watch;
    std::vector<double> widths;  // BLU_TP_WIDTHS "0.75,0.25": an uneven split
    std::stringstream ws(getenv_or("BLU_TP_WIDTHS", ""));
    for (std::string w; std::getline(ws, w, ',');) widths.push_back(std::stod(w));
    apply_tensor_parallel(*model, pg, TPOptions{.sequence_parallel = sp, .widths = widths,
                                                .row_chunks = std::stoll(getenv_or("BLU_TP_ROW_CHUNKS", "1"))});
    if (!widths.empty()) {  // the ranks hold different numbers of parameters
      const double n = double(model->num_parameters());
      Tensor t = from_vector(std::vector<double>{n, -n}, {2}, DType::f64);
      pg->all_reduce(t, ReduceOp::max)->wait();
      EXPECT_GT(to_vector(t)[0], -to_vector(t)[1]) << "rank " << r << ": widths given, yet every rank holds as much";
    }
  }
  model->set_activation_policy(models::ActivationPolicy::parse(getenv_or("BLU_TP_RECOMPUTE", "none")));
  // BLU_TP_KILL="RANK:STEP": that rank exits in the middle of that step's forward (entering its
  // second block), without a word to the others; the others must fail naming it (Note [Roll call],
  // process_group_gloo.cpp), each writing its error to <out>.rank<r>.error.
  int kill_rank = -1;
  int64_t kill_step = -1, step = 0;
  if (const std::string k = getenv_or("BLU_TP_KILL", ""); !k.empty()) {
    kill_rank = std::stoi(k.substr(0, k.find(':')));
    kill_step = std::stoll(k.substr(k.find(':') + 1));
  }
  if (r == kill_rank)
    model->add_block_hooks([&](size_t block, const Tensor& x) {
      if (block == 1 && step == kill_step) {
        std::fflush(nullptr);
        ::_exit(0);  // exit 0, so the launcher lets the others report
      }
      return x;
    }, nullptr);
  StrategyConfig sc;
  sc.tp = pg;
  Strategy strategy(*model, nullptr, sc,
                    OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  EXPECT_EQ(strategy.name(), plain ? "single" : "tp");
  const int64_t B = 4, T = 16, V = model->vocab_size();
  std::vector<double> losses, norms;
  if (kill_rank >= 0) {
    try {
      for (; step < steps; ++step) {
        const auto batch = [&](int64_t m) {
          std::vector<double> in, tg;
          for (int64_t i = 0; i < B * T; ++i) in.push_back(token(0, m, i / T, i % T) % V), tg.push_back(token(0, m, i / T, i % T + 1) % V);
          return std::make_pair(from_vector(in, {B, T}, DType::i32), from_vector(tg, {B, T}, DType::i32));
        };
        (void)strategy.read(strategy.step(1, batch, 1e-3, 1.0), false);
      }
    } catch (const Error& e) {
      std::ofstream(out + ".rank" + std::to_string(r) + ".error") << e.what();
      std::printf("rank %d: %s\n", r, e.what());
      std::fflush(nullptr);
      ::_exit(0);  // the group's peer is gone: skip its destructor
    }
    FAIL() << "rank " << r << " finished although rank " << kill_rank << " was killed";
  }
  for (; step < steps; ++step) {
    const auto loss_of = [&](int64_t m) {
      std::vector<double> in, tg;
      for (int64_t row = 0; row < B; ++row)
        for (int64_t t = 0; t < T; ++t) {
          in.push_back(token(0, m, row, t) % V);  // the same batch every step: the loss must fall
          // A few ignored targets, so the loss's mean over valid positions is exercised.
          tg.push_back(t == 3 && row == 1 ? -1 : token(0, m, row, t + 1) % V);
        }
      return model->forward(from_vector(in, {B, T}, DType::i32), from_vector(tg, {B, T}, DType::i32)).loss;
    };
    const StepReadout rd = strategy.read(strategy.step(1, loss_of, 1e-3, 1.0), false);
    losses.push_back(rd.loss);
    norms.push_back(rd.grad_norm);
  }
  nn::NamedTensors full = plain ? model->named_parameters() : gather_full_state(*model, *pg);
  std::sort(full.begin(), full.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (r == 0 && !out.empty()) {
    write_doubles(out + ".losses", losses);
    write_doubles(out + ".norms", norms);
    write_doubles(out + ".rebuilds", {double(recompute_rebuild_count())});
    const ColumnInputStats cs = column_input_stats();
    write_doubles(out + ".columns", {double(cs.early), double(cs.shared), double(model->num_blocks()),
                                     double(row_chunk_collectives()), double(watch ? watch->beside_compute() : 0)});
    std::ofstream pf(out + ".params", std::ios::binary);
    for (const auto& [name, p] : full) {
      const Tensor c = contiguous(to_dtype(p, DType::f32));
      pf.write(static_cast<const char*>(c.raw_data()), std::streamsize(c.nbytes()));
    }
  }
  if (pg) pg->barrier()->wait();
}

inline void tp_check_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  TcpStore store(env.master_addr, env.master_port, env.rank == 0, 10000ms);
  std::shared_ptr<ProcessGroup> pg = make_gloo_group(store, env.rank, env.world_size, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  for (const std::string family : {"gpt2", "llama"})
    for (bool sp : {false, true}) {
      std::unique_ptr<models::CausalLM> model = tp_model(family, 1234);
      apply_tensor_parallel(*model, pg, TPOptions{.sequence_parallel = sp});
      ShardingCheck check;  // throws on the first refusal
      check.place_parameters(*model);
      const int64_t B = 2, T = 8, V = model->vocab_size();
      std::vector<double> in, tg;
      for (int64_t i = 0; i < B * T; ++i) in.push_back(double((i * 7 + 3) % V)), tg.push_back(double((i * 5 + 1) % V));
      model->forward(from_vector(in, {B, T}, DType::i32), from_vector(tg, {B, T}, DType::i32)).loss.backward();
      EXPECT_TRUE(check.refusals().empty()) << family;
      // Every layer's norms, projections and MLP, the embedding and the head: well over 20 ops.
      EXPECT_GE(check.ops_checked(), 20) << family << (sp ? " + SP" : "");
      if (env.rank == 0)
        std::printf("%s TP=%d%s: %lld ops checked\n", family.c_str(), env.world_size, sp ? " + SP" : "",
                    (long long)check.ops_checked());
    }
  pg->barrier()->wait();
}

inline void tp_ce_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const int r = env.rank, W = env.world_size;
  TcpStore store(env.master_addr, env.master_port, r == 0, 10000ms);
  std::shared_ptr<ProcessGroup> pg = make_gloo_group(store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  const int64_t N = 12, Vp = 64, V = 61;  // the last 3 columns are padding (num_classes 61)
  for (DType dt : {DType::f32, DType::f64}) {
    Generator gen(7);
    // Large offsets per row: the row max matters for the sum of exponentials.
    const Tensor full = add(mul(randn({N, Vp}, DType::f64, kCPU, &gen), 3.0),
                            reshape(arange(0, double(N), 1, DType::f64), {N, 1}));
    std::vector<double> tg;
    for (int64_t i = 0; i < N; ++i) tg.push_back(i == 4 || i == 9 ? -1 : double((i * 37 + 5) % V));
    const Tensor targets = from_vector(tg, {N}, DType::i64);
    Tensor ref_logits = to_dtype(full, dt).detach();
    ref_logits.set_requires_grad(true);
    const Tensor ref = cross_entropy(ref_logits, targets, -1, Reduction::mean, V);
    ref.backward();
    const int64_t Vl = Vp / W;
    Tensor mine = contiguous(narrow(to_dtype(full, dt), 1, r * Vl, Vl)).detach();
    mine.set_requires_grad(true);
    const Tensor loss = vocab_parallel_cross_entropy(mine, targets, V, *pg);
    loss.backward();
    const double tol = dt == DType::f64 ? 1e-12 : 2e-6;
    EXPECT_NEAR(loss.item(), ref.item(), tol * std::abs(ref.item())) << dt << " rank " << r;
    const std::vector<double> got = to_vector(mine.grad()),
                              want = to_vector(contiguous(narrow(ref_logits.grad(), 1, r * Vl, Vl)));
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
    EXPECT_LE(worst, dt == DType::f64 ? 1e-14 : 1e-7) << dt << " rank " << r;
    // A change in any one rank's logits must change every rank's loss (no rank computes alone).
    Tensor bumped = clone(mine.detach());
    if (r == W - 1) bumped = add(bumped, 0.5);
    const double moved = vocab_parallel_cross_entropy(bumped, targets, V, *pg).item();
    EXPECT_GT(std::abs(moved - loss.item()), 1e-3) << "rank " << r;
  }
  pg->barrier()->wait();
}

}  // namespace blu::dist::test
