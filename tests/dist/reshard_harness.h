// Layout checkpoints across layouts, for the multi-process tests (reshard_test.cpp):
//   reshard_worker: the tiny GPT-2 or Llama of tp_harness.h (BLU_RS_FAMILY) under one layout
//     (BLU_RS_LAYOUT: single, ddp, zero1, zero3 — data parallel over the world —, tp, tpsp —
//     tensor parallel over the world, with sequence parallelism —, pp — a 2-stage 1F1B pipeline
//     of 2 micro-batches) trains the steps [BLU_RS_FROM, BLU_RS_TO) on one fixed global batch
//     (8 rows × 16 tokens, token(0, …), so the loss falls); replicas take rows apart, TP ranks and pipeline
//     stages all of them), AdamW at lr 1e-3, clipping at 1. BLU_RS_LOAD: a directory whose newest
//     valid checkpoint is loaded first (its step must be BLU_RS_FROM; rank 0 prints the skipped
//     ones); BLU_RS_SAVE: a directory a layout checkpoint is written to after every step
//     (BLU_RS_KEEP of them kept); BLU_RS_KILL_AT: rank BLU_RS_KILL_RANK kills itself (SIGKILL)
//     during that step, BLU_RS_KILL_PHASE saying when (0: in the forward, 1: in the save, its
//     pieces file on disk and no COMMIT). Rank 0 appends "<step> <loss %.17g>" lines to <BLU_DIST_OUT>.
#pragma once
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/layout_checkpoint.h"
#include "blu/dist/strategy.h"
#include "blu/dist/tensor_parallel.h"
#include "tp_harness.h"

namespace blu::dist::test {

inline void reshard_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const std::string family = getenv_or("BLU_RS_FAMILY", "gpt2"), layout = getenv_or("BLU_RS_LAYOUT", "single");
  const int64_t from = std::stoll(getenv_or("BLU_RS_FROM", "0")), to = std::stoll(getenv_or("BLU_RS_TO", "6"));
  const std::string load_dir = getenv_or("BLU_RS_LOAD", ""), save_dir = getenv_or("BLU_RS_SAVE", "");
  const int keep = std::stoi(getenv_or("BLU_RS_KEEP", "2"));
  const int64_t kill_at = std::stoll(getenv_or("BLU_RS_KILL_AT", "-1"));
  const int kill_rank = std::stoi(getenv_or("BLU_RS_KILL_RANK", "1")), kill_phase = std::stoi(getenv_or("BLU_RS_KILL_PHASE", "0"));
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  const int r = env.rank, W = env.world_size;
  ASSERT_TRUE(layout != "single" || W == 1) << layout;

  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  if (W > 1) {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    pg = make_gloo_group(*store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  }
  std::unique_ptr<models::CausalLM> model = tp_model(family, 1234);  // the same initial weights everywhere
  const bool tp = layout == "tp" || layout == "tpsp", pp = layout == "pp";
  if (tp) apply_tensor_parallel(*model, pg, TPOptions{.sequence_parallel = layout == "tpsp"});
  StrategyConfig sc;
  sc.layout_checkpoints = true;
  if (layout == "zero1") sc.zero = 1;
  if (layout == "zero3") sc.zero = 3;
  const OptimizerConfig oc{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  std::unique_ptr<Strategy> strategy;
  if (pp) {
    PipelineOptions po;
    po.micro_batches = 2;
    strategy = std::make_unique<Strategy>(*model, pg, po, sc, oc);
  } else if (tp) {
    sc.tp = pg;
    strategy = std::make_unique<Strategy>(*model, nullptr, sc, oc);
  } else {
    strategy = std::make_unique<Strategy>(*model, pg, sc, oc);
  }

  if (!load_dir.empty()) {
    const std::string path = strategy->latest_checkpoint(load_dir, [&](const std::string& w) {
      if (r == 0) std::printf("%s\n", w.c_str());
    });
    ASSERT_FALSE(path.empty()) << "no valid checkpoint in " << load_dir;
    const TrainState st = strategy->load(path, *model, model->config());
    ASSERT_EQ(st.step, from) << path;
    if (r == 0) std::printf("loaded %s (written by %s)\n", path.c_str(), LayoutCheckpoint(path).layout().dump().c_str());
  }

  const int64_t rows = (tp || pp || W == 1) ? 8 : 8 / W, row0 = (tp || pp || W == 1) ? 0 : r * rows;
  const int64_t micro = pp ? 2 : 1, per_micro = rows / micro, T = 16, V = model->vocab_size();
  for (int64_t step = from; step < to; ++step) {
    const BatchFn batch_of = [&](int64_t m) {
      if (step == kill_at && kill_phase == 0 && r == kill_rank) ::kill(::getpid(), SIGKILL);
      std::vector<double> in, tg;
      for (int64_t row = row0 + m * per_micro; row < row0 + (m + 1) * per_micro; ++row)
        for (int64_t t = 0; t < T; ++t) {
          in.push_back(token(0, 0, row, t) % V);  // the same batch every step: the loss must fall
          tg.push_back(token(0, 0, row, t + 1) % V);
        }
      return std::make_pair(from_vector(in, {per_micro, T}, DType::i32), from_vector(tg, {per_micro, T}, DType::i32));
    };
    const StepReadout rd = strategy->read(strategy->step(micro, batch_of, 1e-3, 1.0), false);
    if (r == 0 && !out.empty()) {
      std::FILE* f = std::fopen(out.c_str(), "a");
      std::fprintf(f, "%lld %.17g\n", (long long)step, rd.loss);
      std::fclose(f);
    }
    if (!save_dir.empty()) {
      TrainState st;
      st.step = step + 1;
      st.model_config = model->config();
      if (step == kill_at && kill_phase == 1 && r == kill_rank) {
        // Killed in the middle of the save: this rank's pieces on disk, no COMMIT.
        char name[32];
        std::snprintf(name, sizeof name, "/ckpt_%08lld", (long long)st.step);
        write_pieces(save_dir + name, r, {GlobalPiece{"model.x", {1}, {0}, -1, zeros({1})}});
        ::kill(::getpid(), SIGKILL);
      }
      strategy->save(save_dir, *model, st, keep);
    }
  }
  if (pg) pg->barrier()->wait();
}

}  // namespace blu::dist::test

namespace blu::dist::test {

// reshard_fixture_worker: loads the checkpoint BLU_RS_PATH (any format) into a model built from
// its own config under BLU_RS_LAYOUT (as reshard_worker's), then checks every parameter, gathered
// whole, equals the checkpoint's "model.<name>" bit for bit and the optimizer's step count is the
// checkpoint's; BLU_RS_EXPECT_ERROR: the load must fail with a message containing it instead.
inline void reshard_fixture_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const std::string path = getenv_or("BLU_RS_PATH", ""), layout = getenv_or("BLU_RS_LAYOUT", "single");
  const std::string expect_error = getenv_or("BLU_RS_EXPECT_ERROR", "");
  const int r = env.rank, W = env.world_size;
  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  if (W > 1) {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    pg = make_gloo_group(*store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  }
  // The checkpoint's model config, read without loading (a file's train_state, a directory's
  // train_state.json or first stage file).
  nlohmann::json config;
  if (std::filesystem::is_directory(path) && !is_layout_checkpoint(path) && !std::filesystem::exists(std::filesystem::path(path) / "stage_000_of_002.safetensors")) {
    config = nullptr;  // a ZeRO-sharded directory: its model file holds the config
    for (const auto& e : std::filesystem::directory_iterator(path))
      if (e.path().filename().string().starts_with("ckpt_"))
        config = LayoutCheckpoint(e.path().string()).train_state().model_config;
  } else {
    config = LayoutCheckpoint(path).train_state().model_config;
  }
  std::unique_ptr<models::CausalLM> model = models::build_model(config, 99);
  const bool tp = layout == "tp", pp = layout == "pp";
  if (tp) apply_tensor_parallel(*model, pg);
  StrategyConfig sc;
  if (layout == "zero1") sc.zero = 1;
  if (layout == "zero3") sc.zero = 3;
  const OptimizerConfig oc{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  std::unique_ptr<Strategy> strategy;
  if (pp) {
    PipelineOptions po;
    po.micro_batches = 2;
    strategy = std::make_unique<Strategy>(*model, pg, po, sc, oc);
  } else if (tp) {
    sc.tp = pg;
    strategy = std::make_unique<Strategy>(*model, nullptr, sc, oc);
  } else {
    strategy = std::make_unique<Strategy>(*model, pg, sc, oc);
  }
  if (!expect_error.empty()) {
    try {
      strategy->load(path, *model, config);
      ADD_FAILURE() << "loading " << path << " under " << layout << " should fail with '" << expect_error << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect_error), std::string::npos) << e.what();
      if (r == 0) std::printf("refused: %s\n", e.what());
    }
    if (pg) pg->barrier()->wait();
    return;
  }
  const TrainState st = strategy->load(path, *model, config);
  EXPECT_EQ(st.step, 2);
  EXPECT_EQ(strategy->optimizer().steps(), 2) << layout;
  const LayoutCheckpoint ck(path);
  nn::NamedTensors full;
  {
    Strategy::FullParameters guard = strategy->full_parameters();
    full = tp ? gather_full_state(*model, *pg) : model->named_parameters();
    for (auto& [name, t] : full) t = clone(t);
  }
  int checked = 0;
  for (const auto& [name, t] : full) {
    const Tensor want = ck.tensors().full("model." + name);
    ASSERT_EQ(t.shape(), want.shape()) << name;
    EXPECT_EQ(to_vector(t), to_vector(want)) << layout << ": " << name;
    ++checked;
  }
  if (r == 0) std::printf("%s: %d parameters equal the checkpoint's\n", layout.c_str(), checked);
  if (pg) pg->barrier()->wait();
}

}  // namespace blu::dist::test
