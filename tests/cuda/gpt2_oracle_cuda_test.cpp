// GPT-2 124M (d12) on the GPU against the PyTorch reference on the same GPU, in the manner of
// tests/gpt2: the same weights (exported through export_hf_gpt2) and the same batch; PyTorch runs
// tests/gpt2/torch_gpt2.py on CUDA in IEEE fp32 (TF32 off). Needs `python3` with CUDA PyTorch
// (BLU_TORCH_PYTHON) and BLU_TEST_DIR pointing at tests/ when run away from the source tree.
//  - fp32: logits, loss and every parameter gradient within 1e-4 relative (in norm: ‖got−ref‖ ≤
//    1e-4·‖ref‖ per tensor), and ten AdamW steps with the same losses (1e-5 relative).
//  - bf16 (our 16-bit compute over fp32 master weights vs the fp32 reference): loss within 1e-2
//    relative and gradients within 5e-2 in norm. Justification: bf16 keeps 8 significant bits
//    (rounding error 2^-9 ≈ 2e-3 per operation); a 12-layer forward and backward chains a few
//    dozen roundings whose errors add in quadrature, which puts typical relative errors near 1e-2
//    for activations and a few 1e-2 for gradients summed over 16k tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/models/gpt2/hf.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/ops/precision.h"
#include "blu/optim/optimizer.h"
#include "common/torch_oracle.h"
#include "cuda/cuda_test_util.h"

namespace blu::test {
namespace {

// ‖got − ref‖ / ‖ref‖ over all elements (both moved to the host in f64).
double rel_norm_error(const Tensor& got, const Tensor& ref) {
  const auto a = to_vector(got), b = to_vector(ref);
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return a.size() == b.size() ? std::sqrt(num / std::max(den, 1e-300)) : INFINITY;
}

struct Case {
  models::GPTConfig cfg = models::GPTConfig::preset("d12");
  std::unique_ptr<models::GPT> model;
  Tensor idx, targets;
  TorchOracle oracle;
  nlohmann::json manifest;
  explicit Case(int64_t B, int64_t T) {
    model = std::make_unique<models::GPT>(cfg, 42);
    Generator g(7);
    idx = randint(0, cfg.vocab_size, {B, T}, DType::i64, kCPU, &g);
    targets = randint(0, cfg.vocab_size, {B, T}, DType::i64, kCPU, &g);
    models::export_hf_gpt2(*model, oracle.dir() + "/weights.safetensors");
    oracle.put("idx", idx);
    oracle.put("targets", targets);
    manifest = {{"weights", oracle.dir() + "/weights.safetensors"},
                {"device", "cuda"},
                {"config",
                 {{"n_layer", cfg.n_layer},
                  {"n_head", cfg.n_head},
                  {"n_embd", cfg.n_embd},
                  {"block_size", cfg.block_size},
                  {"vocab_size", cfg.vocab_size}}}};
    model->to(kGPU);
    idx = to_device(idx, kGPU);
    targets = to_device(targets, kGPU);
  }
};

Tensor unpadded(const std::string& name, const Tensor& t, const models::GPTConfig& cfg) {
  return name == "wte.weight" ? narrow(t, 0, 0, cfg.vocab_size) : t;
}

void check_against_torch(bool bf16, double loss_tol, double grad_tol) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  set_matmul_precision("ieee");
  Case s(4, 1024);
  nlohmann::json manifest = s.manifest;
  if (!bf16) manifest["adamw"] = {{"steps", 10}, {"lr", 1e-4}, {"weight_decay", 0.1}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}};
  auto want = s.oracle.run("gpt2/torch_gpt2.py", manifest);
  if (bf16) s.model->set_compute_dtype(DType::bf16);

  auto out = s.model->forward(s.idx, s.targets);
  out.loss.backward();
  const double loss = to_vector(to_dtype(out.loss, DType::f32))[0], ref_loss = to_vector(want.get("loss"))[0];
  std::printf("%s: loss %.7f vs PyTorch %.7f\n", bf16 ? "bf16" : "fp32", loss, ref_loss);
  EXPECT_LE(std::abs(loss - ref_loss), loss_tol * std::abs(ref_loss)) << "loss";
  const Tensor logits = to_dtype(narrow(out.logits.detach(), -1, 0, s.cfg.vocab_size), DType::f32);
  const double e_logits = rel_norm_error(logits, want.get("logits"));
  EXPECT_LE(e_logits, grad_tol) << "logits";
  double worst = 0;
  std::string worst_name;
  for (auto& [name, p] : s.model->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    const double e = rel_norm_error(unpadded(name, p.grad(), s.cfg), want.get("grad." + name));
    EXPECT_LE(e, grad_tol) << "gradient of " << name;
    if (e > worst) worst = e, worst_name = name;
  }
  std::printf("%s: logits rel error %.3g; worst gradient rel error %.3g (%s)\n", bf16 ? "bf16" : "fp32", e_logits,
              worst, worst_name.c_str());
  if (bf16) return;

  // Ten AdamW steps from here (PyTorch's step 0 reuses the gradients above, as we do).
  auto opt = optim::make_adamw(optim::decay_groups(s.model->named_parameters(), 0.1), optim::AdamWOptions{.lr = 1e-4});
  const std::vector<double> torch_losses = to_vector(want.get("losses"));
  ASSERT_EQ(torch_losses.size(), 10u);
  for (int step = 0; step < 10; ++step) {
    if (step > 0) {
      opt->zero_grad();
      out = s.model->forward(s.idx, s.targets);
      out.loss.backward();
    }
    const double l = to_vector(out.loss.detach())[0];
    std::printf("step %d: loss %.7f vs PyTorch %.7f\n", step, l, torch_losses[size_t(step)]);
    EXPECT_LE(std::abs(l - torch_losses[size_t(step)]), 1e-5 * std::abs(torch_losses[size_t(step)]))
        << "loss before step " << step;
    opt->step();
  }
}

TEST(Gpt2OracleCuda, D12Fp32LogitsLossGradientsAndTenAdamWSteps) { check_against_torch(false, 1e-5, 1e-4); }
TEST(Gpt2OracleCuda, D12Bf16WithinStatedTolerances) { check_against_torch(true, 1e-2, 5e-2); }

}  // namespace
}  // namespace blu::test
