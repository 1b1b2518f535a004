// GPU tests for the many-tensor AdamW kernel and the compute copies it writes: the CUDA
// "adamw_step" equals the CPU kernel bit for bit on random data (more tensors than one launch's
// table holds, sizes that are not multiples of 4, views at offsets that break 16-byte alignment,
// a transposed view, compute copies none/bf16/f16, moments f32 and bf16 — their stochastic
// rounding too); and on a small bf16 GPT on the GPU, every
// compute copy equals to_dtype(param) after each AdamW step, an SGD step leaves them to be
// re-cast, and the forward gives the same logits with copies on and off. And copy_many_ (the
// shard ↔ parameter copies of dist/zero): 230 pairs (three launches' tables), sizes from 1
// element to several 64 KiB blocks, f32 and bf16, offsets that break 16- and 4-byte alignment —
// every destination equals its source bit for bit, the bytes around them stay untouched.
// Every test skips when no CUDA device is present. Run: build-cuda/tests/test_cuda
// --gtest_filter='CudaAdamWMulti.*:CudaComputeCopy.*:CudaCopyMany.*'
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/tiny_gpt.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"
#include "cuda/close_check.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::bit_equal;
using test::buffer;
using test::dev;
using test::host;
using test::kGPU;
using test::Layout;
using test::Pair;
using test::pair;

TEST(CudaAdamWMulti, MatchesCpuBitwise) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  const std::vector<Shape> sizes = {{1},       {3},    {5},         {7, 1}, {4095}, {4097}, {12345},
                                    {70001},   {33},   {2 * 4096 + 1}, {4096}, {17, 33}, {2, 3, 5}};
  constexpr int kTensors = 75;  // more than one launch's table (64)
  for (DType state : {DType::f32, DType::bf16})  // the moments' dtype (bf16: stochastic rounding)
  for (DType copy_dtype : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE("moments " + std::string(dtype_name(state)) + ", copies " + std::string(dtype_name(copy_dtype)));
    const bool copies = copy_dtype != DType::f32;
    Generator gen(100 + int(copy_dtype) + 10 * int(state));
    std::vector<Pair> p, m, v, c;
    std::vector<Layout> grad_layout;
    for (int i = 0; i < kTensors; ++i) {
      const Shape& s = sizes[size_t(i) % sizes.size()];
      // Offsets that break alignment: parameter (4 bytes), moments, gradient and copy (2 bytes).
      Layout lp{s, i % 5 == 1 ? 1 : 0, i == 11 && s.size() == 2};
      Layout lm{s, i % 7 == 2 ? 2 : 0}, lv{s, i % 7 == 3 ? 3 : 0}, lg{s, i % 6 == 4 ? 1 : 0};
      Layout lc{s, i % 3 == 0 ? 1 : 0, i == 24 && s.size() == 2};
      p.push_back(pair(buffer(lp, DType::f32, 1.0, false, gen), lp));
      m.push_back(pair(buffer(lm, state, 0.1, false, gen), lm));
      v.push_back(pair(buffer(lv, state, 0.01, true, gen), lv));
      if (copies) c.push_back(pair(zeros({lc.offset + numel(s)}, copy_dtype), lc));
      grad_layout.push_back(lg);
    }
    ASSERT_FALSE(p[11].h.is_contiguous());  // the strided path is covered
    for (int64_t step = 1; step <= 3; ++step) {
      for (int k = 0; k < 2; ++k) {  // two weight decays: even and odd tensors
        std::vector<AdamWTensors> th, td;
        for (int i = k; i < kTensors; i += 2) {
          const Pair g = pair(buffer(grad_layout[size_t(i)], DType::f32, 1.0, false, gen), grad_layout[size_t(i)]);
          th.push_back({p[i].h, g.h, m[i].h, v[i].h, copies ? c[i].h : Tensor()});
          td.push_back({p[i].d, g.d, m[i].d, v[i].d, copies ? c[i].d : Tensor()});
        }
        const AdamWStepArgs a{.lr = 6e-4 * double(step), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                              .weight_decay = k == 0 ? 0.1 : 0.0, .step = step};
        adamw_step_(th, a);
        adamw_step_(td, a);
      }
      for (int i = 0; i < kTensors; ++i) {
        const std::string at = " of tensor " + std::to_string(i) + " after step " + std::to_string(step);
        EXPECT_TRUE(bit_equal("param" + at, p[i].d, p[i].h));
        EXPECT_TRUE(bit_equal("exp_avg" + at, m[i].d, m[i].h));
        EXPECT_TRUE(bit_equal("exp_avg_sq" + at, v[i].d, v[i].h));
        if (!copies) continue;
        EXPECT_TRUE(bit_equal("copy" + at, c[i].d, c[i].h));
        EXPECT_TRUE(bit_equal("copy vs cast" + at, c[i].d, to_dtype(p[i].h, copy_dtype)));
        EXPECT_TRUE(bit_equal("device copy vs device cast" + at, c[i].d, host(to_dtype(p[i].d, copy_dtype))));
      }
    }
  }
}

struct GptRun {
  std::unique_ptr<models::GPT> model;
  std::unique_ptr<optim::Optimizer> opt;
};
GptRun tiny_gpt(bool adamw) {
  GptRun r;
  models::GPTConfig cfg = ::blu::test::tiny_gpt();
  cfg.n_embd = 128;  // head dim 64: the flash-attention path GPT-2 takes
  cfg.n_head = 2;
  r.model = std::make_unique<models::GPT>(cfg, 3);
  r.model->to(kGPU);
  r.model->set_compute_dtype(DType::bf16);
  auto groups = optim::decay_groups(r.model->named_parameters(), 0.1);
  r.opt = adamw ? optim::make_adamw(groups, {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8})
                : optim::make_sgd(groups, {.lr = 3e-2, .momentum = 0.9});
  r.opt->attach_compute_copies(r.model->compute_copies());
  return r;
}

TEST(CudaComputeCopy, GptCopiesEqualTheCastAfterEveryStep) {
  SKIP_WITHOUT_CUDA();
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    GptRun r = tiny_gpt(adamw);
    Generator data(5);
    for (int step = 0; step < 3; ++step) {
      const Tensor idx = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
      const Tensor tgt = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
      r.opt->zero_grad();
      r.model->forward(idx, tgt).loss.backward();
      r.opt->step();
      int copies = 0;
      for (const auto& [p, c] : r.model->compute_copies()) {
        if (!c->tensor().defined()) continue;  // wpe is read in fp32
        ++copies;
        EXPECT_EQ(c->current(p), adamw);  // AdamW wrote it; SGD's update made it stale
        if (adamw) {
          EXPECT_TRUE(
              bit_equal("copy after step " + std::to_string(step), c->tensor(), host(to_dtype(p, DType::bf16))));
        }
      }
      EXPECT_EQ(copies, 27);  // every weight but wpe's
    }
    // Logits with the (written or re-cast) copies equal those of plain casts.
    NoGradGuard ng;
    const Tensor idx = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
    const Tensor on = r.model->forward(idx).logits;
    for (const auto& [p, c] : r.model->compute_copies()) {
      if (c->tensor().defined()) {
        EXPECT_TRUE(bit_equal("copy after the forward", c->tensor(), host(to_dtype(p, DType::bf16))));
      }
    }
    r.model->set_compute_copies(false);
    EXPECT_TRUE(bit_equal("logits with copies vs casts", on, host(r.model->forward(idx).logits)));
  }
}

TEST(CudaCopyMany, EveryPairBitExactWhateverItsSizeAndAlignment) {
  SKIP_WITHOUT_CUDA();
  Generator gen(11);
  for (const DType dt : {DType::f32, DType::bf16}) {
    const int64_t total = 2'000'000;
    const Tensor src_h = randn({total}, dt, kCPU, &gen);
    const Tensor src = dev(src_h), dst = dev(zeros({total}, dt));
    std::vector<Tensor> to, from;
    std::vector<std::pair<int64_t, int64_t>> spans;  // (dst offset, length)
    int64_t at = 1;                                   // odd: the first pair is misaligned
    for (int i = 0; i < 230; ++i) {
      const int64_t n = i % 7 == 0 ? 20'000 + 97 * i : 1 + (i * 37) % 300;  // 20K f32: > one 64 KiB block
      const int64_t from_at = (int64_t(i) * 7919) % (total - n);
      to.push_back(narrow(dst, 0, at, n));
      from.push_back(narrow(src, 0, from_at, n));
      spans.push_back({at, n});
      at += n + 1 + i % 3;  // gaps stay zero
    }
    ASSERT_LT(at, total);
    {
      NoGradGuard no_grad;
      copy_many_(to, from);
    }
    const Tensor got = host(dst);
    Tensor want = zeros({total}, dt);
    for (size_t i = 0; i < to.size(); ++i)
      copy_(narrow(want, 0, spans[i].first, spans[i].second), host(from[i]));
    EXPECT_TRUE(bit_equal(std::string("copy_many ") + std::string(dtype_name(dt)), got, want));
  }
}

}  // namespace
}  // namespace blu
