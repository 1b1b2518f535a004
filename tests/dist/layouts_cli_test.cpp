// `blutrain launch -n N -- blutrain train --parallel LAYOUT` for every layout the trainer drives —
// split(2), split(2, sp=true), replicate(2){pipeline(2)} (dp × pp), replicate(2){split(2)} (dp × tp),
// a pipeline whose stages are split(2) (pp × tp), all three (dp × pp × tp, GPT-2 only: 8 ranks) and
// uneven replica weights [0.75, 0.25] (plain, ZeRO-1 and ZeRO-3) — for the tiny GPT-2 (tied embedding) and a tiny Llama
// (untied, GQA, SwiGLU): three steps give the losses of one process on the same global batch of 4
// rows within 1e-5 relative. Why not bitwise: tensor parallelism splits each matmul's reduction
// over ranks and adds the partial sums by all-reduce, the pipeline and the replicas accumulate
// micro-batch means instead of one mean over 4 rows, and an uneven split weights the replicas'
// means by 3/4 and 1/4; each reorders fp32 sums (measured ≤ 1e-7 relative here). Also: what is
// still refused is refused by name before anything is written, and `--parallel auto` and
// weights=probe are decided at start, recorded as a stated layout and trained.
// The multi-process tests are serialised by the CTest resource lock "dist_processes"
// (tests/CMakeLists.txt): several jobs of up to 8 ranks at once overload the 2-core CI machine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "blu/data/shard.h"
#include "blu/models/registry.h"
#include "blu/blu.h"
#include "blu/train/model_spec.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;
using blu::test::metric_losses;

class DistLayouts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    std::vector<uint16_t> g(8192), l(8192);
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = uint16_t((i * 131 + i / 7) % 50000);
      l[i] = uint16_t((i * 37 + i / 5) % 128);
    }
    write_shard(dir.path / "g_train_000000.bin", g);
    write_shard(dir.path / "l_train_000000.bin", l);
    // The tiny Llama with a vocabulary of 128 (tensor parallelism splits the vocabulary evenly;
    // the preset's 101 does not divide by 2), as a Hugging Face folder every run starts from.
    nlohmann::json c = models::resolve_model_config("llama:tiny");
    c["vocab_size"] = 128;
    const auto m = models::build_model(c, 1337);
    fs::create_directories(dir.path / "llama128");
    models::family("llama").export_hf(*m, (dir.path / "llama128").string());
  }
  // `ranks` processes train 3 steps of `batch` rows per replica (T 32) of `family`'s model.
  LaunchResult train(const std::string& family, int ranks, int64_t batch, const std::string& out,
                     std::vector<std::string> extra, int steps = 3) {
    const bool gpt = family == "gpt2";
    std::vector<std::string> cmd = {blutrain().string(), "launch", "-n", std::to_string(ranks), "--",
                                    blutrain().string(), "train", "--train-pattern",
                                    (dir.path / (gpt ? "g_train_*.bin" : "l_train_*.bin")).string(), "--model",
                                    gpt ? "tiny" : (dir.path / "llama128").string(), "-B", std::to_string(batch),
                                    "-T", "32", "--steps", std::to_string(steps), "--log-every", "1", "--schedule",
                                    "constant", "--warmup", "0", "--lr", "1e-3", "--out", (dir.path / out).string()};
    cmd.insert(cmd.end(), extra.begin(), extra.end());
    return run_command(1, cmd, {{"OMP_NUM_THREADS", "1"}});
  }
  // The final weights of a run as `blutrain eval --ckpt RUN` loads them (train::load_model: a
  // layout's checkpoint put together by global name on one process), by name.
  std::map<std::string, std::vector<double>> final_weights(const std::string& out) {
    std::map<std::string, std::vector<double>> w;
    for (const auto& [name, p] : train::load_model((dir.path / out).string(), kCPU)->named_parameters())
      w[name] = to_vector(p);
    return w;
  }
  // Each layout's ten steps against one process on the same global batch of 4 rows: the losses
  // within 1e-5 relative and the final weights within 1e-4 (the fp32 sums of tp_test.cpp and
  // pipeline_test.cpp in other orders: TP's measured 2.5e-6, single SwiGLU elements 1.7e-5, the
  // tied GPT-2 weight under a pipeline up to 1e-4 — whole tensors move by ~lr = 1e-3 a step when a
  // shard or a reduction is wrong).
  void check_layouts(const std::string& family, const std::string& stage0, const std::string& stage1) {
    constexpr int kSteps = 10;
    LaunchResult r = train(family, 1, 4, family + "_single", {}, kSteps);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const auto single = metric_losses(dir.path / (family + "_single"));
    ASSERT_EQ(single.size(), size_t(kSteps));
    const auto single_weights = final_weights(family + "_single");
    struct Case {
      std::string name;
      int ranks;
      int64_t batch;  // rows per replica
      std::string layout;
    };
    std::vector<Case> cases = {
        {"tp", 2, 4, "split(2)"},
        {"tp_sp", 2, 4, "split(2, sp=true)"},
        {"dp_pp", 4, 1, "replicate(2){ pipeline(2, micro=2) }"},
        {"dp_tp", 4, 2, "replicate(2){ split(2) }"},
        {"pp_tp", 4, 2,
         "pipeline(2, micro=2){ stage(" + stage0 + "){ split(2) } stage(" + stage1 + "){ split(2) } }"},
        {"pipeline1", 1, 2, "pipeline(1, micro=2)"},  // the pipeline's code path on one rank
        {"uneven", 2, 2, "replicate(2, weights=[0.75,0.25])"},  // rows 3 and 1
        {"uneven_zero1", 2, 2, "replicate(2, zero=1, weights=[0.75,0.25])"},
        {"uneven_zero3", 2, 2, "replicate(2, zero=3, weights=[0.75,0.25])"},
        {"tp_uneven", 2, 4, "split(2, widths=[0.75,0.25])"},      // MLP columns, vocabulary rows 3:1
    };
    cases.push_back({"dp_pp_tp", 8, 1,
                     "replicate(2){ pipeline(2, micro=2){ stage(" + stage0 + "){ split(2) } stage(" + stage1 +
                         "){ split(2) } } }"});
    for (const Case& c : cases) {
      const std::string out = family + "_" + c.name;
      r = train(family, c.ranks, c.batch, out, {"--parallel", c.layout}, kSteps);
      ASSERT_EQ(r.status, 0) << c.layout << "\n" << r.out << r.err;
      EXPECT_NE(r.out.find("parallel layout: "), std::string::npos) << r.out;
      // A split layout trains a shard: the same losses would come from every rank training the
      // whole model on the replica's rows, so the shard's size is checked too.
      if (c.layout.find("split") != std::string::npos) {
        const std::string said = "tensor parallel: this rank's shard holds ";
        const size_t at = r.out.find(said);
        ASSERT_NE(at, std::string::npos) << c.layout << "\n" << r.out;
        std::istringstream line(r.out.substr(at + said.size()));
        int64_t shard = 0, whole = 0;
        std::string of, the, models;
        line >> shard >> of >> the >> models >> whole;
        EXPECT_GT(shard, 0) << c.layout;
        EXPECT_LT(shard, whole) << c.layout << "\n" << r.out.substr(at, 120);
      }
      const auto got = metric_losses(dir.path / out);
      ASSERT_EQ(got.size(), size_t(kSteps)) << c.layout;
      for (const auto& [step, loss] : single)
        EXPECT_NEAR(got.at(step), loss, 1e-5 * std::abs(loss)) << family << " " << c.layout << ", step " << step;
      const auto weights = final_weights(out);
      ASSERT_EQ(weights.size(), single_weights.size()) << c.layout;
      double worst = 0;
      for (const auto& [name, want] : single_weights) {
        const std::vector<double>& have = weights.at(name);
        ASSERT_EQ(have.size(), want.size()) << c.layout << " " << name;
        for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(have[i] - want[i]));
      }
      EXPECT_LE(worst, 1e-4) << family << " " << c.layout;
      std::printf("%s %s: %d steps, max |weight diff| %.3g\n", family.c_str(), c.layout.c_str(), kSteps, worst);
      if (c.name.starts_with("uneven")) {
        EXPECT_NE(r.out.find("rows per replica: 3 1 (a global batch of 4 rows"), std::string::npos) << r.out;
      }
    }
  }
  TempDir dir;
};

TEST_F(DistLayouts, Gpt2EveryLayoutMatchesOneProcess) { check_layouts("gpt2", "h.0", "h.1"); }

TEST_F(DistLayouts, LlamaEveryLayoutMatchesOneProcess) { check_layouts("llama", "model.layers.0", "model.layers.1"); }

// bf16 over Gloo (16-bit floats moved as bits, reduced in f32): tensor parallelism with sequence
// parallelism and a pipeline train the losses of one bf16 process, within bf16's rounding of
// sums taken in another order.
TEST_F(DistLayouts, Bf16LayoutsRunOnGloo) {
  LaunchResult r = train("gpt2", 1, 4, "bf16_single", {"--precision", "bf16"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto single = metric_losses(dir.path / "bf16_single");
  ASSERT_EQ(single.size(), 3u);
  for (const auto& [name, ranks, batch, layout] :
       std::vector<std::tuple<std::string, int, int64_t, std::string>>{
           {"bf16_tp_sp", 2, 4, "split(2, sp=true)"}, {"bf16_pp", 2, 2, "pipeline(2, micro=2)"}}) {
    r = train("gpt2", ranks, batch, name, {"--precision", "bf16", "--parallel", layout});
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const auto got = metric_losses(dir.path / name);
    ASSERT_EQ(got.size(), 3u) << layout;
    for (const auto& [step, loss] : single)
      EXPECT_NEAR(got.at(step), loss, 1e-2 * std::abs(loss)) << layout << ", step " << step;
  }
}

// What the trainer still does not run is refused by name, before the run folder exists.
TEST_F(DistLayouts, UnsupportedLayoutsAreRefusedByName) {
  struct Refusal {
    std::string layout;
    std::vector<std::string> extra;
    std::string message;
  };
  for (const Refusal& c : std::vector<Refusal>{
           {"split(2)", {"--keep-best", "--val-pattern", (dir.path / "g_train_*.bin").string()},
            "--keep-best keeps a single-file checkpoint, and this layout writes a checkpoint directory"},
           {"pipeline(2, micro=2)", {"--offload-state", "master", "--precision", "bf16"},
            "--offload-state master is implemented for data parallelism"},
           {"replicate(2){ pipeline(1, micro=2) }", {}, "a pipeline of one stage runs alone"}}) {
    std::vector<std::string> args = {"--parallel", c.layout};
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    const LaunchResult r = train("gpt2", 2, 2, "bad", args);
    EXPECT_NE(r.status, 0) << c.layout;
    EXPECT_NE((r.out + r.err).find(c.message), std::string::npos) << c.layout << "\n" << r.out << r.err;
    EXPECT_FALSE(fs::exists(dir.path / "bad")) << c.layout << ": a refused run wrote its folder";
  }
}

// AdamW's state offloaded under tensor and pipeline layouts (each rank's own parameters' state on
// the host, either update): the same arithmetic, so the same losses bit for bit as the layout with
// its state on the device. Every run on its rank's device pool cpu:1, as offload needs.
// The pipeline's stages are placed on their device pools holding only their own parameters, a
// tensor-parallel rank only its shard, and both train as one process does.
TEST_F(DistLayouts, OffloadedStateUnderSplitAndPipelineMatchesOnDevice) {
  LaunchResult r = train("gpt2", 1, 4, "single", {});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto single = metric_losses(dir.path / "single");
  // Stage 0 of two trains the embeddings and h.0; h.1 and the final norm are stage 1's.
  int64_t whole = 0, stage0 = 0;
  for (const auto& [name, p] : models::build_model(models::resolve_model_config("tiny"), 1)->named_parameters()) {
    whole += int64_t(p.nbytes());
    if (!name.starts_with("h.1.") && !name.starts_with("ln_f.")) stage0 += int64_t(p.nbytes());
  }
  for (const std::string layout : {"split(2)", "pipeline(2, schedule=1f1b, micro=2)"}) {
    const std::string name = layout.starts_with("split") ? "tp" : "pp";
    const int64_t rows = name == "pp" ? 2 : 4;  // a pipeline's step is micro=2 batches of -B rows
    r = train("gpt2", 2, rows, name + "_dev", {"--parallel", layout, "--device", "cpu:1"});
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const auto on_device = metric_losses(dir.path / (name + "_dev"));
    ASSERT_EQ(on_device.size(), 3u) << layout;
    for (const auto& [step, loss] : single)
      EXPECT_NEAR(on_device.at(step), loss, 1e-5 * std::abs(loss)) << layout << ", step " << step;
    if (name == "pp") {
      EXPECT_NE(r.out.find("pipeline stage 0: " + std::to_string(stage0) + " of the model's " + std::to_string(whole) +
                           " parameter bytes placed on cpu:1"),
                std::string::npos)
          << r.out;
    } else {  // rank 0's shard (fp32: 4 bytes a parameter), cut on the CPU and only then placed
      const std::string shard = "tensor parallel: this rank's shard holds ";
      const size_t at = r.out.find(shard);
      ASSERT_NE(at, std::string::npos) << r.out;
      const int64_t params = std::stoll(r.out.substr(at + shard.size()));
      EXPECT_LT(4 * params, whole);
      EXPECT_NE(r.out.find("tensor parallel rank 0: " + std::to_string(4 * params) + " of the model's " +
                           std::to_string(whole) + " parameter bytes placed on cpu:1"),
                std::string::npos)
          << r.out;
    }
    for (const char* update : {"cpu", "gpu"}) {
      const std::string out = name + "_off_" + update;
      r = train("gpt2", 2, rows, out,
                {"--parallel", layout, "--device", "cpu:1", "--offload-state", "optimizer", "--offload-update", update});
      ASSERT_EQ(r.status, 0) << layout << " " << update << "\n" << r.out << r.err;
      EXPECT_NE(r.out.find(std::string("optimizer state on the host (each rank's own parameters), update on the ") +
                           update),
                std::string::npos)
          << r.out;
      EXPECT_EQ(metric_losses(dir.path / out), on_device) << layout << ", --offload-update " << update;
    }
  }
}

// --gpu-memory-budget under split(2): each rank on its own device pool cpu:1 probes and plans its
// tensor-parallel shard (the model is split before the probe), and the plan's predicted peak is the
// training steps' (metrics.jsonl's mem_bytes) within 5%, with the state on the device and with it
// offloaded (each rank's own parameters' moments on the host); both train to the losses of the run
// without a budget. A budget nothing fits is refused with the smallest that would, before the run
// writes anything.
TEST_F(DistLayouts, MemoryBudgetUnderSplitPlansTheRanksShard) {
  LaunchResult r = train("gpt2", 2, 4, "tp_plain", {"--parallel", "split(2)", "--device", "cpu:1"});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto plain = metric_losses(dir.path / "tp_plain");
  ASSERT_EQ(plain.size(), 3u);
  int64_t whole = 0;
  for (const Tensor& p : models::build_model(models::resolve_model_config("tiny"), 1)->parameters()) whole += p.numel();
  for (const char* state : {"none", "optimizer"}) {
    const std::string out = std::string("tp_budget_") + state;
    r = train("gpt2", 2, 4, out,
              {"--parallel", "split(2)", "--device", "cpu:1", "--gpu-memory-budget", "1", "--offload-state", state,
               "--offload-chunk", "100000", "--log-every", "1"});
    ASSERT_EQ(r.status, 0) << state << "\n" << r.out << r.err;
    // The shard: fewer parameters than the model, more than half (norms and biases are whole).
    const size_t at_shard = r.out.find("memory plan of this rank's tensor-parallel shard: ");
    ASSERT_NE(at_shard, std::string::npos) << r.out;
    const int64_t shard =
        std::stoll(r.out.substr(at_shard + std::string("memory plan of this rank's tensor-parallel shard: ").size()));
    EXPECT_LT(shard, whole) << r.out;
    EXPECT_GT(2 * shard, whole) << r.out;
    const double planned = blu::test::planned_peak_bytes(r.out);
    ASSERT_GT(planned, 0) << r.out;
    const double peak = blu::test::metric_peak_bytes(dir.path / out);
    ASSERT_GT(peak, 0) << out;
    EXPECT_NEAR(peak, planned, 0.05 * planned) << out << "\n" << r.out;
    EXPECT_EQ(r.out.find("optimizer state on the host") != std::string::npos, std::string(state) == "optimizer")
        << r.out;
    EXPECT_EQ(metric_losses(dir.path / out), plain) << state;
    std::printf("split(2), %s: shard of %lld of %lld parameters, planned %.0f, steps' peak %.0f bytes\n", state,
                static_cast<long long>(shard), static_cast<long long>(whole), planned, peak);
  }
  r = train("gpt2", 2, 4, "tp_tiny_budget", {"--parallel", "split(2)", "--device", "cpu:1", "--gpu-memory-budget", "0.0001"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("no memory layout fits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the smallest device budget that fits is"), std::string::npos) << r.err;
  // Nothing of a run is written; the ranks' flight-recorder dumps (every rank dumps on a fatal
  // error once its groups exist: docs/reliability.md) are all the folder holds.
  if (fs::exists(dir.path / "tp_tiny_budget")) {
    for (const auto& e : fs::directory_iterator(dir.path / "tp_tiny_budget")) {
      EXPECT_EQ(e.path().filename(), "flight_recorder") << "a refused run left " << e.path();
    }
  }
}

// --gpu-memory-budget under a pipeline: each stage on its rank's device pool cpu:1 is probed by
// running one whole step of its schedule (every stage at once), so the plan holds the stage's own
// parameters and the micro-batches its schedule keeps in flight. Rank 0 (stage 0) prints its plan;
// the predicted peak is its training steps' within 5%, with the state on the device and offloaded,
// under 1F1B and GPipe, under dp × pp (4 ranks, the replicas' gradient average in the probe) and
// under pp × tp (4 ranks, each stage's tensor-parallel shard);
// each trains to the losses of the same layout without a budget, bit for bit. The tiny Llama
// (untied, a vocabulary of 128: its stage 0 is mostly activations) shows the schedules apart:
// GPipe keeps all 4 micro-batches of stage 0 in flight, 1F1B two, and under a budget between
// the two `--recompute auto` finds a recompute setting that fits on both stages (the candidates
// are agreed over the ranks: each probe is a collective step). (The tiny GPT-2's stage 0 peaks at
// the tied embedding's gradient exchange, after its activations are gone.) A budget nothing fits
// is refused with the smallest that would.
TEST_F(DistLayouts, MemoryBudgetUnderPipelinePlansEachStage) {
  int64_t stage0 = 0;  // GPT-2's stage 0 parameter elements: all but h.1 and ln_f (the head is tied)
  for (const auto& [name, p] : models::build_model(models::resolve_model_config("tiny"), 1)->named_parameters())
    if (!name.starts_with("h.1.") && !name.starts_with("ln_f.")) stage0 += p.numel();
  struct Case {
    std::string name, family;
    int ranks;
    int64_t rows;  // per micro-batch
    std::string layout, state;
    std::string budget = "1";  // GiB
    std::string recompute = "none";
  };
  std::map<std::string, double> planned_of;
  for (const Case& c : std::vector<Case>{
           {"1f1b", "llama", 2, 16, "pipeline(2, schedule=1f1b, micro=4)", "none"},
           {"gpipe", "llama", 2, 16, "pipeline(2, schedule=gpipe, micro=4)", "none"},
           {"gpipe_auto", "llama", 2, 16, "pipeline(2, schedule=gpipe, micro=4)", "none", "0.0068", "auto"},
           {"gpt2_1f1b", "gpt2", 2, 2, "pipeline(2, schedule=1f1b, micro=2)", "none"},
           {"gpt2_1f1b_off", "gpt2", 2, 2, "pipeline(2, schedule=1f1b, micro=2)", "optimizer"},
           {"dp_pp", "gpt2", 4, 2, "replicate(2){ pipeline(2, schedule=1f1b, micro=2) }", "none"},
           {"pp_tp", "llama", 4, 8, "pipeline(2, micro=2){ stage(model.layers.0){ split(2) } stage(model.layers.1){ split(2) } }",
            "optimizer"}}) {
    const std::string plain_out = "pp_plain_" + c.name;
    LaunchResult r = train(c.family, c.ranks, c.rows, plain_out, {"--parallel", c.layout, "--device", "cpu:1"});
    ASSERT_EQ(r.status, 0) << c.layout << "\n" << r.out << r.err;
    const auto plain = metric_losses(dir.path / plain_out);
    ASSERT_EQ(plain.size(), 3u) << c.layout;
    const std::string out = "pp_budget_" + c.name;
    r = train(c.family, c.ranks, c.rows, out,
              {"--parallel", c.layout, "--device", "cpu:1", "--gpu-memory-budget", c.budget, "--offload-state", c.state,
               "--offload-chunk", "100000", "--offload-update", "gpu", "--log-every", "1", "--recompute", c.recompute});
    ASSERT_EQ(r.status, 0) << c.name << "\n" << r.out << r.err;
    const bool split = c.layout.find("split") != std::string::npos;
    const std::string stage_line =
        std::string("memory plan of pipeline stage 0 (blocks 0-0") + (split ? ", a tensor-parallel shard" : "") + "): ";
    EXPECT_NE(r.out.find(c.family == "gpt2" ? stage_line + std::to_string(stage0) + " parameters" : stage_line),
              std::string::npos)
        << r.out;
    if (split) {  // stage 0's shard is all its device ever got: the plan's parameters, 4 bytes each
      const size_t at = r.out.find(stage_line);
      ASSERT_NE(at, std::string::npos) << r.out;
      const int64_t params = std::stoll(r.out.substr(at + stage_line.size()));
      EXPECT_NE(r.out.find("pipeline stage 0 (a tensor-parallel shard): " + std::to_string(4 * params) + " of the model's "),
                std::string::npos)
          << r.out;
    }
    const double planned = blu::test::planned_peak_bytes(r.out);
    ASSERT_GT(planned, 0) << r.out;
    const double peak = blu::test::metric_peak_bytes(dir.path / out);
    ASSERT_GT(peak, 0) << out;
    // The plan is the schedule's bound of micro-batches in flight (its probe runs the list in
    // order); message-driven training reaches it unless a gradient arrives before the next
    // forward's activation, which frees a micro-batch early (GPipe under load: three of four).
    EXPECT_LE(peak, 1.05 * planned) << c.name << "\n" << r.out;
    EXPECT_GE(peak, 0.75 * planned) << c.name << "\n" << r.out;
    EXPECT_EQ(r.out.find("optimizer state on the host") != std::string::npos, c.state == "optimizer") << r.out;
    EXPECT_EQ(metric_losses(dir.path / out), plain) << c.name;
    if (c.recompute == "auto") {  // GPipe's four micro-batches do not fit without recompute
      EXPECT_NE(r.out.find("recompute auto: "), std::string::npos) << r.out;
      EXPECT_EQ(r.out.find("recompute auto: none"), std::string::npos) << r.out;
      EXPECT_LT(planned, 0.0068 * 1073741824.0) << r.out;
    }
    planned_of[c.name] = planned;
    std::printf("%s %s, state %s: planned %.0f, steps' peak %.0f bytes\n", c.family.c_str(), c.layout.c_str(),
                c.state.c_str(), planned, peak);
  }
  EXPECT_GT(planned_of["gpipe"], planned_of["1f1b"]) << "GPipe holds every micro-batch in flight";
  EXPECT_LT(planned_of["gpt2_1f1b_off"], planned_of["gpt2_1f1b"]) << "the moments on the host";
  const LaunchResult r = train("gpt2", 2, 2, "pp_tiny_budget",
                               {"--parallel", "pipeline(2, micro=2)", "--device", "cpu:1", "--gpu-memory-budget", "0.0001"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("no memory layout fits"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the smallest device budget that fits is"), std::string::npos) << r.err;
}

// kill -9 under the hybrids, through the trainer: rank 1 is killed at a random moment of an
// 8-step run that checkpoints every step (the moment drawn here: 1.0–3.9 s after its start, which
// lands in start-up, a step or a save); `blutrain launch --max-restarts 1` restarts the job,
// which resumes from its newest committed checkpoint (--auto-resume) and gives the losses of an
// uninterrupted run of the same layout bit for bit.
TEST_F(DistLayouts, KillNineUnderHybridsResumesBitwise) {
  std::srand(unsigned(::getpid()));
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"dptp", "replicate(2){ split(2) }"},
           {"pptp", "pipeline(2, micro=2){ stage(h.0){ split(2) } stage(h.1){ split(2) } }"}}) {
    const int64_t batch = 2;  // rows per replica and micro-batch: 4 a step for both
    LaunchResult r = train("gpt2", 4, batch, name + "_straight", {"--parallel", layout}, 8);
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const auto straight = metric_losses(dir.path / (name + "_straight"));
    ASSERT_EQ(straight.size(), 8u);
    std::string args;
    for (const std::string& x :
         {std::string("--train-pattern"), (dir.path / "g_train_*.bin").string(), std::string("--model"),
          std::string("tiny"), std::string("-B"), std::to_string(batch), std::string("-T 32 --steps 8 --log-every 1"),
          std::string("--schedule constant --warmup 0 --lr 1e-3 --ckpt-every 1 --auto-resume --out"),
          (dir.path / (name + "_killed")).string()})
      args += " " + x;
    char delay[16];
    std::snprintf(delay, sizeof delay, "%d.%d", 1 + std::rand() % 3, std::rand() % 10);
    const std::string cmd = blutrain().string() + " train" + args + " --parallel '" + layout + "'";
    const std::string script = "if [ \"$BLU_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then (sleep " +
                               std::string(delay) + "; kill -9 $$) & fi; exec " + cmd;
    r = run_command(1, {blutrain().string(), "launch", "-n", "4", "--max-restarts", "1", "--", "/bin/sh", "-c", script},
                    {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(r.status, 0) << layout << " killed after " << delay << " s\n" << r.out << r.err;
    const bool killed = r.err.find("restarting all 4 ranks") != std::string::npos;
    std::printf("%s: rank 1 killed %s s after its start%s\n", layout.c_str(), delay,
                killed ? "; the job restarted" : ", after the run had ended");
    const auto resumed = metric_losses(dir.path / (name + "_killed"));
    ASSERT_EQ(resumed.size(), 8u) << layout;
    for (const auto& [step, loss] : straight) EXPECT_EQ(resumed.at(step), loss) << layout << ", step " << step;
  }
}

// The trainer's checkpoints resume under another layout (dist/layout_checkpoint.h): 2 steps under
// layout A with a checkpoint at step 2, its final checkpoint removed, then --auto-resume under
// layout B for step 3, whose loss must be one process's within 1e-5. The global batch per loader
// round (-B × replicas) is kept, as the loader requires (docs/distributed.md). Writers and readers:
// TP → one process, uneven widths → even, DP × PP → PP × TP, DP × PP × TP (8 ranks) → PP (2),
// DP × TP → ZeRO-3, uneven replicas → TP + SP.
TEST_F(DistLayouts, TrainerResumesUnderAnotherLayout) {
  LaunchResult r = train("gpt2", 1, 4, "single", {});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto single = metric_losses(dir.path / "single");
  struct Case {
    std::string name;
    int ranks_a;
    int64_t batch_a;
    std::string layout_a;
    int ranks_b;
    int64_t batch_b;
    std::string layout_b;
  };
  for (const Case& c : std::vector<Case>{
           {"tp_to_single", 2, 4, "split(2)", 1, 4, ""},
           {"uneven_tp_to_tp", 2, 4, "split(2, widths=[0.75,0.25])", 2, 4, "split(2)"},
           {"dppp_to_pptp", 4, 1, "replicate(2){ pipeline(2, micro=2) }", 4, 2,
            "pipeline(2, micro=2){ stage(h.0){ split(2) } stage(h.1){ split(2) } }"},
           {"dpptp_to_pp", 8, 1, "replicate(2){ pipeline(2, micro=2){ stage(h.0){ split(2) } stage(h.1){ split(2) } } }",
            2, 2, "pipeline(2, micro=2)"},
           {"dptp_to_zero3", 4, 2, "replicate(2){ split(2) }", 2, 2, "replicate(2, zero=3)"},
           {"uneven_to_tpsp", 2, 2, "replicate(2, weights=[0.75,0.25])", 2, 4, "split(2, sp=true)"}}) {
    r = train("gpt2", c.ranks_a, c.batch_a, c.name, {"--parallel", c.layout_a, "--ckpt-every", "2"});
    ASSERT_EQ(r.status, 0) << c.layout_a << "\n" << r.out << r.err;
    // A layout checkpoint (a folder), or DDP's single file.
    const fs::path folder = dir.path / c.name / "ckpt_00000002", file = dir.path / c.name / "ckpt_00000002.safetensors";
    const fs::path written = fs::exists(file) ? file : folder;
    ASSERT_TRUE(fs::exists(file) || fs::exists(folder / "COMMIT")) << r.out;
    fs::remove_all(dir.path / c.name / "ckpt_00000003");
    fs::remove(dir.path / c.name / "ckpt_00000003.safetensors");
    std::vector<std::string> b = {"--auto-resume"};
    if (!c.layout_b.empty()) b.insert(b.end(), {"--parallel", c.layout_b});
    r = train("gpt2", c.ranks_b, c.batch_b, c.name, b);
    ASSERT_EQ(r.status, 0) << c.layout_b << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("resumed from " + written.string()), std::string::npos) << r.out;
    const auto got = metric_losses(dir.path / c.name);
    ASSERT_EQ(got.size(), 3u) << c.name;
    for (const auto& [step, loss] : single)
      EXPECT_NEAR(got.at(step), loss, 1e-5 * std::abs(loss)) << c.name << ", step " << step;
  }
}

// examples/parallel_script: the one script, four lines away from the one-device one, trains the
// one-device losses under tensor parallelism, uneven replicas, a pipeline and DP × PP × TP (8
// processes): the same global batch, cut by the layout (tolerance: the fp32 bounds above).
TEST_F(DistLayouts, ScriptRunsEveryLayout) {
  const fs::path script = blutrain().parent_path() / "examples" / "parallel_script";
  if (!fs::exists(script)) GTEST_SKIP() << script << " not built";  // as the fixture does for blutrain
  auto losses = [&](const std::string& name) {
    std::vector<double> v;
    std::ifstream f(dir.path / name);
    for (double x; f >> x;) v.push_back(x);
    return v;
  };
  LaunchResult r = run_command(1, {script.string(), "", (dir.path / "one").string()}, {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const std::vector<double> one = losses("one");
  ASSERT_EQ(one.size(), 10u);
  EXPECT_LT(one.back(), one.front() - 1e-3);  // it trains
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, "split(2, sp=true)"},
      {2, "replicate(2, weights=[3,1])"},
      {2, "pipeline(2, schedule=gpipe, micro=4)"},
      {8, "replicate(2){ pipeline(2, micro=2){ stage(h.0){ split(2) } stage(h.1){ split(2) } } }"}};
  for (size_t i = 0; i < layouts.size(); ++i) {
    const auto& [n, layout] = layouts[i];
    const std::string out = "script" + std::to_string(i);
    r = run_command(1, {blutrain().string(), "launch", "-n", std::to_string(n), "--", script.string(), layout,
                        (dir.path / out).string()},
                    {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    const std::vector<double> got = losses(out);
    ASSERT_EQ(got.size(), one.size()) << layout;
    for (size_t k = 0; k < one.size(); ++k) EXPECT_NEAR(got[k], one[k], 1e-5 * std::abs(one[k])) << layout << ", step " << k;
  }
  // What the script cannot take: a layout still to be decided.
  r = run_command(1, {script.string(), "split(1, widths=probe)"}, {});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("asks for the planner or a probe"), std::string::npos) << r.err;
}

// `--parallel auto` and weights=probe in the trainer (Note [Deciding --parallel]): decided at start,
// printed, recorded in run.json as a stated layout with -B as its rows, and trained — three steps
// give one process's losses on the same global batch (-B 2 x 2 ranks = 4 rows) within 1e-5. A
// resume given nothing but --out takes the recorded layout and trains on.
TEST_F(DistLayouts, TrainerDecidesAutoAndProbe) {
  LaunchResult r = train("gpt2", 1, 4, "single", {});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto single = metric_losses(dir.path / "single");
  for (const std::string layout :
       {"auto", "replicate(2, weights=probe)", "split(2, widths=probe)", "pipeline(2, balance=time, micro=2)"}) {
    const bool split = layout.rfind("split", 0) == 0, piped = layout.rfind("pipeline", 0) == 0;
    const std::string out = layout == "auto" ? "auto" : split ? "widths" : piped ? "balance" : "probe";
    r = train("gpt2", 2, split ? 4 : 2, out, {"--parallel", layout});  // TP ranks share their rows
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find(layout == "auto" ? "parallel auto: training " : "parallel: the probe measured step times of"),
              std::string::npos)
        << r.out;
    nlohmann::json run;
    std::ifstream(dir.path / out / "run.json") >> run;
    const std::string stated = run["options"]["parallel"].get<std::string>();
    EXPECT_NE(stated, "auto");
    if (layout == "auto") {  // after the first steps: the prediction against what the steps measured
      EXPECT_NE(r.out.find("parallel auto: measured "), std::string::npos) << r.out;
      bool seen = false;
      std::ifstream mf(dir.path / out / "metrics.jsonl");
      for (std::string line; std::getline(mf, line);) {
        const nlohmann::json ev = nlohmann::json::parse(line);
        if (ev.value("event", "") != "parallel_auto") continue;
        seen = true;
        EXPECT_EQ(ev["layout"].get<std::string>(), stated);
        EXPECT_GT(ev["ms"].get<double>(), 0);
        EXPECT_GT(ev["mib"].get<double>(), 0);
        EXPECT_NEAR(ev["error_step"].get<double>(),
                    (ev["predicted_ms"].get<double>() - ev["ms"].get<double>()) / ev["ms"].get<double>(), 1e-9);
      }
      EXPECT_TRUE(seen) << "no parallel_auto event in metrics.jsonl";
    }
    EXPECT_EQ(stated.find("probe"), std::string::npos) << stated;
    if (piped) {  // the stages the probe's times picked (Note [Stages by time])
      EXPECT_EQ(stated.find("balance"), std::string::npos) << stated;
      EXPECT_NE(stated.find("stage(h.0-"), std::string::npos) << stated;
    } else if (layout != "auto") {
      EXPECT_NE(stated.find(split ? "widths=[" : "weights=["), std::string::npos) << stated;
    }
    const auto got = metric_losses(dir.path / out);
    ASSERT_EQ(got.size(), 3u) << layout;
    for (const auto& [step, loss] : single)
      EXPECT_NEAR(got.at(step), loss, 1e-5 * std::abs(loss)) << layout << " as " << stated << ", step " << step;
  }
  r = run_command(1, {blutrain().string(), "launch", "-n", "2", "--", blutrain().string(), "train", "--out",
                      (dir.path / "probe").string(), "--resume", "--steps", "4"},
                  {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("step 4/4"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("the probe measured"), std::string::npos) << r.out;  // the recorded weights
}

}  // namespace
}  // namespace blu::dist::test
