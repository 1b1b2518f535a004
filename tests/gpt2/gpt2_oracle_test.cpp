// GPT-2 against PyTorch, in the manner of llm.c's test_gpt2: a small GPT-2 (2 layers, 3 heads —
// an odd head count — 48 channels, block 16, vocabulary 101 padded to 128) with random init is
// exported through export_hf_gpt2; tests/gpt2/torch_gpt2.py loads that file into a nanoGPT-style
// PyTorch model (so the export is also checked to load in PyTorch), runs the same batch and
// returns logits, loss and every parameter gradient, which must match at fp32 tolerance. Then ten
// AdamW steps (GPT grouping: weight decay 0.1 on matrices, none on vectors; lr 1e-3) on the same
// batch: the loss before each step and the parameters after the last must match PyTorch's.
#include <gtest/gtest.h>

#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/hf.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/optim/optimizer.h"
#include "common/opinfo.h"
#include "common/torch_oracle.h"

namespace blu::test {
namespace {

constexpr double kAtol = 1e-5, kRtol = 1e-4;

struct Gpt2Case {
  models::GPTConfig cfg = ::blu::test::tiny_gpt();  // n_layer 2, n_head 3, n_embd 48, T 16, V 101→128
  models::GPT model{cfg, 1234};
  Tensor idx, targets;
  Gpt2Case() {
    Generator g(77);
    idx = randint(0, cfg.vocab_size, {2, cfg.block_size}, DType::i64, kCPU, &g);
    targets = randint(0, cfg.vocab_size, {2, cfg.block_size}, DType::i64, kCPU, &g);
    // GPT-2's init keeps activations tiny (c_fc inputs ~0.1), where gelu's tanh and erf forms
    // agree to 1e-6: widen every parameter (biases and LayerNorm affine too) so the comparison
    // can tell such differences apart.
    NoGradGuard ng;
    for (auto& [name, p] : model.named_parameters()) {
      Tensor r = randn(p.shape(), DType::f32, kCPU, &g);
      const bool ln_weight = name.find("ln_") != std::string::npos && name.ends_with(".weight");
      copy_(p, ln_weight ? add(mul(r, 0.2), 1.0) : mul(r, p.dim() >= 2 ? 0.15 : 0.1));
    }
    fill_(narrow(model.wte->weight, 0, cfg.vocab_size, cfg.padded_vocab_size - cfg.vocab_size), 0.0);
  }
  nlohmann::json manifest(const TorchOracle& o) const {
    return {{"weights", o.dir() + "/weights.safetensors"},
            {"config",
             {{"n_layer", cfg.n_layer},
              {"n_head", cfg.n_head},
              {"n_embd", cfg.n_embd},
              {"block_size", cfg.block_size},
              {"vocab_size", cfg.vocab_size}}}};
  }
};

// Our tensor in the layout PyTorch reports it: wte without its padded rows.
Tensor unpadded(const std::string& name, const Tensor& t, const models::GPTConfig& cfg) {
  return name == "wte.weight" ? narrow(t, 0, 0, cfg.vocab_size) : t;
}

TEST(Gpt2Oracle, LogitsLossAndGradientsMatchPyTorch) {
  Gpt2Case s;
  TorchOracle oracle;
  models::export_hf_gpt2(s.model, oracle.dir() + "/weights.safetensors");
  oracle.put("idx", s.idx);
  oracle.put("targets", s.targets);
  auto want = oracle.run("gpt2/torch_gpt2.py", s.manifest(oracle));

  auto out = s.model.forward(s.idx, s.targets);
  out.loss.backward();
  EXPECT_EQ(compare(narrow(out.logits.detach(), -1, 0, s.cfg.vocab_size), want.get("logits"), kAtol, kRtol), "")
      << "logits";
  EXPECT_EQ(compare(out.loss.detach(), want.get("loss"), kAtol, kRtol), "") << "loss";
  for (auto& [name, p] : s.model.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << "no gradient for " << name;
    EXPECT_EQ(compare(unpadded(name, p.grad(), s.cfg), want.get("grad." + name), kAtol, kRtol), "")
        << "gradient of " << name;
  }
}

TEST(Gpt2Oracle, TenAdamWStepsMatchPyTorch) {
  constexpr int kSteps = 10;
  Gpt2Case s;
  TorchOracle oracle;
  models::export_hf_gpt2(s.model, oracle.dir() + "/weights.safetensors");
  oracle.put("idx", s.idx);
  oracle.put("targets", s.targets);
  nlohmann::json manifest = s.manifest(oracle);
  manifest["adamw"] = {{"steps", kSteps}, {"lr", 1e-3}, {"weight_decay", 0.1}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}};
  auto want = oracle.run("gpt2/torch_gpt2.py", manifest);

  auto opt = optim::make_adamw(optim::decay_groups(s.model.named_parameters(), 0.1), optim::AdamWOptions{.lr = 1e-3});
  const std::vector<double> torch_losses = to_vector(want.get("losses"));
  ASSERT_EQ(torch_losses.size(), size_t(kSteps));
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    Tensor loss = s.model.forward(s.idx, s.targets).loss;
    loss.backward();
    EXPECT_NEAR(loss.item(), torch_losses[size_t(step)], 1e-5 * std::abs(torch_losses[size_t(step)]))
        << "loss before step " << step;
    opt->step();
  }
  EXPECT_LT(torch_losses.back(), torch_losses.front()) << "the run should learn the batch";
  // The key third of c_attn.bias has an exactly zero gradient in exact arithmetic (adding a
  // constant to every key shifts each query's scores by one constant, which softmax ignores), so
  // both libraries feed rounding noise (~1e-9) to Adam, whose normalised step turns it into
  // updates of up to lr each. That slice can only be held to Adam's step bound; the rest is exact.
  const int64_t C = s.cfg.n_embd;
  for (auto& [name, p] : s.model.named_parameters()) {
    Tensor got = unpadded(name, p.detach(), s.cfg), ref = want.get("param." + name);
    if (name.ends_with(".attn.c_attn.bias")) {
      for (int64_t part : {0, 2})
        EXPECT_EQ(compare(narrow(got, 0, part * C, C), narrow(ref, 0, part * C, C), kAtol, kRtol), "")
            << "parameter " << name << " [" << part * C << ", " << (part + 1) * C << ") after " << kSteps << " steps";
      EXPECT_EQ(compare(narrow(got, 0, C, C), narrow(ref, 0, C, C), kSteps * 1e-3, 0.0), "")
          << "key bias of " << name << " beyond Adam's step bound";
      continue;
    }
    EXPECT_EQ(compare(got, ref, kAtol, kRtol), "") << "parameter " << name << " after " << kSteps << " steps";
  }
  EXPECT_EQ(to_vector(narrow(s.model.wte->weight, 0, s.cfg.vocab_size, s.cfg.padded_vocab_size - s.cfg.vocab_size)),
            std::vector<double>(size_t((s.cfg.padded_vocab_size - s.cfg.vocab_size) * s.cfg.n_embd), 0.0))
      << "padded wte rows stay zero under AdamW";
}

}  // namespace
}  // namespace blu::test
