// The MLIR half of the compiler on the CPU: a step recorded by compiler::Capture translates to a `blu` module
// that round-trips (print → parse → verify → print, equal text); the fusion pass groups a residual
// add with the layer norm after it and keeps a GEMM out; fused CPU kernels equal eager bitwise
// (f32: the same arithmetic in the same order), and a second load is a kernel-cache hit.
#include <gtest/gtest.h>

#include <cmath>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/codegen/region_check.h"
#include "blu/compiler/mlir/mlir_api.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu::compiler {
namespace {

// The graph of f's ops on real inputs, recorded by compiler::Capture (no kernel runs).
Graph capture_graph(const std::function<void()>& f) {
  Capture cap;
  f();
  return cap.finish();
}

// Fresh cache per test binary run, so "cold" is cold.
void use_temp_cache() {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("blu_kernel_cache_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(d);
    return d.string();
  }();
  ::setenv("BLU_KERNEL_CACHE", dir.c_str(), 1);
}

// The region of all kernel ops of g.
FusedRegion whole(const Graph& g, RegionShape shape) {
  FusedRegion r;
  r.index = 0;
  r.shape = shape;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::kernel) r.ops.push_back(int(i));
  compute_region_io(g, r);
  return r;
}

// Captures f on inputs, fuses all of its ops into one region and checks fused == eager.
double fused_vs_eager(const std::vector<Tensor>& ins, const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      RegionShape shape = RegionShape::pointwise) {
  use_temp_cache();
  NoGradGuard ng;
  Capture cap;
  Tensor y = f(ins);
  const Graph& g = cap.finish();
  FusedRegion r = whole(g, shape);
  EXPECT_TRUE(cpu_emitter_supports(g, r)) << region_text(g, r);
  auto k = CpuKernel::load(g, r);
  std::vector<Tensor> region_ins;
  for (int v : r.inputs) region_ins.push_back(cap.tensors()[size_t(v)]);
  return check_region(g, r, *k, region_ins);
}

TEST(MlirCompiler, BluModuleRoundTrips) {
  NoGradGuard ng;
  Tensor x = randn({4, 8}), w = randn({8, 8}), lw = randn({8}), lb = randn({8});
  Tensor y;
  Graph g = capture_graph([&] { y = layer_norm(add(matmul(x, w), x), lw, lb, 1e-5); });
  const std::string text = mlir_api::to_blu(g);
  EXPECT_NE(text.find("blu.library_call \"matmul\""), std::string::npos) << text;
  EXPECT_NE(text.find("blu.add"), std::string::npos) << text;
  EXPECT_NE(text.find("blu.row_reduce \"layer_norm\""), std::string::npos) << text;
  EXPECT_EQ(mlir_api::round_trip(text), text);
  // A module that does not verify is refused with MLIR's diagnostic.
  std::string bad = text;
  bad.replace(bad.find("blu.add"), 7, "blu.nope");
  EXPECT_THROW(mlir_api::round_trip(bad), Error);
}

TEST(MlirCompiler, FusionGroupsResidualAddWithLayerNormNotTheGemm) {
  NoGradGuard ng;
  Tensor x = randn({4, 8}), w = randn({8, 8}), lw = randn({8}), lb = randn({8});
  Tensor z;
  Graph g = capture_graph([&] {
    Tensor y = layer_norm(add(matmul(x, w), x), lw, lb, 1e-5);
    z = gelu(mul(y, y));
  });
  auto regions = mlir_api::fuse(g);
  ASSERT_EQ(regions.size(), 1u);
  const FusedRegion& r = regions[0];
  EXPECT_EQ(r.shape, RegionShape::rows);
  std::vector<std::string> names;
  for (int oi : r.ops) names.push_back(g.ops[size_t(oi)].name);
  EXPECT_EQ(names, (std::vector<std::string>{"add", "layer_norm", "mul", "gelu"}));
  // The per-op opt-out keeps gelu out.
  mlir_api::FusionOptions opt;
  opt.no_fuse = {"gelu"};
  auto r2 = mlir_api::fuse(g, opt);
  ASSERT_EQ(r2.size(), 1u);
  EXPECT_EQ(r2[0].ops.size(), 3u);
}

TEST(MlirCompiler, FusedPointwiseOpsEqualEagerBitwise) {
  Tensor a = randn({6, 10}), b = randn({6, 10}), row = randn({10}), pos = add(mul(randn({6, 10}), randn({6, 10})), 3.0);
  using F = std::function<Tensor(const std::vector<Tensor>&)>;
  const std::vector<std::pair<const char*, F>> cases = {
      {"neg", [](auto& v) { return neg(v[0]); }},
      {"exp", [](auto& v) { return exp(v[0]); }},
      {"tanh", [](auto& v) { return tanh(v[0]); }},
      {"sigmoid", [](auto& v) { return sigmoid(v[0]); }},
      {"relu", [](auto& v) { return relu(v[0]); }},
      {"gelu", [](auto& v) { return gelu(v[0]); }},
      {"gelu_tanh", [](auto& v) { return gelu(v[0], true); }},
      {"add", [](auto& v) { return add(v[0], v[1]); }},
      {"mul_broadcast_row", [](auto& v) { return mul(v[0], v[2]); }},
      {"chain", [](auto& v) { return gelu(add(mul(v[0], v[1]), v[2])); }},
  };
  for (const auto& [name, f] : cases) {
    SCOPED_TRACE(name);
    EXPECT_EQ(fused_vs_eager({a, b, row}, f), 0.0);
  }
  EXPECT_EQ(fused_vs_eager({abs(pos)}, [](auto& v) { return sqrt(log(v[0])); }), 0.0);
}

TEST(MlirCompiler, FusedComparisonsEqualEagerBitwise) {
  // Each comparison feeding where, NaN and infinities among the inputs, and a comparison's bool as
  // the region's output (against a broadcast row); in f32, bf16 and f64.
  Tensor a = randn({6, 10}), b = randn({6, 10}), row = randn({10});
  for (int64_t i : {3, 17, 41}) a.data<float>()[i] = NAN;
  a.data<float>()[5] = INFINITY;
  b.data<float>()[5] = INFINITY;
  b.data<float>()[29] = a.data<float>()[29];
  // Every comparison in one region, each choosing through its own where.
  auto all = [](auto& v) {
    const Tensor b2 = mul(v[1], 2.0);
    Tensor y = add(where(eq(v[0], v[1]), v[0], b2), where(ne(v[0], v[1]), v[0], b2));
    y = add(y, add(where(lt(v[0], v[1]), v[0], b2), where(le(v[0], v[1]), v[0], b2)));
    return add(y, add(where(gt(v[0], v[2]), v[0], b2), where(ge(exp(v[0]), v[2]), v[0], v[1])));
  };
  auto bool_out = [](auto& v) { return gt(add(v[0], v[1]), v[2]); };
  for (DType t : {DType::f32, DType::bf16, DType::f64}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const std::vector<Tensor> ins = {to_dtype(a, t), to_dtype(b, t), to_dtype(row, t)};
    EXPECT_EQ(fused_vs_eager(ins, all), 0.0);
    EXPECT_EQ(fused_vs_eager(ins, bool_out), 0.0);
  }
  // The fp16 loss scaler's update (optim/loss_scaler.cpp): f64 scalars, a finiteness test and the
  // growth interval's, each choosing through where.
  const Tensor sq = full({}, 3.5, DType::f64), scale = full({}, 1024.0, DType::f64), good = full({}, 7.0, DType::f64);
  const Tensor inf = full({}, INFINITY, DType::f64), interval = full({}, 8.0, DType::f64), zero = zeros({}, DType::f64);
  for (const Tensor& s : {sq, full({}, INFINITY, DType::f64), full({}, NAN, DType::f64)}) {
    EXPECT_EQ(fused_vs_eager({s, scale, inf}, [](auto& v) {
      return where(lt(abs(v[0]), v[2]), v[1], mul(v[1], 0.5));
    }), 0.0);
  }
  EXPECT_EQ(fused_vs_eager({good, interval, scale, zero}, [](auto& v) {
    const Tensor grown = add(v[0], 1.0);
    const Tensor at = ge(grown, v[1]);
    return add(where(at, mul(v[2], 2.0), v[2]), where(at, v[3], grown));
  }), 0.0);
}

TEST(MlirCompiler, FusedCastChainEqualsEagerBitwise) {
  // bf16 in, f32 compute, bf16 out: each intermediate rounds to its dtype as eager stores it.
  Tensor a = to_dtype(randn({5, 12}), DType::bf16);
  EXPECT_EQ(fused_vs_eager({a}, [](auto& v) { return to_dtype(gelu(to_dtype(v[0], DType::f32)), DType::bf16); }), 0.0);
}

TEST(MlirCompiler, FusedResidualLayerNormEqualsEagerBitwise) {
  Tensor x = randn({7, 48}), h = randn({7, 48}), w = randn({48}), b = randn({48});
  EXPECT_EQ(fused_vs_eager({x, h, w, b}, [](auto& v) { return layer_norm(add(v[0], v[1]), v[2], v[3], 1e-5); },
                           RegionShape::rows),
            0.0);
}

TEST(MlirCompiler, SecondLoadIsACacheHitAndTheCheckCanFail) {
  use_temp_cache();
  NoGradGuard ng;
  Tensor a = randn({3, 5});
  Tensor y;
  Graph g = capture_graph([&] { y = exp(mul(a, a)); });
  FusedRegion r = whole(g, RegionShape::pointwise);
  bool compiled = false;
  auto k1 = CpuKernel::load(g, r, &compiled);
  EXPECT_TRUE(compiled);
  auto k2 = CpuKernel::load(g, r, &compiled);
  EXPECT_FALSE(compiled);
  EXPECT_EQ(check_region(g, r, *k2, {a}), 0.0);
  // A region whose text differs (another attribute) misses.
  g.ops[1].attrs.set("dummy", int64_t(1));
  CpuKernel::load(g, r, &compiled);
  EXPECT_TRUE(compiled);
  // The check sees a wrong kernel: the exp region's kernel checked against a region of neg.
  Graph g2 = g;
  g2.ops[1].name = "neg";
  EXPECT_GT(check_region(g, r, *CpuKernel::load(g2, r), {a}), 0.0);
}

}  // namespace
}  // namespace blu::compiler
