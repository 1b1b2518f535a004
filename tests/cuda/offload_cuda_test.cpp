// Offloaded AdamW on the GPU: the state in pinned host memory, updated on the host (gradients down
// on a side stream, parameters up on another) or streamed through the GPU in chunks on side streams
// (upload of chunk i+1 beside the update of chunk i) — both against the plain AdamW on the GPU bit
// for bit (parameters, moments, bf16 compute copies) over several steps with clipping, and a small
// GPT trained with its state offloaded ending where the plain run ends (within the rounding the
// attention backward's atomics allow: tests/cuda/trainer_cuda_test.cpp); the streamed update's first
// upload waits for work the current stream had queued on the blocks its staging buffers reuse; the
// host update behind the next forward (a worker thread, the forward's block hooks waiting for each
// block's uploads) trains as the update inside the step does.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/dist/strategy.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/nn/compute_copy.h"
#include "blu/offload/offload_adamw.h"
#include "blu/train/trainer.h"
#include "common/tiny_gpt.h"
#include "cuda/cuda_test_util.h"
#include "cuda/held_fills.h"
#include "data/data_test_util.h"
#include "offload/overlap_run.h"
#include "train/train_test_util.h"

namespace blu::offload {
namespace {

std::vector<float> host_floats(const Tensor& t) {
  const Tensor h = to_device(t.dtype() == DType::f32 ? t : to_dtype(t, DType::f32), kCPU);
  return std::vector<float>(h.data<float>(), h.data<float>() + h.numel());
}

Tensor random_cuda(const Shape& shape, std::mt19937& rng, float scale) {
  Tensor h = empty(shape, DType::f32, kCPU);
  std::normal_distribution<float> d(0.f, scale);
  for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = d(rng);
  return to_device(h, Device("cuda"));
}

void check_against_plain(UpdateOn update) {
  SKIP_WITHOUT_CUDA();
  std::mt19937 rng(3);
  const std::vector<Shape> shapes{{257, 96}, {96}, {1000, 33}, {5}};
  std::vector<Tensor> a, b;  // the same parameters twice
  for (const Shape& s : shapes) {
    Tensor p = random_cuda(s, rng, 1.f);
    a.push_back(clone(p));
    b.push_back(clone(p));
  }
  nn::NamedTensors na, nb;
  for (size_t i = 0; i < a.size(); ++i) {
    na.emplace_back("p" + std::to_string(i), a[i]);
    nb.emplace_back("p" + std::to_string(i), b[i]);
  }
  const optim::AdamWOptions opt{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  auto plain = optim::make_adamw(optim::decay_groups(na, 0.1), opt);
  OffloadOptions oo;
  oo.update = update;
  oo.chunk_elements = 10000;  // several chunks, pieces split across parameters
  OffloadAdamW off(optim::decay_groups(nb, 0.1), opt, oo);
  // bf16 compute copies on both sides, written by the update.
  nn::ComputeCopies ca, cb;
  for (size_t i = 0; i < a.size(); ++i) {
    auto c1 = std::make_shared<nn::ComputeCopy>(), c2 = std::make_shared<nn::ComputeCopy>();
    c1->cast(a[i], DType::bf16);
    c2->cast(b[i], DType::bf16);
    ca.emplace_back(a[i], c1);
    cb.emplace_back(b[i], c2);
  }
  plain->attach_compute_copies(ca);
  off.attach_compute_copies(cb);
  NoGradGuard no_grad;
  for (int step = 0; step < 4; ++step) {
    std::vector<Tensor> ga, gb;
    for (size_t i = 0; i < a.size(); ++i) {
      Tensor g = random_cuda(a[i].shape(), rng, 0.5f);
      a[i].set_grad(clone(g));
      b[i].set_grad(clone(g));
    }
    const NormGate gate_a = optim::grad_norm_gate(a, 1.0), gate_b = optim::grad_norm_gate(b, 1.0);
    plain->step(gate_a);
    off.step(gate_b);
  }
  const nn::NamedTensors sa = plain->state(), sb = off.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_EQ(host_floats(to_dtype(sa[i].second, DType::f32)), host_floats(to_dtype(sb[i].second, DType::f32)))
        << sa[i].first;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(host_floats(a[i]), host_floats(b[i])) << "parameter " << i;
    // The host update leaves the copy to be re-cast by the next forward; either way it equals the cast.
    EXPECT_EQ(host_floats(ca[i].second->cast(a[i], DType::bf16)), host_floats(cb[i].second->cast(b[i], DType::bf16)));
  }
  // The state is in pinned host memory.
  EXPECT_GT(cuda::pinned_memory_stats().requested_bytes, 0);
  EXPECT_TRUE(sb.back().second.device().is_cpu());
}

TEST(OffloadCuda, HostUpdateMatchesPlainAdamWBitwise) { check_against_plain(UpdateOn::cpu); }
TEST(OffloadCuda, StreamedChunkedUpdateMatchesPlainAdamWBitwise) { check_against_plain(UpdateOn::device); }

// The streamed update's device staging buffers come from the caching allocator, which hands a block
// freed by the current stream back to it at once, though work that stream has queued may still
// write it. The first chunk's upload, on the in lane, must wait for that work: here fills held on
// the current stream (cuda/held_fills.h), on blocks freed right before the optimizer is made, would
// land on the uploaded moments. A first optimizer warms the pinned cache and the kernels.
TEST(OffloadCuda, StreamedUpdateWaitsForWorkQueuedOnItsStagingBuffers) {
  SKIP_WITHOUT_CUDA();
  const Device gpu("cuda");
  std::mt19937 rng(5);
  const int64_t n = int64_t(1) << 22;  // 16 MiB of f32: one chunk
  Tensor a = random_cuda({n}, rng, 1.f), b = clone(a);
  const Tensor g = random_cuda({n}, rng, 0.5f);
  a.set_grad(clone(g));
  b.set_grad(clone(g));
  const optim::AdamWOptions opt{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
  OffloadOptions oo;
  oo.update = UpdateOn::device;
  oo.chunk_elements = n;
  NoGradGuard no_grad;
  auto plain = optim::make_adamw(optim::decay_groups({{"p", a}}, 0.1), opt);
  plain->step();
  const std::vector<float> want = host_floats(a);
  {  // leaves the host state's pinned blocks in the pinned allocator's cache
    Tensor w = clone(b);
    w.set_grad(clone(g));
    OffloadAdamW warm(optim::decay_groups({{"w", w}}, 0.1), opt, oo);
    warm.step(NormGate{});
  }
  const auto start = test::hold_fills_on_freed_blocks(n, 4, gpu);
  OffloadAdamW off(optim::decay_groups({{"p", b}}, 0.1), opt, oo);
  off.step(NormGate{});
  const double queued_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(queued_ms, 300) << "the step waited for the device: this test cannot see the race";
  EXPECT_EQ(host_floats(b), want);
  const nn::NamedTensors sa = plain->state(), sb = off.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_EQ(host_floats(to_dtype(sa[i].second, DType::f32)), host_floats(to_dtype(sb[i].second, DType::f32)))
        << sa[i].first;
}

// Note [Update behind the forward] on a GPU: the worker held 30 ms before each block, so every
// block's forward reaches its hook before its update; the losses must be those of the update run
// inside the step (to the rounding of the attention backward's atomics), and step() must return
// before the worker reaches block 1.
TEST(OffloadCuda, UpdateBehindForwardTrainsLikeUpdateInsideStep) {
  SKIP_WITHOUT_CUDA();
  auto run = [](const std::string& state, bool overlap) {
    const auto hold = [](int64_t, size_t) { std::this_thread::sleep_for(std::chrono::milliseconds(30)); };
    return strategy_run(Device("cuda"), state, overlap, overlap ? std::function<void(int64_t, size_t)>(hold) : nullptr);
  };
  for (const char* state : {"optimizer", "master"}) {
    SCOPED_TRACE(std::string("--offload-state ") + state);
    const StrategyRun inside = run(state, false), behind = run(state, true);
    ASSERT_EQ(inside.losses.size(), behind.losses.size());
    for (size_t i = 0; i < inside.losses.size(); ++i)
      EXPECT_NEAR(behind.losses[i], inside.losses[i], 1e-4 * std::abs(inside.losses[i])) << "step " << i + 1;
    ASSERT_EQ(behind.at_block1.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_LT(behind.returned[i], behind.at_block1[i]) << "step " << i + 1;
  }
}

TEST(OffloadCuda, TrainsLikePlainRun) {
  SKIP_WITHOUT_CUDA();
  test::TempDir data;
  train::test_util::write_toy_shards(data.path(), 512, 8192, 65536);
  auto options = [&](const std::string& state, const std::string& update) {
    train::TrainOptions o = train::test_util::toy_run(data.path(), "", 512, "bf16");
    o.device = "cuda";
    o.model["n_layer"] = 2;
    o.model["n_head"] = 2;
    o.model["n_embd"] = 128;
    o.model["block_size"] = 64;
    o.batch_size = 8;
    o.seq_len = 64;
    o.steps = 20;
    o.lr = 3e-3;
    o.seed = 7;
    o.offload_state = state;
    o.offload_update = update;
    return o;
  };
  auto losses = [&](const train::TrainOptions& o) {
    std::vector<double> l;
    train::TrainCallbacks cb;
    cb.on_step = [&](const train::StepStats& s) { l.push_back(s.loss); };
    train::Trainer t(o, cb);
    t.run();
    return l;
  };
  const std::vector<double> plain = losses(options("none", "auto"));
  for (const std::string update : {"cpu", "gpu", "master", "master+grads"}) {
    // master: the fp32 parameters on the host too, the device keeping their bf16 copies;
    // master+grads: and their gradients, copied down as the backward makes them.
    const bool masters = update.starts_with("master");
    const std::vector<double> off = losses(options(masters ? update : "optimizer", masters ? "cpu" : update));
    ASSERT_EQ(off.size(), plain.size());
    EXPECT_NEAR(off.back(), plain.back(), 0.02 * plain.back()) << update;
    EXPECT_LT(off.back(), 0.8 * off.front()) << update;
  }
}

}  // namespace
}  // namespace blu::offload
