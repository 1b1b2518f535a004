// GPU tests of the head's loss in row pieces (ops/fused.h, Note [Chunked loss]):
// - linear_cross_entropy in f32 and bf16 against a float64 CPU reference of the whole logits on
//   the same (rounded) inputs, with an incoming gradient that is not 1: the pieces' loss and
//   gradients are as close to it as the whole-logits ops on the GPU are (their cuBLASLt fp32-
//   accumulating w-gradient GEMM runs with beta = 1 from the second piece on);
// - a bf16 GPT-2 step (fp32 master weights, so w's gradient goes the wide fp32 way) in pieces
//   matches the whole-logits step, with a lower peak.
// Every test skips when no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/train/trainer.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::kGPU;

Tensor on_host_f64(const Tensor& t) {
  Tensor h = to_device(t, kCPU);
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  return to_dtype(h, DType::f64);
}

// |a − b| / |b| in the 2-norm.
double rel(const Tensor& a, const Tensor& b) {
  const Tensor d = sub(a, b);
  return std::sqrt(sum(mul(d, d)).item()) / (std::sqrt(sum(mul(b, b)).item()) + 1e-300);
}

struct Result {
  Tensor loss, gx, gw;  // f64 on the host
};

Result run(const Tensor& x0, const Tensor& w0, const Tensor& t, int64_t classes, int64_t chunks, Device d) {
  Tensor x = to_device(x0, d).set_requires_grad(true), w = to_device(w0, d).set_requires_grad(true);
  const Tensor td = to_device(t, d);
  const Tensor loss = chunks > 0 ? linear_cross_entropy(x, w, td, -1, classes, chunks)
                                 : cross_entropy(linear(x, w), td, -1, Reduction::mean, classes);
  mul(loss, 0.37).backward();
  return {on_host_f64(loss), on_host_f64(x.grad()), on_host_f64(w.grad())};
}

void check_against_f64(DType dt, double tol) {
  SKIP_WITHOUT_CUDA();
  Generator g(21);
  const int64_t N = 1000, C = 256, Vp = 2048, K = 2000;
  const Tensor x0 = to_dtype(randn({N, C}, DType::f32, kCPU, &g), dt);
  const Tensor w0 = to_dtype(mul(randn({Vp, C}, DType::f32, kCPU, &g), 0.2), dt);
  std::vector<double> ids = to_vector(randint(0, K, {N}, DType::i64, kCPU, &g));
  for (int64_t i = 0; i < N; i += 97) ids[size_t(i)] = -1;  // ignored rows
  const Tensor t = from_vector(ids, {N}, DType::i64);
  const Result ref = run(to_dtype(x0, DType::f64), to_dtype(w0, DType::f64), t, K, 0, kCPU);
  const Result whole = run(x0, w0, t, K, 0, kGPU);
  for (int64_t chunks : {1, 3, 8}) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + ", " + std::to_string(chunks) + " pieces");
    const Result p = run(x0, w0, t, K, chunks, kGPU);
    const double e_loss = rel(p.loss, ref.loss), e_gx = rel(p.gx, ref.gx), e_gw = rel(p.gw, ref.gw);
    const double w_loss = rel(whole.loss, ref.loss), w_gx = rel(whole.gx, ref.gx), w_gw = rel(whole.gw, ref.gw);
    std::cout << dtype_name(dt) << " " << chunks << " pieces: loss " << e_loss << " (whole " << w_loss << "), gx "
              << e_gx << " (" << w_gx << "), gw " << e_gw << " (" << w_gw << ")\n";
    EXPECT_LE(e_loss, tol);
    EXPECT_LE(e_gx, 1.5 * w_gx + tol);
    EXPECT_LE(e_gw, 1.5 * w_gw + tol);
  }
}

TEST(ChunkedLossCuda, F32MatchesAnF64ReferenceAsTheWholeLogitsDo) { check_against_f64(DType::f32, 1e-6); }
TEST(ChunkedLossCuda, Bf16MatchesAnF64ReferenceAsTheWholeLogitsDo) { check_against_f64(DType::bf16, 1e-3); }

struct Step {
  double loss = 0;
  std::vector<Tensor> grads;  // f64 on the host
  int64_t peak = 0;
};

Step gpt_step(int64_t chunks) {
  models::GPTConfig c;
  c.vocab_size = 8000, c.padded_vocab_size = 8064, c.block_size = 128;
  c.n_layer = 2, c.n_head = 2, c.n_embd = 128;
  models::GPT m(c, 5);
  m.to(kGPU);
  m.train();
  train::apply_precision(m, "bf16");
  m.set_loss_chunks(chunks);
  Generator g(3);
  const Tensor idx = to_device(randint(0, c.vocab_size, {16, 128}, DType::i64, kCPU, &g), kGPU);
  const Tensor tg = to_device(randint(0, c.vocab_size, {16, 128}, DType::i64, kCPU, &g), kGPU);
  Allocator& dev = allocator_for(kGPU);
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t base = dev.stats().current_bytes;
  dev.reset_peak();
  Tensor loss = m.forward(idx, tg).loss;
  loss.backward();
  Step s;
  s.peak = dev.stats().peak_bytes - base;
  s.loss = on_host_f64(loss).item();
  for (auto& [name, p] : m.named_parameters()) s.grads.push_back(on_host_f64(p.grad()));
  return s;
}

TEST(ChunkedLossCuda, Bf16Gpt2StepInPiecesMatchesTheWholeLogitsWithALowerPeak) {
  SKIP_WITHOUT_CUDA();
  const Step whole = gpt_step(0), pieces = gpt_step(4);
  EXPECT_NEAR(pieces.loss, whole.loss, 1e-4 * whole.loss);
  ASSERT_EQ(pieces.grads.size(), whole.grads.size());
  for (size_t i = 0; i < whole.grads.size(); ++i) EXPECT_LE(rel(pieces.grads[i], whole.grads[i]), 2e-2) << "gradient " << i;
  const int64_t logits = int64_t(16 * 128) * 8064 * 2;  // bf16
  std::cout << "step peak " << whole.peak << " B whole (logits " << logits << " B), " << pieces.peak << " B in 4 pieces\n";
  EXPECT_LT(pieces.peak, whole.peak - logits / 2);
}

}  // namespace
}  // namespace blu
