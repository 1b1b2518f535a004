// Activation policies on the GPU (models/activations.h, memory/host_transfer.h):
//   - the CUDA HostTransfer moves a storage to pinned host memory and back on its side stream, in
//     order with the current stream, even when the source is freed and its block reused right
//     after to_host (record_stream keeps the block until the copy has read it), and a fetch back
//     into a block the current stream has queued work on waits for that work;
//   - a bf16 GPT-2 step (flash attention, dropout on) under every policy — selective, mlp, block,
//     block:2, offload and their combinations — has the plain step's loss bit for bit (the forward
//     is deterministic) and its gradients within the run-to-run noise of the attention backward's
//     atomics, and the device memory after the forward falls by what activation_bytes() predicts.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/memory/cuda_allocator.h"
#include "blu/memory/host_transfer.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/train/trainer.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::kGPU;

TEST(ActivationOffloadCuda, RoundTripThroughPinnedMemoryOnTheSideStream) {
  SKIP_WITHOUT_CUDA();
  Generator g(1);
  const int64_t n = int64_t(1) << 22;  // 16 MiB of f32: copies long enough to overlap
  Tensor src = randn({n}, DType::f32, kGPU, &g);
  const std::vector<double> want = to_vector(src);
  HostTransfer& t = host_transfer(kGPU);
  const int64_t pinned0 = t.host_allocator().stats().current_bytes;
  TransferTicket host = t.to_host(src.storage());
  EXPECT_GE(t.host_allocator().stats().current_bytes - pinned0, n * 4);
  src = Tensor();  // freed while the copy may still read it: its block must wait
  Tensor scribble = full({n}, -7.0, DType::f32, kGPU);  // likely the same block, written right away
  TransferTicket back = t.to_device(host, kGPU);
  t.wait(back);
  const Tensor got(back.storage, {n}, {1}, 0, DType::f32);
  EXPECT_EQ(to_vector(got), want);
  EXPECT_EQ(to_vector(narrow(scribble, 0, 0, 4)), (std::vector<double>{-7, -7, -7, -7}));
}

// A fetch back (to_device) gets a block from the caching allocator, which hands a block freed by
// the current stream back to it at once — though work that stream has queued may still write it.
// The side stream's copy must wait for that work: here a fill queued behind a long GEMM, on a
// block freed right after, would land on the fetched bytes.
TEST(ActivationOffloadCuda, FetchWaitsForWorkQueuedOnTheBlockItReuses) {
  SKIP_WITHOUT_CUDA();
  Generator g(2);
  const int64_t n = int64_t(1) << 22;  // 16 MiB of f32
  Tensor src = randn({n}, DType::f32, kGPU, &g);
  const std::vector<double> want = to_vector(src);  // (waits: the source is final)
  HostTransfer& t = host_transfer(kGPU);
  TransferTicket host = t.to_host(src.storage());
  src = Tensor();
  t.wait(host);
  const Tensor a = randn({8192, 8192}, DType::f32, kGPU, &g);
  const Tensor busy = matmul(a, a);  // milliseconds of the current stream's work
  Tensor victim = full({n}, -7.0, DType::f32, kGPU);  // queued behind it
  victim = Tensor();                                  // its block is free for the current stream now
  TransferTicket back = t.to_device(host, kGPU);      // most likely that block
  t.wait(back);
  const Tensor got(back.storage, {n}, {1}, 0, DType::f32);
  EXPECT_EQ(to_vector(got), want);
  (void)to_vector(narrow(reshape(busy, {busy.numel()}), 0, 0, 1));
}

struct Step {
  double loss = 0;
  std::vector<Tensor> grads;  // on the host, f32
  int64_t after_forward = 0;
};

std::unique_ptr<models::GPT> make_gpt() {
  models::GPTConfig c;
  c.vocab_size = 512, c.padded_vocab_size = 512, c.block_size = 64;
  c.n_layer = 4, c.n_head = 2, c.n_embd = 128;  // head dim 64: the flash-attention kernels
  c.dropout = 0.1;
  auto m = std::make_unique<models::GPT>(c, 3);
  m->to(kGPU);
  m->train();
  train::apply_precision(*m, "bf16");
  return m;
}

Step run_step(models::GPT& m, const Tensor& idx, const Tensor& targets) {
  for (auto& [name, p] : m.named_parameters()) p.zero_grad();
  Allocator& dev = allocator_for(kGPU);
  const int64_t base = dev.stats().current_bytes;
  Step s;
  Tensor loss = m.forward(idx, targets).loss;
  s.after_forward = dev.stats().current_bytes - base;
  loss.backward();
  s.loss = to_device(loss, kCPU).item() /* host read */;
  for (auto& [name, p] : m.named_parameters()) s.grads.push_back(to_device(to_dtype(p.grad(), DType::f32), kCPU));
  return s;
}

double rel_diff(const Tensor& a, const Tensor& b) {
  const double num = std::sqrt(sum(mul(a - b, a - b)).item()), den = std::sqrt(sum(mul(b, b)).item());
  return num / (den + 1e-30);
}

TEST(ActivationPolicyCuda, Bf16Gpt2StepUnderEveryPolicyMatchesThePlainStep) {
  SKIP_WITHOUT_CUDA();
  const int64_t B = 4, T = 64;
  Generator g(9);
  const Tensor idx = to_device(randint(0, 512, {B, T}, DType::i64, kCPU, &g), kGPU);
  const Tensor targets = to_device(randint(0, 512, {B, T}, DType::i64, kCPU, &g), kGPU);
  auto model = make_gpt();
  run_step(*model, idx, targets);  // warm: compute copies, allocator blocks
  // The same dropout masks each run: the model's generator is put back before every step.
  auto* gen = model->generators().at(0);
  const uint64_t seed = gen->seed(), offset = gen->offset();
  const Step plain = run_step(*model, idx, targets);
  int64_t plain_kept = 0;
  for (const auto& a : models::activation_bytes(*model, B, T, {})) plain_kept += a.kept;
  for (bool offload : {false, true}) {
    for (const char* name : {"none", "selective", "mlp", "mlp:2", "mlp-first:1", "selective+mlp", "block", "block:2",
                             "selective+block:2", "block-first:1"}) {
      if (std::string(name) == "none" && !offload) continue;
      const models::ActivationPolicy p = models::ActivationPolicy::parse(name, offload);
      SCOPED_TRACE(std::string(name) + (offload ? " --offload-activations" : ""));
      int64_t kept = 0;
      for (const auto& a : models::activation_bytes(*model, B, T, p)) kept += a.kept;
      model->set_activation_policy(p);
      gen->set_state(seed, offset);
      const Step s = run_step(*model, idx, targets);
      model->set_activation_policy({});
      EXPECT_EQ(s.loss, plain.loss);
      ASSERT_EQ(s.grads.size(), plain.grads.size());
      for (size_t i = 0; i < s.grads.size(); ++i) EXPECT_LT(rel_diff(s.grads[i], plain.grads[i]), 2e-2) << "gradient " << i;
      const double predicted = double(plain_kept - kept), measured = double(plain.after_forward - s.after_forward);
      EXPECT_NEAR(measured, predicted, 0.02 * double(plain_kept)) << "device bytes after the forward";
      std::cout << "[ memory ] " << name << (offload ? " +offload" : "") << ": after forward " << s.after_forward
                << " B (plain " << plain.after_forward << "), predicted drop " << predicted << " B\n";
    }
  }
}

}  // namespace
}  // namespace blu
