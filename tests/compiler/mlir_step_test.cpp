// Fused regions in the compiled step (compiler/fused_step.h) and the CPU kernels' op coverage:
// - ten steps of the tiny GPT-2 and the tiny Llama (AdamW, clipping, a changing lr) compiled with
//   the fusion pass (mlir_api::fuse on capture's Graph) give bitwise the eager losses and weights:
//   every emitted kernel does its ops' eager arithmetic in the eager order; the launch list shrinks
//   by the fused ops, and the memory plan holds fewer buffers (the regions' intermediates);
// - each fusible op of the op table that GPT-2 and Llama steps contain, captured in a region with
//   a neighbour, equals eager bitwise (check_region: max |diff| 0);
// - the pass's region of the loss's scaled gradient with cross_entropy_backward (the trainer's
//   1/grad-accum) compiles and equals eager bitwise; a [rows] value made in a rows region is refused;
// - f16 regions equal eager bitwise, and no cached kernel needs a symbol of the app.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <tuple>

#include "blu/blu.h"
#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/codegen/region_check.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/fused_step.h"
#include "blu/compiler/mlir/mlir_api.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "blu/ops/optim.h"
#include "common/tiny_gpt.h"

namespace blu::compiler {
namespace {

void use_temp_cache() {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("blu_kernel_cache_step_" + std::to_string(::getpid()));
    std::filesystem::remove_all(d);
    return d.string();
  }();
  ::setenv("BLU_KERNEL_CACHE", dir.c_str(), 1);
}

std::pair<Tensor, Tensor> batch(int64_t step, int64_t B, int64_t T, int64_t vocab) {
  std::vector<double> in, tg;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      in.push_back(double((step * 131 + b * 31 + t * 7) % vocab));
      tg.push_back(double((step * 131 + b * 31 + t * 7 + 5) % vocab));
    }
  return {from_vector(in, {B, T}, DType::i32), from_vector(tg, {B, T}, DType::i32)};
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<Tensor> params;
  int launches = 0, fused_launches = 0, fused_ops = 0, arena_buffers = 0;
  std::vector<RegionCheck> checks;  // check mode
};

TrainRun train(const std::string& family, bool compiled, bool fusion, std::string* log_out = nullptr,
               bool remat = false, bool check = false) {
  std::unique_ptr<models::CausalLM> model;
  if (family == "gpt2") model = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 7);
  else model = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  std::ostringstream log;
  CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  if (fusion) o.fusion = [](const Graph& g) { return mlir_api::fuse(g); };
  o.remat = remat;
  o.check = check;
  std::unique_ptr<CompiledStep> cs;
  if (compiled) {
    cs = std::make_unique<CompiledStep>(o);
    cs->set_named(BufferKind::parameter, model->named_parameters());
  }
  TrainRun r;
  for (int s = 0; s < 10; ++s) {
    Tensor idx, tg;  // no structured binding: clang 14 cannot capture one in a lambda
    std::tie(idx, tg) = batch(s, 2, 8, 101);
    const double lr = 3e-3 * (1.0 - 0.05 * s);
    dist::StepValues v;
    auto step = [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, lr, 1.0); };
    if (cs) cs->run({idx, tg}, step);
    else step();
    r.losses.push_back(strat.read(v, false).loss);
  }
  for (const Tensor& p : model->parameters()) r.params.push_back(clone(p.detach()));
  if (cs) {
    EXPECT_EQ(cs->counts().compiled, 9) << log.str();
    const Runtime& rt = *cs->variants().at(0)->runtime;
    r.launches = int(rt.launches().size());
    for (const Launch& l : rt.launches()) r.fused_launches += l.kind == OpKind::fused;
    r.arena_buffers = rt.plan().arena_buffers;
    r.checks = cs->region_checks();
  }
  if (log_out) *log_out = log.str();
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

class FusedVsEager : public ::testing::TestWithParam<std::string> {};

TEST_P(FusedVsEager, TenStepsBitwiseWithFewerLaunches) {
  use_temp_cache();
  const TrainRun eager = train(GetParam(), false, false);
  const TrainRun plain = train(GetParam(), true, false);
  std::string log;
  const TrainRun fused = train(GetParam(), true, true, &log);
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(eager.losses[i], fused.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(same_bits(eager.params[i], fused.params[i])) << "parameter " << i << "\n" << log;
  // Regions ran, and each removed its ops from the launch list and its intermediates from the plan.
  EXPECT_GE(fused.fused_launches, 4) << log;
  EXPECT_LT(fused.launches, plain.launches) << log;
  EXPECT_LT(fused.arena_buffers, plain.arena_buffers) << log;
  EXPECT_NE(log.find("fusion: "), std::string::npos) << log;
  std::cout << GetParam() << ": launches " << plain.launches << " unfused, " << fused.launches << " fused ("
            << fused.fused_launches << " fused kernels); arena buffers " << plain.arena_buffers << " -> "
            << fused.arena_buffers << "\n";
  std::cout << log.substr(log.find("fusion: ")) << "\n";
  // The compiler's own recompute after fusion (compiler/remat.h): it never takes a producer that a
  // region swallowed, and the ops after a gap (fused ones too) read the remade buffers; still bitwise.
  std::string remat_log;
  const TrainRun both = train(GetParam(), true, true, &remat_log, true);
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(eager.losses[i], both.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < eager.params.size(); ++i)
    EXPECT_TRUE(same_bits(eager.params[i], both.params[i])) << "parameter " << i << "\n" << remat_log;
  EXPECT_GE(both.fused_launches, 4) << remat_log;
  const size_t at = remat_log.find("recompute: ");
  ASSERT_NE(at, std::string::npos) << remat_log;
  std::cout << GetParam() << " fused: " << remat_log.substr(at, remat_log.find('\n', at) - at) << "\n";
}

INSTANTIATE_TEST_SUITE_P(Compiler, FusedVsEager, ::testing::Values("gpt2", "llama"));

// Captures f (forward and, through autograd, backward) as capture's Graph, runs the captured
// kernels once (Runtime::run_unplanned) so every value has its eager bytes, takes the ops named in
// `names` — each the next kernel op of that name in schedule order — as one region of `shape`,
// and returns max |fused - eager| over the region's outputs (check_region: the region's ops run
// again through dispatch, and the fused kernel, on the same inputs).
double region_vs_eager(const std::function<void()>& f, const std::vector<std::string>& names, RegionShape shape) {
  use_temp_cache();
  Capture cap;
  f();
  cap.finish();
  Runtime::run_unplanned(cap);
  const Graph& g = cap.graph();
  FusedRegion r;
  r.index = 0;
  r.shape = shape;
  size_t at = 0;
  for (const std::string& n : names) {
    while (at < g.ops.size() && !(g.ops[at].kind == OpKind::kernel && g.ops[at].name == n)) ++at;
    EXPECT_LT(at, g.ops.size()) << "no op " << n << " in\n" << g.dump();
    if (at == g.ops.size()) return -1;
    r.ops.push_back(int(at++));
  }
  compute_region_io(g, r);
  EXPECT_TRUE(cpu_emitter_supports(g, r)) << region_text(g, r);
  if (!cpu_emitter_supports(g, r)) return -1;
  auto k = CpuKernel::load(g, r);
  std::vector<Tensor> ins;
  for (int v : r.inputs) ins.push_back(cap.tensors()[size_t(v)]);
  return check_region(g, r, *k, ins);
}

Tensor leaf(const Shape& s) { return randn(s).set_requires_grad(true); }

// The norm backward of capture's graph holds the residual's gradient as its last input (Note
// [Folded gradient sums], ops/dispatch.h): the region's kernel adds it as eager's kernel does.
bool norm_backward_folds(const std::function<void()>& f, const std::string& name) {
  Capture cap;
  f();
  const Graph& g = cap.finish();
  Runtime::run_unplanned(cap);  // the leaves' gradients get bytes, for the next capture to read
  for (const Op& op : g.ops)
    if (op.name == name) return op.inputs.size() == (name == "layer_norm_backward" ? 6u : 5u) && op.inputs.back() >= 0;
  return false;
}

// Check mode (CompileOptions::check, BLU_COMPILE_CHECK=1, `--compile-check`): every generated
// region of the step is run once against its ops run eagerly on copies of the same inputs; on the
// CPU the fused kernels keep the eager arithmetic order, so every difference is 0, and the run is
// still the eager one bit for bit.
TEST_P(FusedVsEager, CheckModeComparesEveryRegionWithItsEagerOps) {
  use_temp_cache();
  const TrainRun eager = train(GetParam(), false, false);
  std::string log;
  const TrainRun checked = train(GetParam(), true, true, &log, false, true);
  EXPECT_EQ(int(checked.checks.size()), checked.fused_launches) << log;
  EXPECT_GE(checked.checks.size(), 4u) << log;
  for (const RegionCheck& c : checked.checks) EXPECT_EQ(c.max_diff, 0.0) << "region " << c.region << " (" << c.ops << ")";
  EXPECT_NE(log.find("compile: check: region 0 ("), std::string::npos) << log;
  for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(eager.losses[i], checked.losses[i]) << "step " << i + 1;
}

TEST(FusedKernels, NormsForwardAndBackwardWithResidualAdd) {
  Tensor x = leaf({6, 40}), h = leaf({6, 40}), w = leaf({40}), b = leaf({40}), g = randn({6, 40});
  // Residual add + norm (forward), and the norm's backward with the residual's gradient folded in.
  auto ln = [&] {
    Tensor xh = add(x, h);
    sum(mul(add(layer_norm(xh, w, b, 1e-5), xh), g)).backward();
  };
  auto rms = [&] {
    Tensor xh = add(x, h);
    sum(mul(add(rms_norm(xh, w, 1e-5), xh), g)).backward();
  };
  auto rms_nw = [&] {
    Tensor xh = add(x, h);
    sum(mul(add(rms_norm(xh, Tensor(), 1e-6), xh), g)).backward();
  };
  EXPECT_TRUE(norm_backward_folds(ln, "layer_norm_backward"));
  EXPECT_TRUE(norm_backward_folds(rms, "rms_norm_backward"));
  EXPECT_TRUE(norm_backward_folds(rms_nw, "rms_norm_backward"));
  EXPECT_EQ(region_vs_eager(ln, {"add", "layer_norm"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(ln, {"mul", "layer_norm_backward"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(rms, {"add", "rms_norm"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(rms, {"mul", "rms_norm_backward"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(rms_nw, {"add", "rms_norm"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(rms_nw, {"mul", "rms_norm_backward"}, RegionShape::rows), 0.0);
}

TEST(FusedKernels, SiluSwigluGeluForwardBackward) {
  Tensor a = leaf({5, 24}), b = leaf({5, 24}), g = randn({5, 24});
  auto si = [&] { sum(mul(mul(silu(a), b), g)).backward(); };
  auto sw = [&] { sum(mul(add(swiglu(a, b), a), g)).backward(); };
  auto ge = [&] { sum(mul(mul(gelu(a, true), b), g)).backward(); };
  EXPECT_EQ(region_vs_eager(si, {"silu", "mul"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(si, {"mul", "silu_backward"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(sw, {"swiglu", "add"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(sw, {"mul", "swiglu_backward"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(ge, {"gelu", "mul"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(ge, {"mul", "gelu_backward"}, RegionShape::pointwise), 0.0);
  // clamp's gradient (elements on both bounds, which pass the gradient: the range is closed), and
  // gelu_linear's backward's GELU with its gradient in one pass (two outputs).
  Tensor w = leaf({7, 24}), bias = leaf({7});
  Tensor c = from_vector({-1.0, 1.0, -1.5, 0.25, 1.0001, -0.9999, 3.0, -1.0}, {2, 4}).set_requires_grad(true);
  const Tensor gc = randn({2, 4});
  auto cl = [&] { sum(mul(clamp(c, -1.0, 1.0), gc)).backward(); };
  auto gl = [&] { sum(mul(gelu_linear(a, w, bias), randn({5, 7}))).backward(); };
  EXPECT_EQ(region_vs_eager(cl, {"mul", "clamp_backward"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(gl, {"gelu_and_backward"}, RegionShape::pointwise), 0.0);
}

TEST(FusedKernels, SoftmaxAndCrossEntropyForwardBackward) {
  Tensor x = leaf({6, 33}), g = randn({6, 33});
  Tensor t = from_vector({3, 0, 32, 7, 7, 1}, {6}, DType::i32);
  Tensor mask = gt(randn({6, 33}), 0.0), ninf = full({}, -1e30);
  auto sm = [&] { sum(mul(softmax(where(mask, mul(x, 0.25), ninf), -1), g)).backward(); };
  auto ce = [&] { cross_entropy(mul(x, 0.5), t).backward(); };
  EXPECT_EQ(region_vs_eager(sm, {"mul_scalar", "where", "softmax"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(sm, {"softmax_backward", "where", "mul_scalar"}, RegionShape::rows), 0.0);
  auto ls = [&] { sum(mul(log_softmax(mul(x, 0.5), -1), g)).backward(); };
  EXPECT_EQ(region_vs_eager(ls, {"mul_scalar", "log_softmax"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(ls, {"log_softmax_backward", "mul_scalar"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(ce, {"mul_scalar", "cross_entropy"}, RegionShape::rows), 0.0);
  EXPECT_EQ(region_vs_eager(ce, {"cross_entropy_backward", "mul_scalar"}, RegionShape::rows), 0.0);
}

// The fusion pass's regions of f's captured graph (run once, so every value has its eager bytes)
// that hold an op named `name`.
std::vector<FusedRegion> pass_regions_with(Capture& cap, const std::function<void()>& f, const std::string& name) {
  f();
  cap.finish();
  Runtime::run_unplanned(cap);
  const Graph& g = cap.graph();
  std::vector<FusedRegion> found;
  for (const FusedRegion& r : mlir_api::fuse(g))
    for (int oi : r.ops)
      if (g.ops[size_t(oi)].name == name) {
        found.push_back(r);
        break;
      }
  return found;
}

TEST(FusedKernels, CrossEntropyBackwardOfAScaledLoss) {
  // The trainer's loss times 1/grad-accum: the loss's gradient is a scalar mul_scalar, which the
  // pass puts in the region of cross_entropy_backward (that op's space is its gradient's size). In
  // the row loop the scalar is one value, read as the row's scale.
  use_temp_cache();
  Tensor x = leaf({6, 33});
  const Tensor t = from_vector({3, 0, 32, 7, 7, 1}, {6}, DType::i32);
  for (const Reduction red : {Reduction::mean, Reduction::sum}) {
    Capture cap;
    const auto regions =
        pass_regions_with(cap, [&] { mul(cross_entropy(x, t, -1, red), 0.5).backward(); }, "cross_entropy_backward");
    const Graph& g = cap.graph();
    ASSERT_EQ(regions.size(), 1u) << g.dump();
    const FusedRegion& r = regions[0];
    EXPECT_EQ(g.ops[size_t(r.ops.front())].name, "mul_scalar") << region_text(g, r);
    ASSERT_TRUE(cpu_emitter_supports(g, r)) << region_text(g, r);
    std::unique_ptr<CpuKernel> k;
    ASSERT_NO_THROW(k = CpuKernel::load(g, r)) << emit_cpu_source(g, r);
    std::vector<Tensor> ins;
    for (int v : r.inputs) ins.push_back(cap.tensors()[size_t(v)]);
    EXPECT_EQ(check_region(g, r, *k, ins), 0.0) << region_text(g, r);
  }
}

TEST(FusedKernels, NoRegionHoldsBackALibraryCall) {
  // The head's loss in two row pieces: each piece's cross_entropy_backward reads the one scalar
  // loss gradient, and each piece's linear backward (library calls) reads its logits' gradient. A
  // region over both pieces' cross_entropy_backward would run at the second, holding back the
  // first piece's GEMMs and keeping both pieces' logits alive: the pass must not form it.
  use_temp_cache();
  Tensor x = leaf({8, 16}), w = leaf({33, 16});
  const Tensor t = from_vector({3, 0, 32, 7, 7, 1, 30, 2}, {8}, DType::i32);
  Capture cap;
  std::vector<Tensor> logits;  // held, so the backward does not write its gradient over them
  const auto regions = pass_regions_with(cap, [&] {
    Tensor total;
    for (int64_t p = 0; p < 2; ++p) {
      logits.push_back(linear(narrow(x, 0, 4 * p, 4), w));
      const Tensor l = cross_entropy(logits.back(), narrow(t, 0, 4 * p, 4), -1, Reduction::sum);
      total = p == 0 ? l : add(total, l);
    }
    mul(total, 0.5).backward();
  }, "cross_entropy_backward");
  const Graph& g = cap.graph();
  ASSERT_FALSE(regions.empty()) << g.dump();
  for (const FusedRegion& r : regions) {
    int ce = 0;
    for (int oi : r.ops) ce += g.ops[size_t(oi)].name == "cross_entropy_backward";
    EXPECT_EQ(ce, 1) << region_text(g, r);
  }
}

TEST(FusedKernels, RowShapedValueMadeInARowsRegionIsRefused) {
  // Per-row losses weighted by a [rows] tensor: the weighting's mul ([rows]) is grouped with
  // cross_entropy_backward. The CPU row loop holds values of the whole space, a row's worth or
  // one scalar, not one value per row made by a pointwise op: the region is refused, not emitted
  // with a wrong index.
  use_temp_cache();
  Tensor x = leaf({6, 33}), w = leaf({6});
  const Tensor t = from_vector({3, 0, 32, 7, 7, 1}, {6}, DType::i32);
  Capture cap;
  const auto regions = pass_regions_with(
      cap, [&] { sum(mul(cross_entropy(x, t, -1, Reduction::none), w)).backward(); }, "cross_entropy_backward");
  const Graph& g = cap.graph();
  ASSERT_EQ(regions.size(), 1u) << g.dump();
  EXPECT_FALSE(cpu_emitter_supports(g, regions[0])) << region_text(g, regions[0]);
}

// The framework's symbols (blu::…) that a shared object of the kernel cache leaves undefined, one
// line each. A kernel takes nothing from the process that loads it: only an executable built to
// export its symbols (CMAKE_ENABLE_EXPORTS) would provide them, never the Python module (loaded
// RTLD_LOCAL).
std::string framework_symbols_needed() {
  std::string out;
  for (const auto& e : std::filesystem::directory_iterator(kernel_cache_dir())) {
    if (e.path().extension() != ".so") continue;
    FILE* f = ::popen(("nm -D --undefined-only " + e.path().string() + " 2>&1").c_str(), "r");
    if (!f) return "cannot run nm";
    char buf[1024];
    while (std::fgets(buf, sizeof buf, f))
      if (std::string line = buf; line.find("_ZN3blu") != std::string::npos) out += e.path().filename().string() + ": " + line;
    if (::pclose(f) != 0) out += "nm failed on " + e.path().string() + "\n";
  }
  return out;
}

TEST(FusedKernels, HalfPrecisionKernelsLoadAndEqualEager) {
  // f16 values in pointwise and rows regions: blu::f16's conversions are inline (core/dtype.h),
  // so the kernels' shared objects need no symbol of the app.
  auto half = [](const Shape& s) { return to_dtype(randn(s), DType::f16).set_requires_grad(true); };
  Tensor a = half({5, 24}), b = half({5, 24}), h = half({5, 24}), w = half({24}), bias = half({24});
  const Tensor g = to_dtype(randn({5, 24}), DType::f16);
  auto si = [&] { sum(mul(mul(silu(a), b), g)).backward(); };
  auto ln = [&] {
    Tensor xh = add(a, h);
    sum(mul(add(layer_norm(xh, w, bias, 1e-5), xh), g)).backward();
  };
  EXPECT_EQ(region_vs_eager(si, {"silu", "mul"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(si, {"mul", "silu_backward"}, RegionShape::pointwise), 0.0);
  EXPECT_EQ(region_vs_eager(ln, {"add", "layer_norm"}, RegionShape::rows), 0.0);
  EXPECT_EQ(framework_symbols_needed(), "");
}

TEST(FusedKernels, AdamWUpdateWithItsCastIsOneRegion) {
  // One parameter: the bf16 gradient's cast to fp32 and the update with its bf16 compute copy.
  use_temp_cache();
  NoGradGuard ng;
  const Tensor p0 = randn({7, 9}), m0 = mul(randn({7, 9}), 0.1), v0 = abs(mul(randn({7, 9}), 0.01));
  const Tensor gb = to_dtype(randn({7, 9}), DType::bf16), c0 = to_dtype(p0, DType::bf16);
  auto update = [&](Tensor p, Tensor m, Tensor v, Tensor c) {
    adamw_step_({{p, to_dtype(gb, DType::f32), m, v, c}}, {3e-3, 0.9, 0.95, 1e-8, 0.1, 3});
  };
  Tensor pe = clone(p0), me = clone(m0), ve = clone(v0), ce = clone(c0);
  update(pe, me, ve, ce);  // eager
  Tensor pf = clone(p0), mf = clone(m0), vf = clone(v0), cf = clone(c0);
  Capture cap;
  update(pf, mf, vf, cf);
  const Graph& g = cap.finish();
  FusedRegion r;
  r.shape = RegionShape::pointwise;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::kernel) r.ops.push_back(int(i));
  compute_region_io(g, r);
  ASSERT_EQ(r.ops.size(), 2u) << g.dump();
  ASSERT_TRUE(cpu_emitter_supports(g, r)) << region_text(g, r);
  auto k = CpuKernel::load(g, r);
  std::vector<Tensor> ins, outs;
  for (int id : r.inputs) ins.push_back(cap.tensors()[size_t(id)]);
  for (int id : r.outputs) outs.push_back(cap.tensors()[size_t(id)]);
  k->run(ins, outs, region_scalars(g, r));
  EXPECT_TRUE(same_bits(pe, pf));
  EXPECT_TRUE(same_bits(me, mf));
  EXPECT_TRUE(same_bits(ve, vf));
  EXPECT_TRUE(same_bits(ce, cf));
  EXPECT_FALSE(same_bits(p0, pf));  // it did update
  const std::string text = region_text(g, r);
  EXPECT_NE(text.find("lr=?"), std::string::npos) << text;  // lr is a kernel argument, not baked in
}

}  // namespace
}  // namespace blu::compiler
