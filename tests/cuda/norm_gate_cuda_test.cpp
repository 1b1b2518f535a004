// GPU tests for the norm gate (Note [Norm gate], ops/optim.h): the CUDA "adamw_step" and
// "sgd_step" given a gate equal the CPU kernels given the same gate bit for bit — clipping active
// (the gate's total f32 as CUDA's sum_squares gives it, or f64 as ZeRO's all-reduce does),
// clipping inactive, and a NaN or infinite total that leaves every tensor untouched — over more
// tensors than one launch's table, float4 and element-wise paths, a transposed view (the strided
// kernel) and compute copies none/bf16/f16. On the device alone: a bf16 GPT trained with
// grad_norm_gate + step(gate) equals clip_grad_norm + step() bit for bit (AdamW writing compute
// copies, and SGD), a NaN gradient leaves parameters, state and copies as they were, and the gated
// step makes no host read where clip_grad_norm makes one.
// Every test skips when no CUDA device is present. Run: build-cuda/tests/test_cuda
// --gtest_filter='CudaNormGate.*'
#include <gtest/gtest.h>

#include <cmath>
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

// A gate's total, on the host and on the device (the same bits), and what the gate should do.
struct GateCase {
  const char* name;
  double total;
  DType dtype;
  double max_norm;
  bool changes;  // false: the update is skipped
};
const GateCase kGates[] = {
    {"clip, f32 total", 37.25, DType::f32, 1.0, true},   {"clip, f64 total", 37.25, DType::f64, 0.3, true},
    {"no clip", 0.25, DType::f32, 1.0, true},            {"no max_norm", 1e6, DType::f64, INFINITY, true},
    {"NaN total", NAN, DType::f32, 1.0, false},          {"infinite total", INFINITY, DType::f64, 1.0, false},
};
std::pair<NormGate, NormGate> gates(const GateCase& g) {
  const Tensor t = full({}, g.total, g.dtype);
  return {NormGate{.sum_squares = t, .max_norm = g.max_norm}, NormGate{.sum_squares = dev(t), .max_norm = g.max_norm}};
}

TEST(CudaNormGate, AdamWMatchesCpuBitwise) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  const std::vector<Shape> sizes = {{1}, {3}, {5}, {7, 1}, {4095}, {4097}, {12345}, {33}, {2 * 4096 + 1}, {17, 33}};
  constexpr int kTensors = 70;  // more than one launch's table (64)
  for (DType copy_dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const GateCase& gc : kGates) {
      SCOPED_TRACE(std::string(dtype_name(copy_dtype)) + ", " + gc.name);
      const bool copies = copy_dtype != DType::f32;
      Generator gen(200 + int(copy_dtype));
      std::vector<Pair> p, m, v, c, g;
      for (int i = 0; i < kTensors; ++i) {
        const Shape& s = sizes[size_t(i) % sizes.size()];
        Layout lp{s, i % 5 == 1 ? 1 : 0, i == 9 && s.size() == 2};  // tensor 9: the strided kernel
        Layout lm{s, i % 7 == 2 ? 2 : 0}, lv{s, i % 7 == 3 ? 3 : 0}, lg{s, i % 6 == 4 ? 1 : 0};
        Layout lc{s, i % 3 == 0 ? 1 : 0};
        p.push_back(pair(buffer(lp, DType::f32, 1.0, false, gen), lp));
        m.push_back(pair(buffer(lm, DType::f32, 0.1, false, gen), lm));
        v.push_back(pair(buffer(lv, DType::f32, 0.01, true, gen), lv));
        g.push_back(pair(buffer(lg, DType::f32, 1.0, false, gen), lg));
        if (copies) c.push_back(pair(zeros({lc.offset + numel(s)}, copy_dtype), lc));
      }
      ASSERT_FALSE(p[9].h.is_contiguous());
      std::vector<Tensor> p0;  // the parameters before the update
      for (const Pair& x : p) p0.push_back(clone(x.h));
      const auto [gate_h, gate_d] = gates(gc);
      std::vector<AdamWTensors> th, td;
      for (int i = 0; i < kTensors; ++i) {
        th.push_back({p[i].h, g[i].h, m[i].h, v[i].h, copies ? c[i].h : Tensor()});
        td.push_back({p[i].d, g[i].d, m[i].d, v[i].d, copies ? c[i].d : Tensor()});
      }
      const AdamWStepArgs a{.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 2};
      adamw_step_(th, a, gate_h);
      adamw_step_(td, a, gate_d);
      for (int i = 0; i < kTensors; ++i) {
        const std::string at = " of tensor " + std::to_string(i);
        EXPECT_TRUE(bit_equal("param" + at, p[i].d, p[i].h));
        EXPECT_TRUE(bit_equal("exp_avg" + at, m[i].d, m[i].h));
        EXPECT_TRUE(bit_equal("exp_avg_sq" + at, v[i].d, v[i].h));
        EXPECT_TRUE(bit_equal("gradient" + at, g[i].d, g[i].h));  // read, never written
        if (copies) {
          EXPECT_TRUE(bit_equal("copy" + at, c[i].d, c[i].h));
        }
        if (!gc.changes) {
          EXPECT_TRUE(bit_equal("skipped param" + at, p[i].d, p0[size_t(i)]));
        }
      }
    }
  }
}

TEST(CudaNormGate, SGDMatchesCpuBitwise) {
  SKIP_WITHOUT_CUDA();
  NoGradGuard ng;
  for (const GateCase& gc : kGates) {
    for (bool transposed : {false, true}) {
      SCOPED_TRACE(std::string(gc.name) + (transposed ? ", transposed" : ""));
      Generator gen(17);
      const Layout l{{33, 65}, 1, transposed};
      Pair p = pair(buffer(l, DType::f32, 1.0, false, gen), l), g = pair(buffer(l, DType::f32, 1.0, false, gen), l);
      Pair b = pair(buffer(l, DType::f32, 0.1, false, gen), l);
      const Tensor p0 = clone(p.h);
      const auto [gate_h, gate_d] = gates(gc);
      const SGDStepArgs a{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true, .init_buffer = false};
      sgd_step_(p.h, g.h, b.h, a, gate_h);
      sgd_step_(p.d, g.d, b.d, a, gate_d);
      EXPECT_TRUE(bit_equal("param", p.d, p.h));
      EXPECT_TRUE(bit_equal("momentum buffer", b.d, b.h));
      EXPECT_EQ(bool(bit_equal("param vs before", p.d, p0)), !gc.changes);
    }
  }
}

// A bf16 GPT on the GPU: `steps` steps with max_norm 0.05 (clipping active), through
// clip_grad_norm + step() or grad_norm_gate + step(gate); then, with `poison`, one more whose
// gradients hold a NaN.
struct GptRun {
  std::unique_ptr<models::GPT> model;
  std::unique_ptr<optim::Optimizer> opt;
  std::vector<double> norms;
  std::vector<uint64_t> reads;  // host reads of each clip + step
};
GptRun train(bool adamw, bool gated, int steps) {
  GptRun r;
  models::GPTConfig cfg = ::blu::test::tiny_gpt();
  r.model = std::make_unique<models::GPT>(cfg, 3);
  r.model->to(kGPU);
  r.model->set_compute_dtype(DType::bf16);
  auto groups = optim::decay_groups(r.model->named_parameters(), 0.1);
  r.opt = adamw ? optim::make_adamw(groups, {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8})
                : optim::make_sgd(groups, {.lr = 3e-2, .momentum = 0.9});
  r.opt->attach_compute_copies(r.model->compute_copies());
  const std::vector<Tensor> params = r.model->parameters();
  Generator data(5);
  for (int step = 0; step < steps; ++step) {
    const Tensor idx = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
    const Tensor tgt = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
    r.opt->zero_grad();
    r.model->forward(idx, tgt).loss.backward();
    const uint64_t r0 = host_reads();
    if (gated) {
      const NormGate gate = optim::grad_norm_gate(params, 0.05);
      r.opt->step(gate);
      r.reads.push_back(host_reads() - r0);
      r.norms.push_back(optim::gate_norm(gate));
    } else {
      r.norms.push_back(optim::clip_grad_norm(params, 0.05));
      r.opt->step();
      r.reads.push_back(host_reads() - r0);
    }
  }
  return r;
}

TEST(CudaNormGate, GptGateEqualsClipThenStepWithoutHostReads) {
  SKIP_WITHOUT_CUDA();
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    GptRun ref = train(adamw, false, 3), gated = train(adamw, true, 3);
    EXPECT_EQ(ref.norms, gated.norms);
    for (double n : ref.norms) EXPECT_GT(n, 0.05);  // clipping active
    EXPECT_EQ(ref.reads, (std::vector<uint64_t>{1, 1, 1}));
    EXPECT_EQ(gated.reads, (std::vector<uint64_t>{0, 0, 0}));
    const nn::NamedTensors a = ref.model->named_parameters(), b = gated.model->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bit_equal(a[i].first, a[i].second, b[i].second));
    const nn::NamedTensors sa = ref.opt->state(), sb = gated.opt->state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(bit_equal(sa[i].first, sa[i].second, sb[i].second));
    if (adamw) {
      for (const auto& [p, c] : gated.model->compute_copies()) {
        if (c->tensor().defined()) {
          EXPECT_TRUE(bit_equal("copy", c->tensor(), to_dtype(p, DType::bf16)));
        }
      }
    }

    // A NaN in one gradient: the gated step leaves parameters, moments/buffers and copies as they were.
    GptRun& g = gated;
    g.opt->zero_grad();
    Generator data(9);
    const Tensor idx = randint(0, 101, {2, 16}, DType::i64, kGPU, &data);
    g.model->forward(idx, idx).loss.backward();
    Tensor w = g.model->named_parameters()[2].second;
    copy_(narrow(reshape(w.grad(), {w.numel()}), 0, 1, 1), dev(full({1}, NAN)));
    nn::NamedTensors before;
    for (const auto& [n, t] : g.model->named_parameters()) before.emplace_back(n, host(t));
    for (const auto& [n, t] : g.opt->state()) before.emplace_back("state " + n, host(t));
    std::vector<Tensor> copies_before;
    for (const auto& [p, c] : g.model->compute_copies())
      if (c->tensor().defined()) copies_before.push_back(host(c->tensor()));
    const NormGate gate = optim::grad_norm_gate(g.model->parameters(), 0.05);
    g.opt->step(gate);
    EXPECT_TRUE(std::isnan(optim::gate_norm(gate)));
    size_t k = 0;
    for (const auto& [n, t] : g.model->named_parameters()) EXPECT_TRUE(bit_equal(n, t, before[k++].second));
    for (const auto& [n, t] : g.opt->state()) {
      if (n.rfind("step", 0) == 0) {  // counts advance (optimizer.h)
        ++k;
        continue;
      }
      EXPECT_TRUE(bit_equal("state " + n, t, before[k++].second));
    }
    k = 0;
    for (const auto& [p, c] : g.model->compute_copies()) {
      if (c->tensor().defined()) {
        EXPECT_TRUE(bit_equal("copy", c->tensor(), copies_before[k++]));
      }
    }
  }
}

}  // namespace
}  // namespace blu
