// The fusion plan in the kernel cache (compiler/fusion_plan.h), without MLIR:
// - the plan's key leaves out the devices' indices (the graph's structure hash does not) and
//   keeps shapes, dtypes, op names, compiled-in attributes and the target; float scalars (lr)
//   stay out;
// - a plan stored for a captured graph is found again and gives the same regions with their
//   inputs and outputs; cached_fusion with no fusion pass (a build without MLIR) applies it, and
//   runs without regions, saying so, when the cache has none;
// - a plan that names an op out of range or an op that cannot be fused is refused with the reason.
#include <gtest/gtest.h>

#include <filesystem>

#include "blu/blu.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/core/error.h"

namespace blu::compiler {
namespace {

// The message of what f throws ("" when it throws nothing).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
#define EXPECT_THROW_MSG(expr, part) \
  do {                                \
    const std::string what_ = error_of([&] { (void)(expr); }); \
    EXPECT_NE(what_.find(part), std::string::npos) << "threw: '" << what_ << "'"; \
  } while (0)

void use_temp_cache(const std::string& tag) {
  const auto d = std::filesystem::temp_directory_path() / ("blu_plan_cache_" + tag + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  ::setenv("BLU_KERNEL_CACHE", d.c_str(), 1);
}

// x → mul(x, 2) → add(·, 1) → gelu: three pointwise kernel ops in a row.
Graph pointwise_chain() {
  const Tensor x = randn({4, 8});
  Capture cap;
  cap.classify(x, BufferKind::step_input);
  const Tensor y = gelu(add(mul(x, 2.0), 1.0));
  cap.classify(y, BufferKind::step_output);
  return cap.finish();
}

std::vector<int> kernel_ops(const Graph& g) {
  std::vector<int> out;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (g.ops[i].kind == OpKind::kernel && is_fusible_op(g.ops[i].name)) out.push_back(int(i));
  return out;
}

TEST(FusionPlanKey, LeavesOutDeviceIndicesKeepsShapesDtypesAttrsTarget) {
  const Graph g = pointwise_chain();
  const std::string key = fusion_plan_key(g, kCpuTarget);
  Graph moved = g;  // the same step on another device index
  for (Buffer& b : moved.buffers) b.device = Device(DeviceType::cpu, 1);
  for (Value& v : moved.values) v.device = Device(DeviceType::cpu, 1);
  EXPECT_NE(moved.structure_hash(), g.structure_hash());
  EXPECT_EQ(fusion_plan_key(moved, kCpuTarget), key);

  EXPECT_NE(fusion_plan_key(g, "cuda-sm_90a"), key);
  Graph shape = g;
  shape.values.back().shape = {8, 4};
  EXPECT_NE(fusion_plan_key(shape, kCpuTarget), key);
  Graph dtype = g;
  dtype.values.back().dtype = DType::bf16;
  EXPECT_NE(fusion_plan_key(dtype, kCpuTarget), key);
  Graph name = g;
  name.ops.back().name = "silu";
  EXPECT_NE(fusion_plan_key(name, kCpuTarget), key);
  // A compiled-in int attribute changes the key; a float scalar (a kernel argument) does not.
  Graph attr = g, scalar = g;
  attr.ops.back().attrs.set("approximate_int", int64_t(1));
  EXPECT_NE(fusion_plan_key(attr, kCpuTarget), key);
  const int mul_op = kernel_ops(g).at(0);
  bool had_float = false;
  for (const auto& [k, v] : g.ops[size_t(mul_op)].attrs.items())
    if (std::holds_alternative<double>(v)) {
      scalar.ops[size_t(mul_op)].attrs.set(k, 3.0);
      had_float = true;
    }
  ASSERT_TRUE(had_float) << g.dump();
  EXPECT_EQ(fusion_plan_key(scalar, kCpuTarget), key);
}

TEST(FusionPlanCache, StoredPlanIsFoundAndAppliedWithoutAPass) {
  use_temp_cache("store");
  const Graph g = pointwise_chain();
  const std::vector<int> ops = kernel_ops(g);
  ASSERT_GE(ops.size(), 3u) << g.dump();
  FusedRegion r;
  r.ops = {ops[0], ops[1], ops[2]};
  r.bytes_saved = 256;
  compute_region_io(g, r);

  std::vector<std::string> log;
  const FusionFn no_pass = cached_fusion({}, [&](const std::string& s) { log.push_back(s); });
  EXPECT_TRUE(no_pass(g).empty());
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("none in the cache and no fusion pass"), std::string::npos) << log[0];

  store_fusion_plan(g, kCpuTarget, {r});
  const std::vector<FusedRegion> got = no_pass(g);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].ops, r.ops);
  EXPECT_EQ(got[0].inputs, r.inputs);
  EXPECT_EQ(got[0].outputs, r.outputs);
  EXPECT_EQ(got[0].bytes_saved, 256);
  EXPECT_NE(log.back().find("from the cache, 1 regions"), std::string::npos) << log.back();

  // Applied: one fused op replaces the three, and its kernel equals the eager ops.
  const FusedGraph f = fuse_step(g, got);
  EXPECT_EQ(f.regions.size(), 1u) << f.summary();
  EXPECT_EQ(f.graph.ops.size(), g.ops.size() - 2) << f.summary();

  // A pass, when there is one, is not asked when the plan is cached.
  int calls = 0;
  const FusionFn with_pass = cached_fusion([&](const Graph&) {
    ++calls;
    return std::vector<FusedRegion>{};
  });
  EXPECT_EQ(with_pass(g).size(), 1u);
  EXPECT_EQ(calls, 0);
}

TEST(FusionPlanCache, APlanThatDoesNotFitIsRefused) {
  const Graph g = pointwise_chain();
  const std::string head = "blu-fusion-plan 1\nstructure 0\n";
  EXPECT_THROW_MSG(parse_fusion_plan(g, head + "region pointwise 8 0 999\n"), "expected an op index below");
  int not_fusible = -1;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (!is_fusible_op(g.ops[i].name) || g.ops[i].kind != OpKind::kernel) not_fusible = int(i);
  if (not_fusible >= 0)
    EXPECT_THROW_MSG(parse_fusion_plan(g, head + "region pointwise 8 " + std::to_string(not_fusible) + "\n"),
                     "expected a fusible kernel op");
  EXPECT_THROW_MSG(parse_fusion_plan(g, "something else\n"), "expected the header");
  EXPECT_THROW_MSG(fusion_for("maybe"), "expected on or off");
  EXPECT_FALSE(bool(fusion_for("off")));
}

}  // namespace
}  // namespace blu::compiler
