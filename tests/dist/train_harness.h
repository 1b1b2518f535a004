// Data-parallel training of a tiny model for the multi-process tests: one function runs a rank in
// any mode through dist::Strategy — "single" (plain AdamW, one process), "ddp" (DDP + AdamW),
// "zero1" (DDP + ZeroAdamW stage 1), "zero2" (ZeroAdamW stage 2), "zero2rows" (stage 2 with the
// tied embedding's row exchange; BLU_DIST_ROWS_LIMIT its gather limit), "zero3" (stage 3),
// "zero3keep" (stage 3, blocks kept from forward to backward) — on a fixed global batch of 8
// rows × 16 tokens per micro-batch, rank r taking rows [r·8/W, (r+1)·8/W). Settings come from the
// environment (BLU_DIST_MODE, _STEPS, _ACCUM, _OUT, _SAVE_DIR, _SAVE_AT, _RESUME_DIR; _FAMILY:
// gpt2 (the tiny GPT, the default) or llama (Llama's "tiny" preset, untied); _LAYERS: blocks;
// _CLIP: the clipping norm, 1 by default, 0 off; _OFFLOAD=1: the model on a pool cpu:1 and
// AdamW's moments offloaded (streamed through it); _MEMCHECK=1: ZeRO-3's memory bound checked at
// every block, see zero3_memory_hooks); rank 0 writes <out>.losses (the global mean loss per
// step), <out>.params (every parameter, f32) and <out>.peak (the CPU allocator's peak tensor bytes
// over the run).
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/dist/ddp.h"
#include "blu/dist/strategy.h"
#include "blu/dist/env.h"
#include "blu/dist/zero.h"
#include "blu/io/checkpoint.h"
#include "blu/autograd/function.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/models/registry.h"
#include "blu/optim/optimizer.h"

namespace blu::dist::test {

inline constexpr int64_t kRows = 8, kT = 16;

// Token ids of global row `row`, micro-batch `micro` of step `step` (inputs; targets are the next).
inline int32_t token(int64_t step, int64_t micro, int64_t row, int64_t t) {
  uint64_t x = uint64_t(step * 1000003 + micro * 7919 + row * 131 + t) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return int32_t(x % 101);
}

inline std::string getenv_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

inline nlohmann::json harness_model_config(const std::string& family, int64_t layers) {
  if (family == "llama") {
    models::LlamaConfig c = models::LlamaConfig::preset("tiny");
    if (layers > 0) c.num_hidden_layers = layers;
    return c.to_json();
  }
  models::GPTConfig c = ::blu::test::tiny_gpt();
  if (layers > 0) c.n_layer = layers;
  return c.to_json();
}

// ZeRO-3's memory bound, checked at every block of the forward and the backward. `act[i]`: the
// allocator's growth from the start of a plain forward (whole parameters, no strategy) to block
// i's input — the activations. Under ZeRO-3, at block i's input (after the strategy's hook):
//   the allocator's live bytes ≤ (live bytes before the step) + act[i] + 2 gathered units + 16 KiB,
//   the units' parameter bytes ≤ 2 units (the one computing and the prefetched one), no gradient
//   buffer; in the backward, right after block i's: parameter bytes ≤ 2 units, gradient buffers
//   ≤ 3 units (two reductions in flight and block i's) and the rest's;
// and before the step the live bytes hold no whole parameters: ≤ the shards (parameters,
// gradient, two moments: 4 × Σ chunks of f32) + the model's buffers + 16 KiB.
struct Zero3MemoryCheck {
  std::vector<int64_t> act;
  int64_t base = 0, unit_bytes = 0, rest_bytes = 0, shard_bytes = 0, worst_forward = 0;
  int checked = 0;
};

inline void zero3_memory_hooks(models::CausalLM& lm, ZeroAdamW& z, int W, Zero3MemoryCheck& mc) {
  constexpr int64_t kSlack = 16 << 10;
  for (size_t u = 0; u < z.num_units(); ++u) {
    const int64_t bytes = (z.unit_numel(u) + W - 1) / W * W * 4;
    mc.shard_bytes += 4 * bytes / W;
    if (u + 1 < z.num_units()) mc.unit_bytes = std::max(mc.unit_bytes, bytes);
    else mc.rest_bytes = bytes;
  }
  const int64_t two = 2 * std::max(mc.unit_bytes, mc.rest_bytes);
  lm.add_block_hooks(
      [&z, &mc, two](size_t i, const Tensor& x) {
        if (!GradMode::enabled()) return x;
        const int64_t live = cpu_allocator().stats().current_bytes - mc.base;
        EXPECT_LE(live, mc.act.at(i) + two + kSlack) << "block " << i << " forward";
        EXPECT_LE(z.gathered_bytes(), two) << "block " << i << " forward";
        mc.worst_forward = std::max(mc.worst_forward, z.gathered_bytes());
        ++mc.checked;
        return identity_with_backward_callback(
            x,
            [&z, &mc, two, i] {
              EXPECT_LE(z.gathered_bytes(), two + 3 * mc.unit_bytes + mc.rest_bytes) << "block " << i << " backward";
              ++mc.checked;
            },
            "zero3_memory_check");
      },
      {});
}

inline void train_worker() {
  using namespace std::chrono_literals;
  const DistEnv env = detect_env();
  const std::string mode = getenv_or("BLU_DIST_MODE", "single");
  const int64_t steps = std::stoll(getenv_or("BLU_DIST_STEPS", "4"));
  const int64_t accum = std::stoll(getenv_or("BLU_DIST_ACCUM", "1"));
  const std::string out = getenv_or("BLU_DIST_OUT", "");
  const std::string save_dir = getenv_or("BLU_DIST_SAVE_DIR", "");
  const int64_t save_at = std::stoll(getenv_or("BLU_DIST_SAVE_AT", "-1"));
  const std::string resume_dir = getenv_or("BLU_DIST_RESUME_DIR", "");
  const double rows_limit = std::stod(getenv_or("BLU_DIST_ROWS_LIMIT", "1"));
  const bool zero2 = mode == "zero2" || mode == "zero2rows";
  const bool zero3 = mode == "zero3" || mode == "zero3keep";
  const std::string family = getenv_or("BLU_DIST_FAMILY", "gpt2");
  const int64_t layers = std::stoll(getenv_or("BLU_DIST_LAYERS", "0"));
  const double clip = std::stod(getenv_or("BLU_DIST_CLIP", "1"));
  const bool memcheck = getenv_or("BLU_DIST_MEMCHECK", "") == "1";
  const int W = env.world_size, r = env.rank;
  ASSERT_EQ(kRows % W, 0);
  ASSERT_TRUE(mode == "single" ? W == 1 : true);

  std::unique_ptr<TcpStore> store;
  std::shared_ptr<ProcessGroup> pg;
  if (mode != "single") {
    store = std::make_unique<TcpStore>(env.master_addr, env.master_port, r == 0, 10000ms);
    pg = make_gloo_group(*store, r, W, GlooOptions{.timeout = 10000ms, .hostname = "", .prefix = "default_pg"});
  }
  const nlohmann::json cfg = harness_model_config(family, layers);
  // Different per rank on purpose: DDP/ZeRO broadcast rank 0's.
  std::unique_ptr<models::CausalLM> lm = models::build_model(cfg, 1234 + uint64_t(r));
  models::CausalLM& model = *lm;
  if (mode == "single") model.load_state_dict(models::build_model(cfg, 1234)->state_dict());
  // BLU_DIST_OFFLOAD=1: the model on a device pool cpu:1 apart from the host, AdamW's moments
  // offloaded to the host and streamed through it in chunks of 1000 elements (several per shard).
  const bool offload = getenv_or("BLU_DIST_OFFLOAD", "") == "1";
  const Device dev = offload ? Device(DeviceType::cpu, 1) : kCPU;
  if (offload) model.to(dev);
  std::vector<Tensor> params = model.parameters();
  const int64_t rows = kRows / W;
  const auto batch = [&](int64_t step, int64_t m) {
    std::vector<double> in, tg;
    for (int64_t row = r * rows; row < (r + 1) * rows; ++row)
      for (int64_t t = 0; t < kT; ++t) {
        in.push_back(token(step, m, row, t));
        tg.push_back(token(step, m, row, t + 1));
      }
    return std::pair{to_device(from_vector(in, {rows, kT}, DType::i32), dev),
                     to_device(from_vector(tg, {rows, kT}, DType::i32), dev)};
  };
  Zero3MemoryCheck mc;
  if (memcheck) {  // the activations of a plain forward, block by block
    const auto [idx, tgt] = batch(0, 0);
    const int64_t start = cpu_allocator().stats().current_bytes;
    const int h = model.add_block_hooks(
        [&](size_t, const Tensor& x) {
          mc.act.push_back(cpu_allocator().stats().current_bytes - start);
          return x;
        },
        {});
    model.forward(idx, tgt);
    model.remove_block_hooks(h);
  }
  // Small buckets (several; under stage 2 a parameter split across ranks' chunks), in the order
  // backward completes the gradients, as the trainer gives them.
  StrategyConfig sc;
  sc.zero = mode == "zero1" ? 1 : zero2 ? 2 : zero3 ? 3 : 0;
  sc.zero3_keep_forward = mode == "zero3keep";
  sc.row_exchange = mode == "zero2rows";
  sc.rows_gather_limit = rows_limit;
  sc.ddp.bucket_mib = 0.02;
  sc.zero_bucket_mib = 0.02;
  if (offload) {
    sc.offload_state = true;
    sc.offload.update = offload::UpdateOn::device;
    sc.offload.chunk_elements = 1000;
  }
  Strategy strategy(model, pg, sc, OptimizerConfig{.lr = 1e-3, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
  if (offload && strategy.zero()) {
    ASSERT_TRUE(strategy.zero()->offloads_state());
  }
  int64_t step = 0;
  if (!resume_dir.empty()) {
    ASSERT_NE(strategy.zero(), nullptr) << "resume is tested through sharded (ZeRO) checkpoints";
    const std::string ckpt = strategy.latest_checkpoint(resume_dir);
    ASSERT_FALSE(ckpt.empty());
    step = strategy.load(ckpt, model, cfg).step;
  }
  if (memcheck) {
    ASSERT_TRUE(zero3 && mode == "zero3");
    zero3_memory_hooks(model, *strategy.zero(), W, mc);
  }

  std::vector<double> losses;
  for (; step < steps; ++step) {
    const auto loss_of = [&](int64_t m) {
      const auto [idx, targets] = batch(step, m);
      return model.forward(idx, targets).loss;
    };
    mc.base = cpu_allocator().stats().current_bytes;
    if (memcheck) {  // the shards and the model's buffers (rotary tables, masks), no whole parameters
      int64_t buffers = 0;
      for (const auto& [name, b] : model.named_buffers()) buffers += int64_t(b.nbytes());
      EXPECT_LE(mc.base, mc.shard_bytes + buffers + (16 << 10)) << "live bytes before step " << step;
    }
    const StepValues v = strategy.step(accum, loss_of, 1e-3, clip);
    if (mode == "zero2rows") {  // the path the limit asks for
      const std::string want =
          double(W) * double(rows * kT) <= rows_limit * double(cfg.at("padded_vocab_size").get<int64_t>()) ? "gather" : "dense";
      EXPECT_EQ(strategy.zero()->row_exchange_paths(), std::vector<std::string>{want});
    }
    losses.push_back(strategy.read(v, false).loss);
    if (step + 1 == save_at) {
      ASSERT_NE(strategy.zero(), nullptr);
      TrainState st;
      st.step = step + 1;
      st.model_config = cfg;
      strategy.save(save_dir, model, st, 0);
    }
  }
  if (memcheck) {
    EXPECT_GT(mc.checked, 0);
    std::printf("rank %d: ZeRO-3 parameter bytes at most %lld in forward; a block unit %lld, the rest %lld, "
                "the whole model %lld bytes; shards %lld bytes\n",
                r, static_cast<long long>(mc.worst_forward), static_cast<long long>(mc.unit_bytes),
                static_cast<long long>(mc.rest_bytes), static_cast<long long>(model.num_parameters() * 4),
                static_cast<long long>(mc.shard_bytes));
  }
  const auto full = strategy.full_parameters();  // ZeRO-3: the parameters whole for the dump
  if (r == 0 && !out.empty()) {
    std::ofstream lf(out + ".losses");
    char buf[64];
    for (double l : losses) {
      std::snprintf(buf, sizeof buf, "%.17g\n", l);
      lf << buf;
    }
    std::ofstream pf(out + ".params", std::ios::binary);
    for (const Tensor& p : params) pf.write(static_cast<const char*>(p.raw_data()), std::streamsize(p.nbytes()));
    std::ofstream(out + ".peak") << cpu_allocator().stats().peak_bytes << "\n";  // tensor bytes, this rank
  }
  if (pg) pg->barrier()->wait();
}

}  // namespace blu::dist::test
