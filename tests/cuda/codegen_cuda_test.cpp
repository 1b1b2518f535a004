// NVRTC kernels for fused regions (compiler/codegen/cuda_kernel.h, cuda_module.h):
// - every region kind's emitted CUDA C compiles with NVRTC for sm_90a (no GPU needed: this runs on
//   the build machine as well);
// - on the GPU, each region kind against the eager CUDA kernels on the same inputs, fp32 and bf16:
//   pointwise chains and AdamW bitwise (same formulas, same rounding points, no contraction), row
//   regions within a stated tolerance (statistics summed in double over a block tree, not eager's
//   order): fp32 2e-5 relative to the output's largest magnitude, bf16 one bf16 ulp (2^-7 relative);
//   the norm backwards' weight and bias gradients (column sums over the blocks' partial rows) too;
// - the kernel cache: a second load of the same region hits it, with no NVRTC call;
// - the bf16 tiny GPT-2 step compiled with fused CUDA regions against the eager step.
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='CudaCodegen*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <sstream>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/codegen/cuda_module.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/codegen/region_check.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/fused_step.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/ops/fused.h"
#include "blu/ops/optim.h"
#include "common/tiny_gpt.h"
#include "cuda/cuda_test_util.h"

namespace blu::compiler {
namespace {

using test::kGPU;

void use_temp_cache() {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("blu_kernel_cache_cuda_" + std::to_string(::getpid()));
    std::filesystem::remove_all(d);
    return d.string();
  }();
  ::setenv("BLU_KERNEL_CACHE", dir.c_str(), 1);
}

Tensor leaf(const Shape& s, DType t, Device d) { return to_device(to_dtype(randn(s), t), d).set_requires_grad(true); }

// One region-kind case: f records forward and backward; `names` picks the region's ops (each the
// next kernel op of that name; "-name" passes the next op of that name without taking it);
// `exact`: the arithmetic order is eager's.
struct Case {
  std::string name;
  std::vector<std::string> ops;
  RegionShape shape;
  bool exact;
};

struct Recorded {
  std::unique_ptr<Capture> cap;
  FusedRegion r;
};

// The cases over inputs on `dev` in dtype t; `run` gets each case and its recorded region.
void for_each_case(DType t, Device dev, bool run_eager, const std::function<void(const Case&, Capture&, const FusedRegion&)>& fn) {
  manual_seed(11);
  Tensor x = leaf({6, 40}, t, dev), h = leaf({6, 40}, t, dev), w = leaf({40}, t, dev), b = leaf({40}, t, dev);
  Tensor g = to_device(to_dtype(randn({6, 40}), t), dev);
  Tensor tg = to_device(from_vector({3, 0, 39, 7, 7, 1}, {6}, DType::i32), dev);
  Tensor mask = to_device(gt(randn({6, 40}), 0.0), dev);
  struct Fn {
    std::function<void()> f;
    std::vector<Case> cases;
  };
  std::vector<Fn> fns = {
      {[&] { sum(mul(mul(gelu(add(x, h), true), w), g)).backward(); },
       {{"add+gelu+mul", {"add", "gelu", "mul"}, RegionShape::pointwise, true},
        {"mul+gelu_backward", {"mul", "gelu_backward"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(mul(silu(x), h), g)).backward(); },
       {{"silu+mul", {"silu", "mul"}, RegionShape::pointwise, true},
        {"mul+silu_backward", {"mul", "silu_backward"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(add(swiglu(x, h), x), g)).backward(); },
       {{"swiglu+add", {"swiglu", "add"}, RegionShape::pointwise, true},
        {"mul+swiglu_backward", {"mul", "swiglu_backward"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(where(mask, mul(exp(x), 0.5), h), g)).backward(); },
       {{"exp+mul_scalar+where", {"exp", "mul_scalar", "where"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(where(lt(exp(x), h), x, mul(h, 2.0)), g)).backward(); },
       {{"exp+lt+where", {"exp", "lt", "where"}, RegionShape::pointwise, true},
        {"lt (bool out)", {"lt"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(layer_norm(add(x, h), w, b, 1e-5), g)).backward(); },
       {{"add+layer_norm", {"add", "layer_norm"}, RegionShape::rows, false}}},
      {[&] { sum(mul(rms_norm(add(x, h), w, 1e-6), g)).backward(); },
       {{"add+rms_norm", {"add", "rms_norm"}, RegionShape::rows, false}}},
      {[&] { sum(mul(add(x, layer_norm(x, w, b, 1e-5)), g)).backward(); },
       {{"layer_norm_backward", {"layer_norm_backward"}, RegionShape::rows, false},
        {"mul+layer_norm_backward (residual folded)", {"-mul", "mul", "layer_norm_backward"}, RegionShape::rows, false}}},
      {[&] { sum(mul(add(x, rms_norm(x, w, 1e-6)), g)).backward(); },
       {{"mul+rms_norm_backward (residual folded)", {"-mul", "mul", "rms_norm_backward"}, RegionShape::rows, false}}},
      {[&] { sum(mul(clamp(mul(x, 2.0), -1.0, 1.0), g)).backward(); },
       {{"mul+clamp_backward", {"-mul_scalar", "-mul", "mul", "clamp_backward"}, RegionShape::pointwise, true}}},
      {[&] { sum(gelu_linear(x, leaf({8, 40}, t, dev))).backward(); },
       {{"gelu_and_backward", {"gelu_and_backward"}, RegionShape::pointwise, true}}},
      {[&] { sum(mul(log_softmax(mul(x, 0.25), -1), g)).backward(); },
       {{"mul_scalar+log_softmax", {"mul_scalar", "log_softmax"}, RegionShape::rows, false},
        {"log_softmax_backward+mul_scalar", {"log_softmax_backward", "mul_scalar"}, RegionShape::rows, false}}},
      {[&] { sum(mul(softmax(mul(x, 0.25), -1), g)).backward(); },
       {{"mul_scalar+softmax", {"mul_scalar", "softmax"}, RegionShape::rows, false},
        {"softmax_backward+mul_scalar", {"softmax_backward", "mul_scalar"}, RegionShape::rows, false}}},
      {[&] {
         Tensor l = cross_entropy(x, tg, -100, Reduction::none);
         sum(mul(l, to_device(to_dtype(randn({6}), l.dtype()), dev))).backward();
       },
       {{"cross_entropy(none)", {"cross_entropy"}, RegionShape::rows, false},
        {"cross_entropy_backward(none)+cast", {"cross_entropy_backward"}, RegionShape::rows, false}}},
      {[&] { mul(cross_entropy(x, tg, -100, Reduction::sum), 0.5).backward(); },
       {{"mul_scalar+cross_entropy_backward(sum)", {"-mul_scalar", "mul_scalar", "cross_entropy_backward"}, RegionShape::rows, false}}},
  };
  for (Fn& f : fns) {
    // Fresh leaves: a capture leaves unbacked .grad tensors behind, which the next backward reads.
    x = leaf({6, 40}, t, dev), h = leaf({6, 40}, t, dev), w = leaf({40}, t, dev), b = leaf({40}, t, dev);
    auto cap = std::make_unique<Capture>();
    f.f();
    cap->finish();
    if (run_eager) Runtime::run_unplanned(*cap);
    const Graph& gr = cap->graph();
    for (const Case& c : f.cases) {
      FusedRegion r;
      r.index = 0;
      r.shape = c.shape;
      size_t at = 0;
      for (const std::string& name : c.ops) {
        const bool pass = name[0] == '-';
        const std::string n = pass ? name.substr(1) : name;
        while (at < gr.ops.size() && !(gr.ops[at].kind == OpKind::kernel && gr.ops[at].name == n)) ++at;
        ASSERT_LT(at, gr.ops.size()) << "no op " << n << " in\n" << gr.dump();
        if (!pass) r.ops.push_back(int(at));
        ++at;
      }
      compute_region_io(gr, r);
      fn(c, *cap, r);
    }
  }
}

TEST(CudaCodegen, NvrtcCompilesEveryRegionKindForSm90a) {
  use_temp_cache();
  for (DType t : {DType::f32, DType::bf16}) {
    for_each_case(t, kCPU, false, [&](const Case& c, Capture& cap, const FusedRegion& r) {
      const Graph& g = cap.graph();
      ASSERT_TRUE(cuda_emitter_supports(g, r)) << c.name << "\n" << region_text(g, r);
      bool compiled = false;
      CacheEntry cubin;
      EXPECT_NO_THROW(cubin = build_cuda_kernel(g, r, "sm_90a", &compiled)) << c.name << "\n" << emit_cuda_source(g, r);
      EXPECT_TRUE(std::filesystem::exists(cubin.path)) << c.name;
      EXPECT_FALSE(cubin.bytes.empty()) << c.name;
    });
  }
}

// Largest |a - b| over two tensors (any device), and the largest |b|.
std::pair<double, double> diff(const Tensor& a, const Tensor& b) {
  const Tensor x = contiguous(to_dtype(to_device(a, kCPU), DType::f64)), y = contiguous(to_dtype(to_device(b, kCPU), DType::f64));
  double worst = 0, mag = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double p = x.data<double>()[i], q = y.data<double>()[i];
    const double d = std::isnan(p) && std::isnan(q) ? 0.0 : std::abs(p - q);
    if (!(d <= worst)) worst = d;
    mag = std::max(mag, std::abs(q));
  }
  return {worst, mag};
}

TEST(CudaCodegen, EachRegionKindAgainstEagerKernels) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  use_temp_cache();
  for (DType t : {DType::f32, DType::bf16}) {
    for_each_case(t, kGPU, true, [&](const Case& c, Capture& cap, const FusedRegion& r) {
      NoGradGuard ng;
      const Graph& g = cap.graph();
      ASSERT_TRUE(cuda_emitter_supports(g, r)) << c.name;
      auto k = CudaKernel::load(g, r);
      std::vector<Tensor> ins;
      for (int v : r.inputs) ins.push_back(cap.tensors()[size_t(v)]);
      const std::vector<Tensor> eager = run_region_eager(g, r, ins);
      std::vector<Tensor> outs;
      for (int v : r.outputs) outs.push_back(empty(g.values[size_t(v)].shape, g.values[size_t(v)].dtype, kGPU));
      k->run(ins, outs, region_scalars(g, r), nullptr);
      BLU_CUDA_CHECK(cudaDeviceSynchronize());
      for (size_t j = 0; j < outs.size(); ++j) {
        const auto [d, mag] = diff(outs[j], eager[j]);
        const double tol = c.exact ? 0.0 : (t == DType::f32 ? 2e-5 : 1.0 / 128) * std::max(mag, 1.0);
        EXPECT_LE(d, tol) << c.name << " " << dtype_name(t) << " output " << j << ": max |diff| " << d;
        std::cout << "[ cuda codegen ] " << c.name << " " << dtype_name(t) << " output " << j << ": max |diff| " << d << "\n";
      }
    });
  }
}

TEST(CudaCodegen, AdamWWithCopiesBitwise) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  use_temp_cache();
  NoGradGuard ng;
  manual_seed(3);
  Tensor p = to_device(randn({1000}), kGPU), gr = to_device(randn({1000}), kGPU);
  Tensor m = to_device(mul(randn({1000}), 0.1), kGPU), v = to_device(mul(abs(randn({1000})), 0.01), kGPU);
  Tensor copy = to_device(to_dtype(randn({1000}), DType::bf16), kGPU);
  Capture cap;
  adamw_step_({AdamWTensors{p, gr, m, v, copy}}, AdamWStepArgs{3e-3, 0.9, 0.95, 1e-8, 0.1, 7});
  cap.finish();
  const Graph& g = cap.graph();
  FusedRegion r;
  r.index = 0;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::kernel) r.ops.push_back(int(i));
  compute_region_io(g, r);
  ASSERT_TRUE(cuda_emitter_supports(g, r)) << region_text(g, r);
  auto k = CudaKernel::load(g, r);
  std::vector<Tensor> a, b;
  for (int v2 : r.inputs) a.push_back(clone(cap.tensors()[size_t(v2)])), b.push_back(clone(cap.tensors()[size_t(v2)]));
  run_region_eager(g, r, a);  // updates a in place with the eager kernel
  k->run(b, {}, region_scalars(g, r), nullptr);
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  for (size_t j = 0; j < a.size(); ++j) EXPECT_EQ(diff(a[j], b[j]).first, 0.0) << "input " << j;
}

TEST(CudaCodegen, SecondLoadHitsTheCacheWithoutNvrtc) {
  use_temp_cache();
  NoGradGuard ng;
  Tensor x = randn({64, 32}), y = randn({64, 32});
  Capture cap;
  gelu(add(mul(x, y), x), true);
  cap.finish();
  const Graph& g = cap.graph();
  FusedRegion r;
  r.index = 0;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::kernel) r.ops.push_back(int(i));
  compute_region_io(g, r);
  bool compiled = false;
  const CacheEntry c1 = build_cuda_kernel(g, r, "sm_90a", &compiled);
  const int calls = nvrtc_compile_count();
  const CacheEntry c2 = build_cuda_kernel(g, r, "sm_90a", &compiled);
  EXPECT_FALSE(compiled);
  EXPECT_EQ(nvrtc_compile_count(), calls) << "a cache hit must not call NVRTC";
  EXPECT_EQ(c1.path, c2.path);
  EXPECT_EQ(c1.bytes, c2.bytes);
  // Another architecture is another entry.
  build_cuda_kernel(g, r, "sm_80", &compiled);
  EXPECT_TRUE(compiled);
  EXPECT_EQ(nvrtc_compile_count(), calls + 1);
}

// Every op of the step that the CUDA emitter covers as a region of its own: the fusion pass's
// stand-in where MLIR is not built (the GPU machine), so every CUDA kernel shape of the step runs.
std::vector<FusedRegion> single_op_regions(const Graph& g) {
  std::vector<FusedRegion> out;
  for (size_t i = 0; i < g.ops.size(); ++i) {
    if (g.ops[i].kind != OpKind::kernel || !is_fusible_op(g.ops[i].name)) continue;
    FusedRegion r;
    r.index = int(out.size());
    r.shape = op_class(g.ops[i].name) == OpClass::row ? RegionShape::rows : RegionShape::pointwise;
    r.ops = {int(i)};
    compute_region_io(g, r);
    if (!r.outputs.empty() || g.ops[i].name == "adamw_step") out.push_back(std::move(r));
  }
  return out;
}

TEST(CudaCodegen, Bf16Gpt2FusedStepMatchesEager) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  use_temp_cache();
  auto train = [](bool fused, int* fused_launches) {
    manual_seed(5);
    cuda::Stream stream;
    Workspace ws(kGPU);
    ExecContextGuard ctx(ExecContext{kGPU, stream.get(), &ws});
    models::GPT model(test::tiny_gpt(), 7);
    model.to(kGPU);
    model.set_compute_dtype(DType::bf16);
    dist::Strategy strat(model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
    const int64_t B = 2, T = 16;
    Tensor idx = empty({B, T}, DType::i32, kGPU), tg = empty({B, T}, DType::i32, kGPU);
    std::ostringstream log;
    CompileOptions o;
    o.log = true;
    o.log_stream = &log;
    o.fusion = single_op_regions;
    CompiledStep cs(o);
    std::vector<double> losses;
    for (int s = 0; s < 6; ++s) {
      {
        NoGradGuard ng;
        copy_(idx, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
        copy_(tg, to_device(randint(0, 101, {B, T}, DType::i32, kCPU), kGPU));
      }
      dist::StepValues v;
      auto step = [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 3e-3, 1.0); };
      if (fused) cs.run({idx, tg}, step);
      else step();
      losses.push_back(strat.read(v, false).loss);
    }
    if (fused && !cs.variants().empty())
      for (const Launch& l : cs.variants()[0]->runtime->launches()) *fused_launches += l.kind == OpKind::fused;
    std::cout << log.str().substr(0, 2000);
    return losses;
  };
  int n = 0;
  const std::vector<double> eager = train(false, &n);
  const std::vector<double> fused = train(true, &n);
  EXPECT_GE(n, 10) << "fused CUDA launches in the compiled step";
  // Pointwise and AdamW regions are bitwise; norm, softmax and cross-entropy rows sum in another
  // order: bf16 losses agree to 1e-2 over six steps.
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_NEAR(eager[i], fused[i], 1e-2) << "step " << i + 1;
}

}  // namespace
}  // namespace blu::compiler
