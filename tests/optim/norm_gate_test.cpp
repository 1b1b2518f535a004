// The norm gate (Note [Norm gate], ops/optim.h): an update given grad_norm_gate's gate equals
// clip_grad_norm's in-place scaling followed by the plain update, bit for bit — clipping active or
// not, AdamW without and with bf16/f16 compute copies, SGD with momentum (and Nesterov, weight
// decay), many tensors, non-contiguous and offset views — and leaves the gradients as they were;
// a NaN or Inf in one gradient leaves every parameter, moment, copy and momentum buffer
// bit-identical; the optimizers' step(gate) matches clip_grad_norm + step() over several steps
// (a bf16 GPT with compute copies among them); the gate makes no host read where clip_grad_norm
// makes one; bad gates are refused.
#include <gtest/gtest.h>

#include <cmath>

#include "common/checks.h"
#include "common/opinfo.h"
#include "common/tiny_gpt.h"
#include "blu/blu.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/ops/optim.h"
#include "blu/optim/optimizer.h"

namespace blu::test {
namespace {

// One parameter's tensors for the op-level tests.
struct Slot {
  Tensor p, m, v, c, buf;  // c: compute copy (undefined for f32); buf: SGD momentum buffer
};
// Odd shapes; index 3 a transposed parameter, index 4 a view at an odd offset of a larger buffer,
// index 5 empty; index 2 has a strided moment.
std::vector<Slot> make_slots(uint64_t seed, DType copy_dtype) {
  Generator gen(seed);
  const std::vector<Shape> shapes = {{7, 5}, {13}, {3, 1, 4}, {5, 3}, {37}, {0, 4}, {1}};
  std::vector<Slot> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    Slot s;
    s.p = rnd(gen, shapes[i], DType::f32);
    if (i == 3) s.p = noncontig(s.p);
    if (i == 4) s.p = narrow(rnd(gen, {41}, DType::f32), 0, 3, 37);
    s.m = mul(rnd(gen, shapes[i], DType::f32), 0.1);
    s.v = abs(mul(rnd(gen, shapes[i], DType::f32), 0.01));
    if (i == 2) s.m = noncontig(s.m);
    if (copy_dtype != DType::f32) s.c = zeros(shapes[i], copy_dtype);
    s.buf = rnd(gen, shapes[i], DType::f32);
    out.push_back(s);
  }
  return out;
}
Tensor same_layout_clone(const Tensor& t) {
  if (!t.defined()) return t;
  Tensor c = clone(t);
  return t.is_contiguous() ? c : noncontig(c);
}
std::vector<Slot> clone_slots(const std::vector<Slot>& a) {
  std::vector<Slot> out;
  for (const Slot& s : a)
    out.push_back({same_layout_clone(s.p), same_layout_clone(s.m), same_layout_clone(s.v), same_layout_clone(s.c),
                   same_layout_clone(s.buf)});
  return out;
}
// Each slot's gradient, scaled by `scale`; slot 1's is strided.
std::vector<Tensor> make_grads(Generator& gen, const std::vector<Slot>& slots, double scale) {
  std::vector<Tensor> g;
  for (const Slot& s : slots) g.push_back(mul(rnd(gen, s.p.shape(), DType::f32), scale));
  g[1] = noncontig(g[1]);
  return g;
}
// Leaves whose .grad() are the given tensors (handles, not copies): what clip_grad_norm and
// grad_norm_gate take.
std::vector<Tensor> holders(const std::vector<Tensor>& grads) {
  std::vector<Tensor> out;
  for (const Tensor& g : grads) {
    Tensor h = zeros(g.shape());
    h.set_requires_grad(true);
    h.set_grad(g);
    out.push_back(h);
  }
  return out;
}
std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(same_layout_clone(t));
  return out;
}

void expect_slots_equal(const std::vector<Slot>& a, const std::vector<Slot>& b, const std::string& what) {
  for (size_t i = 0; i < a.size(); ++i) {
    const std::string at = what + ", tensor " + std::to_string(i);
    EXPECT_TRUE(bitwise_equal(a[i].p, b[i].p)) << "param " << at;
    EXPECT_TRUE(bitwise_equal(a[i].m, b[i].m)) << "exp_avg " << at;
    EXPECT_TRUE(bitwise_equal(a[i].v, b[i].v)) << "exp_avg_sq " << at;
    EXPECT_TRUE(bitwise_equal(a[i].buf, b[i].buf)) << "momentum buffer " << at;
    if (a[i].c.defined()) {
      EXPECT_TRUE(bitwise_equal(a[i].c, b[i].c)) << "copy " << at;
    }
  }
}

// The norm of the slots' gradients (the same number clip_grad_norm computes).
double norm_of(const std::vector<Tensor>& g) { return std::sqrt(to_vector(sum_squares(g))[0]); }

// Gradient scales and thresholds: clipping active (norm ≈ 9 against 1 or 0.25), inactive (against
// 1e3) and off (infinity).
struct Case {
  double grad_scale, max_norm;
  bool clips;
};
const Case kCases[] = {{1.0, 1.0, true}, {1.0, 0.25, true}, {1e-3, 1e3, false}, {1.0, 1e3, false},
                       {1.0, INFINITY, false}};

TEST(NormGate, AdamWEqualsClipThenStepBitwise) {
  NoGradGuard ng;
  for (DType copy_dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const Case& cs : kCases) {
      SCOPED_TRACE(std::string(dtype_name(copy_dtype)) + " max_norm " + std::to_string(cs.max_norm));
      std::vector<Slot> ref = make_slots(5, copy_dtype), gated = clone_slots(ref);
      Generator gen(9);
      for (int64_t step = 1; step <= 3; ++step) {
        const std::vector<Tensor> g_ref = make_grads(gen, ref, cs.grad_scale), g_gated = clones(g_ref);
        ASSERT_EQ(norm_of(g_ref) > cs.max_norm, cs.clips);  // the case does what it says
        const double norm = optim::clip_grad_norm(holders(g_ref), cs.max_norm);
        const NormGate gate = optim::grad_norm_gate(holders(g_gated), cs.max_norm);
        EXPECT_EQ(optim::gate_norm(gate), norm);
        for (int k = 0; k < 2; ++k) {  // two weight decays: even and odd tensors, one op each
          const AdamWStepArgs args{.lr = 1e-2 * double(step), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                   .weight_decay = k == 0 ? 0.1 : 0.0, .step = step};
          std::vector<AdamWTensors> a, b;
          for (size_t i = size_t(k); i < ref.size(); i += 2) {
            a.push_back({ref[i].p, g_ref[i], ref[i].m, ref[i].v, ref[i].c});
            b.push_back({gated[i].p, g_gated[i], gated[i].m, gated[i].v, gated[i].c});
          }
          adamw_step_(a, args);
          adamw_step_(b, args, gate);
        }
        expect_slots_equal(ref, gated, "step " + std::to_string(step));
        // The gated update read the gradients without writing them; clip_grad_norm scaled its own.
        for (size_t i = 0; i < g_gated.size(); ++i) {
          if (g_gated[i].numel() == 0) continue;
          EXPECT_EQ(bitwise_equal(g_gated[i], g_ref[i]), !cs.clips) << "gradient " << i;
        }
      }
    }
  }
}

TEST(NormGate, SGDEqualsClipThenStepBitwise) {
  NoGradGuard ng;
  struct Variant {
    double momentum, weight_decay;
    bool nesterov;
  };
  for (const Variant var : {Variant{0.9, 0.0, false}, Variant{0.9, 0.01, true}, Variant{0.0, 0.01, false}}) {
    for (const Case& cs : kCases) {
      SCOPED_TRACE("momentum " + std::to_string(var.momentum) + (var.nesterov ? " nesterov" : "") + " max_norm " +
                   std::to_string(cs.max_norm));
      std::vector<Slot> ref = make_slots(6, DType::f32), gated = clone_slots(ref);
      Generator gen(10);
      for (int step = 0; step < 3; ++step) {
        const std::vector<Tensor> g_ref = make_grads(gen, ref, cs.grad_scale), g_gated = clones(g_ref);
        optim::clip_grad_norm(holders(g_ref), cs.max_norm);
        const NormGate gate = optim::grad_norm_gate(holders(g_gated), cs.max_norm);
        const SGDStepArgs args{.lr = 0.05, .momentum = var.momentum, .weight_decay = var.weight_decay,
                               .nesterov = var.nesterov, .init_buffer = step == 0};
        for (size_t i = 0; i < ref.size(); ++i) {
          sgd_step_(ref[i].p, g_ref[i], ref[i].buf, args);
          sgd_step_(gated[i].p, g_gated[i], gated[i].buf, args, gate);
        }
        expect_slots_equal(ref, gated, "step " + std::to_string(step));
      }
    }
  }
}

// A NaN or an infinity in one element of one gradient: every tensor the update would write stays
// bit-identical, AdamW (copies or not, contiguous and strided kernels) and SGD alike.
TEST(NormGate, NonFiniteGradientChangesNothing) {
  NoGradGuard ng;
  for (double bad : {double(NAN), double(INFINITY), -double(INFINITY)}) {
    // The gradient of a contiguous parameter, of a transposed one (the strided kernel), of a
    // one-element one.
    for (size_t which : {size_t(0), size_t(3), size_t(6)}) {
      for (DType copy_dtype : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(std::to_string(bad) + " in gradient " + std::to_string(which) + ", " +
                     std::string(dtype_name(copy_dtype)));
        const std::vector<Slot> before = make_slots(7, copy_dtype);
        std::vector<Slot> slots = clone_slots(before);
        Generator gen(3);
        std::vector<Tensor> g = make_grads(gen, slots, 1.0);
        ASSERT_TRUE(g[which].is_contiguous());  // so the reshape below is a view
        copy_(narrow(reshape(g[which], {g[which].numel()}), 0, 0, 1), full({1}, bad));
        for (double max_norm : {1.0, double(INFINITY)}) {
          const NormGate gate = optim::grad_norm_gate(holders(g), max_norm);
          EXPECT_FALSE(std::isfinite(optim::gate_norm(gate)));
          std::vector<AdamWTensors> list;
          for (size_t i = 0; i < slots.size(); ++i) list.push_back({slots[i].p, g[i], slots[i].m, slots[i].v, slots[i].c});
          adamw_step_(list, {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 2},
                      gate);
          for (size_t i = 0; i < slots.size(); ++i)
            sgd_step_(slots[i].p, g[i], slots[i].buf,
                      {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true, .init_buffer = false},
                      gate);
          expect_slots_equal(before, slots, "max_norm " + std::to_string(max_norm));
        }
        // Without the gate the same update does change them (the check above can fail).
        adamw_step_({{slots[0].p, g[0], slots[0].m, slots[0].v, slots[0].c}},
                    {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 2});
        EXPECT_FALSE(bitwise_equal(before[0].p, slots[0].p));
      }
    }
  }
}

// A small problem for the optimizers: named parameters in two groups (one a transposed view of a
// larger tensor), one parameter that never gets a gradient.
struct Problem {
  nn::NamedTensors params;
  explicit Problem(uint64_t seed) {
    Generator gen(seed);
    for (auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
             {"h.0.weight", {6, 4}}, {"h.0.bias", {4}}, {"h.1.weight", {4, 3}}, {"h.2.weight", {3, 5}}, {"unused", {2}}}) {
      Tensor p = rnd(gen, shape, DType::f32);
      if (name == "h.2.weight") p = transpose(rnd(gen, {5, 3}, DType::f32), 0, 1);
      p.set_requires_grad(true);
      params.emplace_back(name, p);
    }
  }
  Problem(const Problem& o, int) {  // an independent copy with the same values and layouts
    for (auto& [name, p] : o.params) {
      Tensor c = same_layout_clone(p.detach());
      c.set_requires_grad(true);
      params.emplace_back(name, c);
    }
  }
  std::vector<optim::ParamGroup> groups() const { return optim::decay_groups(params, 0.1); }
  std::vector<Tensor> tensors() const {
    std::vector<Tensor> out;
    for (auto& [n, p] : params) out.push_back(p);
    return out;
  }
  // Gradients scaled by `scale`; `poison`: a NaN in h.1.weight's.
  void set_grads(Generator& gen, double scale, bool poison = false) const {
    for (auto [name, p] : params) {
      p.zero_grad();
      if (name == "unused") continue;
      Tensor g = mul(rnd(gen, p.shape(), DType::f32), scale);
      if (poison && name == "h.1.weight") copy_(narrow(reshape(g, {g.numel()}), 0, 5, 1), full({1}, NAN));
      p.set_grad(g);
    }
  }
};

void expect_same(const optim::Optimizer& a, const optim::Optimizer& b, const Problem& pa, const Problem& pb,
                 const std::string& what) {
  for (size_t i = 0; i < pa.params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(pa.params[i].second, pb.params[i].second)) << what << ": " << pa.params[i].first;
  const nn::NamedTensors sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size()) << what;
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first) << what;
    EXPECT_TRUE(bitwise_equal(sa[i].second, sb[i].second)) << what << ": " << sa[i].first;
  }
}
nn::NamedTensors deep_copy(const nn::NamedTensors& ts) {
  nn::NamedTensors out;
  for (const auto& [n, t] : ts) out.emplace_back(n, clone(t));
  return out;
}

using MakeOpt = std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;
const std::pair<const char*, MakeOpt> kOptimizers[] = {
    {"adamw", [](auto g) { return optim::make_adamw(std::move(g), {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8}); }},
    {"sgd", [](auto g) { return optim::make_sgd(std::move(g), {.lr = 0.05, .momentum = 0.9, .nesterov = true}); }},
};

// Four steps alternating clipped and unclipped: step(grad_norm_gate(...)) vs clip_grad_norm +
// step(); then a poisoned gradient: the gated step leaves parameters and state as they were (the
// step count moves on: the host does not know the update was skipped).
TEST(NormGate, OptimizerStepWithGateEqualsClipThenStep) {
  for (const auto& [name, make] : kOptimizers) {
    SCOPED_TRACE(name);
    Problem pa(7), pb(pa, 0);
    auto ref = make(pa.groups()), gated = make(pb.groups());
    Generator ga(11), gb(11);
    for (int s = 0; s < 4; ++s) {
      const double scale = s % 2 == 0 ? 1.0 : 1e-3, max_norm = 0.5;
      pa.set_grads(ga, scale);
      pb.set_grads(gb, scale);
      ASSERT_EQ(norm_of({pa.params[0].second.grad()}) > max_norm, s % 2 == 0);
      optim::clip_grad_norm(pa.tensors(), max_norm);
      ref->step();
      gated->step(optim::grad_norm_gate(pb.tensors(), max_norm));
      expect_same(*ref, *gated, pa, pb, "step " + std::to_string(s));
    }
    const nn::NamedTensors params_before = deep_copy(pb.params), state_before = deep_copy(gated->state());
    pb.set_grads(gb, 1.0, true);
    const NormGate gate = optim::grad_norm_gate(pb.tensors(), 0.5);
    EXPECT_TRUE(std::isnan(optim::gate_norm(gate)));
    gated->step(gate);
    for (size_t i = 0; i < pb.params.size(); ++i)
      EXPECT_TRUE(bitwise_equal(pb.params[i].second, params_before[i].second)) << pb.params[i].first;
    const nn::NamedTensors state_after = gated->state();
    ASSERT_EQ(state_after.size(), state_before.size());
    for (size_t i = 0; i < state_after.size(); ++i) {
      if (state_after[i].first.rfind("step", 0) == 0) continue;  // counts advance (documented)
      EXPECT_TRUE(bitwise_equal(state_after[i].second, state_before[i].second)) << state_after[i].first;
    }
    EXPECT_EQ(gated->steps(), 5);
  }
}

// SGD whose very first update is skipped: the buffer it created is zero, not left uninitialised,
// so the next update (which takes it as momentum * buf + d) is d.
TEST(NormGate, SkippedFirstSGDStepLeavesAZeroBuffer) {
  Problem pa(3), pb(pa, 0);
  auto opt = optim::make_sgd(pb.groups(), {.lr = 0.05, .momentum = 0.9});
  auto plain = optim::make_sgd(pa.groups(), {.lr = 0.05, .momentum = 0.9});
  Generator gb(4);
  pb.set_grads(gb, 1.0, true);
  opt->step(optim::grad_norm_gate(pb.tensors(), 1.0));
  for (const auto& [n, t] : opt->state()) {
    if (n == "step") continue;
    EXPECT_EQ(to_vector(sum_squares({t}))[0], 0.0) << n;
  }
  Generator ga(5);
  gb = ga;
  pa.set_grads(ga, 1.0);
  pb.set_grads(gb, 1.0);
  plain->step();
  opt->step(optim::grad_norm_gate(pb.tensors(), INFINITY));
  for (size_t i = 0; i < pa.params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(pa.params[i].second, pb.params[i].second)) << pa.params[i].first;
}

// A bf16 GPT, AdamW writing the compute copies: step(gate) trains exactly as clip_grad_norm +
// step() (clipping active at max_norm 0.05), and the copies equal the casts.
TEST(NormGate, GptWithComputeCopiesMatchesClipThenStep) {
  auto run = [](bool gate) {
    auto model = std::make_unique<models::GPT>(tiny_gpt(), 7);
    model->set_compute_dtype(DType::bf16);
    auto opt = optim::make_adamw(optim::decay_groups(model->named_parameters(), 0.1),
                                 {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8});
    opt->attach_compute_copies(model->compute_copies());
    Generator data(11);
    const auto params = model->parameters();
    std::vector<double> norms;
    for (int s = 0; s < 3; ++s) {
      const Tensor idx = randint(0, tiny_gpt().vocab_size, {2, 16}, DType::i64, kCPU, &data);
      const Tensor tgt = randint(0, tiny_gpt().vocab_size, {2, 16}, DType::i64, kCPU, &data);
      opt->zero_grad();
      model->forward(idx, tgt).loss.backward();
      if (gate) {
        const NormGate g = optim::grad_norm_gate(params, 0.05);
        opt->step(g);
        norms.push_back(optim::gate_norm(g));
      } else {
        norms.push_back(optim::clip_grad_norm(params, 0.05));
        opt->step();
      }
      for (const auto& [p, c] : model->compute_copies())
        if (c->tensor().defined()) {
          EXPECT_TRUE(bitwise_equal(c->tensor(), to_dtype(p, DType::bf16)));
        }
    }
    return std::make_pair(std::move(model), norms);
  };
  const auto [ref, ref_norms] = run(false);
  const auto [gated, gated_norms] = run(true);
  EXPECT_EQ(ref_norms, gated_norms);
  for (double n : ref_norms) EXPECT_GT(n, 0.05);  // clipping was active
  const nn::NamedTensors a = ref->named_parameters(), b = gated->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].second, b[i].second)) << a[i].first;
}

// The gate path makes no host read; clip_grad_norm makes one (its norm), gate_norm one.
TEST(NormGate, GateMakesNoHostRead) {
  for (const auto& [name, make] : kOptimizers) {
    SCOPED_TRACE(name);
    Problem pb(7);
    auto opt = make(pb.groups());
    Generator gen(1);
    for (int s = 0; s < 2; ++s) {  // the first step creates the state, the second reuses it
      pb.set_grads(gen, 1.0);
      uint64_t r0 = host_reads();
      const NormGate gate = optim::grad_norm_gate(pb.tensors(), 0.5);
      opt->step(gate);
      EXPECT_EQ(host_reads() - r0, 0u) << "step " << s;
      r0 = host_reads();
      optim::gate_norm(gate);
      EXPECT_EQ(host_reads() - r0, 1u);
      pb.set_grads(gen, 1.0);
      r0 = host_reads();
      optim::clip_grad_norm(pb.tensors(), 0.5);
      opt->step();
      EXPECT_EQ(host_reads() - r0, 1u) << "step " << s;
    }
  }
}

TEST(NormGate, NoGradientsNoGate) {
  Problem pb(2);
  const NormGate gate = optim::grad_norm_gate(pb.tensors(), 1.0);
  EXPECT_FALSE(gate.defined());
  EXPECT_EQ(optim::gate_norm(gate), 0.0);
  EXPECT_EQ(optim::gate_norm(gate), optim::clip_grad_norm(pb.tensors(), 1.0));
  auto opt = optim::make_adamw(pb.groups(), {});
  opt->step(gate);  // nothing has a gradient: nothing happens
  EXPECT_TRUE(opt->state().size() == 1);
}

TEST(NormGate, RefusesBadGates) {
  NoGradGuard ng;
  Tensor p = zeros({3}), g = ones({3}), m = zeros({3}), v = zeros({3});
  const AdamWStepArgs a{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1};
  const SGDStepArgs s{.lr = 0.1, .momentum = 0, .weight_decay = 0, .nesterov = false, .init_buffer = false};
  expect_error([&] { adamw_step_({{p, g, m, v}}, a, {.sum_squares = zeros({}, DType::i64), .max_norm = 1}); },
               {"adamw_step", "sum of squares must be one f32 or f64 element", "i64"});
  expect_error([&] { sgd_step_(p, g, Tensor(), s, {.sum_squares = zeros({2}, DType::f64), .max_norm = 1}); },
               {"sgd_step", "sum of squares must be one f32 or f64 element", "[2]"});
  expect_error([&] { adamw_step_({{p, g, m, v}}, a, {.sum_squares = zeros({}, DType::f64), .max_norm = 0}); },
               {"max_norm must be > 0, got 0"});
  expect_error([&] { sgd_step_(p, g, Tensor(), s, {.sum_squares = zeros({}, DType::f64), .max_norm = NAN}); },
               {"max_norm must be > 0"});
  expect_error([&] { optim::grad_norm_gate({}, -1.0); }, {"grad_norm_gate: max_norm must be > 0, got -1"});
  // A 1-element f32 total (CUDA's sum_squares dtype) is accepted.
  adamw_step_({{p, g, m, v}}, a, {.sum_squares = full({1}, 4.0, DType::f32), .max_norm = 1});
}

// The op reads the gate and the gradients and writes the rest (Note [Storage versions]).
TEST(NormGate, BumpsTheVersionsOfWhatItWrites) {
  NoGradGuard ng;
  Tensor p = zeros({3}), g = ones({3}), m = zeros({3}), v = zeros({3}), c = zeros({3}, DType::bf16);
  Tensor buf = zeros({3});
  const NormGate gate{.sum_squares = full({}, 3.0, DType::f64), .max_norm = 1};
  auto version = [](const Tensor& t) { return t.storage()->version(); };
  const uint64_t p0 = version(p), g0 = version(g), m0 = version(m), v0 = version(v), c0 = version(c),
                 b0 = version(buf), t0 = version(gate.sum_squares);
  adamw_step_({{p, g, m, v, c}}, {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0, .step = 1},
              gate);
  sgd_step_(p, g, buf, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0, .nesterov = false, .init_buffer = true}, gate);
  EXPECT_EQ(version(p) - p0, 2u);
  EXPECT_EQ(version(m) - m0, 1u);
  EXPECT_EQ(version(v) - v0, 1u);
  EXPECT_EQ(version(c) - c0, 1u);
  EXPECT_EQ(version(buf) - b0, 1u);
  EXPECT_EQ(version(g) - g0, 0u);
  EXPECT_EQ(version(gate.sum_squares) - t0, 0u);
}

}  // namespace
}  // namespace blu::test
