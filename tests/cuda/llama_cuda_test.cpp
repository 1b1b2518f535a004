// Llama on the GPU against the CPU reference (which tests/models checks against PyTorch): one model,
// copied, the same batch. The shape takes the fused paths — head dim 64 (flash attention with
// grouped-query attention: 6 heads over 2 key/value heads), RMSNorm, RoPE with Llama 3 scaling
// and SwiGLU kernels — and keeps the odd parts of the CPU oracle test: 3 query heads per group, a
// vocabulary of 1001, an untied head.
//  - fp32 (IEEE matmuls; flash attention as 3xTF32, ~1e-6): logits, loss and every parameter
//    gradient within 1e-4 relative in norm (‖got−ref‖ ≤ 1e-4·‖ref‖ per tensor).
//  - bf16 compute over fp32 master weights: loss within 1e-2 relative, gradients within 5e-2 in
//    norm (8 significant bits, rounding 2^-9 per op, a few dozen roundings in quadrature through
//    two layers, as the GPT-2 bf16 test argues).
//  - the cached forward on the GPU gives the uncached logits (1e-4 in norm) and generation the
//    same tokens as on the CPU.
#include <gtest/gtest.h>

#include <cmath>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/models/llama/llama.h"
#include "blu/ops/precision.h"
#include "cuda/cuda_test_util.h"

namespace blu::test {
namespace {

double rel_norm_error(const Tensor& got, const Tensor& ref) {
  const auto a = to_vector(got), b = to_vector(ref);
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return a.size() == b.size() ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
}

models::LlamaConfig gpu_config() {
  models::LlamaConfig c;
  c.hidden_size = 384, c.num_hidden_layers = 2, c.num_attention_heads = 6, c.num_key_value_heads = 2;
  c.intermediate_size = 1000, c.vocab_size = 1001, c.max_position_embeddings = 512;
  c.rope_theta = 500000.0, c.tie_word_embeddings = false;
  c.rope_scaling = models::LlamaRopeScaling{.factor = 8.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                                            .original_max_position_embeddings = 64};
  return c;
}

// Two copies of one model (CPU and GPU), with norms away from one so their weights matter.
struct Pair {
  models::Llama cpu{gpu_config(), 21}, gpu{gpu_config(), 22};
  Pair() {
    NoGradGuard ng;
    Generator g(5);
    for (auto& [name, p] : cpu.named_parameters())
      if (p.dim() == 1) copy_(p, add(mul(randn(p.shape(), DType::f32, kCPU, &g), 0.2), 1.0));
    gpu.load_state_dict(cpu.state_dict());
    gpu.to(kGPU);
  }
};

void check_gpu_against_cpu(bool bf16, double loss_tol, double grad_tol) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  set_matmul_precision("ieee");
  Pair m;
  Generator g(9);
  const Tensor idx = randint(0, 1001, {2, 256}, DType::i64, kCPU, &g);
  const Tensor tgt = randint(0, 1001, {2, 256}, DType::i64, kCPU, &g);
  auto ref = m.cpu.forward(idx, tgt);
  ref.loss.backward();
  if (bf16) m.gpu.set_compute_dtype(DType::bf16);
  auto out = m.gpu.forward(to_device(idx, kGPU), to_device(tgt, kGPU));
  out.loss.backward();
  const double loss = to_vector(to_dtype(out.loss, DType::f32))[0], ref_loss = ref.loss.item();
  std::printf("%s: loss %.7f vs CPU %.7f\n", bf16 ? "bf16" : "fp32", loss, ref_loss);
  EXPECT_LE(std::abs(loss - ref_loss), loss_tol * std::abs(ref_loss)) << "loss";
  EXPECT_LE(rel_norm_error(to_dtype(out.logits.detach(), DType::f32), ref.logits.detach()), grad_tol) << "logits";
  const auto cpu_params = m.cpu.named_parameters();
  const auto gpu_params = m.gpu.named_parameters();
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    ASSERT_TRUE(gpu_params[i].second.grad().defined()) << gpu_params[i].first;
    EXPECT_LE(rel_norm_error(gpu_params[i].second.grad(), cpu_params[i].second.grad()), grad_tol)
        << "gradient of " << gpu_params[i].first;
  }
}

TEST(LlamaCuda, Fp32MatchesTheCpu) { check_gpu_against_cpu(false, 1e-5, 1e-4); }
TEST(LlamaCuda, Bf16WithinStatedTolerances) { check_gpu_against_cpu(true, 1e-2, 5e-2); }

TEST(LlamaCuda, CachedForwardAndGenerationMatch) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  set_matmul_precision("ieee");
  Pair m;
  Generator g(3);
  const Tensor idx = to_device(randint(0, 1001, {2, 40}, DType::i64, kCPU, &g), kGPU);
  NoGradGuard ng;
  const Tensor full = m.gpu.forward(idx).logits;
  models::KVCache cache;
  std::vector<Tensor> parts = {m.gpu.forward_cached(narrow(idx, 1, 0, 30), cache)};
  for (int64_t t = 30; t < 40; ++t) parts.push_back(m.gpu.forward_cached(narrow(idx, 1, t, 1), cache));
  EXPECT_LE(rel_norm_error(cat(parts, 1), full), 1e-4);
  Generator a(1), b(1);
  const std::vector<int32_t> prompt = {1, 2, 3, 500, 1000};
  EXPECT_EQ(m.gpu.generate(prompt, 16, 0.0, 0, a), m.cpu.generate(prompt, 16, 0.0, 0, b));
}

}  // namespace
}  // namespace blu::test
