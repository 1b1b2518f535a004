// The fusion plan in the kernel cache (compiler/fusion_plan.h), without MLIR:
// - the plan's key leaves out the devices' indices (the graph's structure hash does not) and
//   keeps shapes, dtypes, op names, compiled-in attributes and the target; float scalars (lr)
//   stay out;
// - a plan stored for a captured graph is found again and gives the same regions with their
//   inputs and outputs; cached_fusion with no fusion pass (a build without MLIR) applies it, and
//   runs without regions, saying so, when the cache has none;
// - a plan that names an op out of range or an op that cannot be fused is refused with the reason;
// - the portable text of whole training steps (tiny GPT-2 and Llama: forward, backward, AdamW) reads
//   back as a graph with the same text and key, on CPU and CUDA devices; damaged text is refused
//   with the line and the field; a graph exported on a miss, planned from its parsed copy, is the
//   plan the capturing side then finds.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "blu/blu.h"
#include "blu/compiler/capture.h"
#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/core/error.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/models/llama/llama.h"
#include "common/tiny_gpt.h"

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
  r.bytes_saved = 123456789;  // more digits than a stream's default 6: stored exactly
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
  EXPECT_EQ(got[0].bytes_saved, 123456789);
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

// Bytes damaged on disk after an entry was stored (a flipped bit, a truncation) are a miss with a
// line on stderr, and storing the entry again repairs it; an entry with no sum file still loads.
TEST(KernelCache, ADamagedArtefactIsAMissAndIsMadeAgain) {
  use_temp_cache("sum");
  const std::string key = kernel_cache_key("region text", "cpu-test", "toolchain 1");
  const std::string bytes(4096, 'k');
  const std::string path = kernel_cache_store(key, "so", bytes, "region text");
  // A hit hands back the path and the bytes it checked.
  const auto hit_path = [&] {
    const std::optional<CacheEntry> e = kernel_cache_find(key, "so", "region text");
    if (e) EXPECT_EQ(e->bytes, bytes);
    return e ? e->path : std::string("(a miss)");
  };
  ASSERT_EQ(hit_path(), path);
  EXPECT_FALSE(kernel_cache_find(key, "so", "another region"));
  auto overwrite = [&](const std::string& with) { std::ofstream(path, std::ios::binary | std::ios::trunc) << with; };
  std::string flipped = bytes;
  flipped[1234] ^= 0x10;
  overwrite(flipped);
  testing::internal::CaptureStderr();
  EXPECT_FALSE(kernel_cache_find(key, "so", "region text"));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("kernel cache: " + path + " does not match " + key + ".sum"), std::string::npos) << err;
  overwrite(bytes.substr(0, 100));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(kernel_cache_find(key, "so", "region text"));
  testing::internal::GetCapturedStderr();
  EXPECT_EQ(kernel_cache_store(key, "so", bytes, "region text"), path);
  EXPECT_EQ(hit_path(), path);
  std::filesystem::remove(std::filesystem::path(path).replace_extension("sum"));
  EXPECT_EQ(hit_path(), path);

  // A damaged plan: the pass makes it again and stores it over the damaged one.
  const Graph g = pointwise_chain();
  const std::vector<int> ops = kernel_ops(g);
  FusedRegion r;
  r.ops = {ops[0], ops[1]};
  store_fusion_plan(g, kCpuTarget, {r});
  const std::string plan = kernel_cache_dir() + "/" + fusion_plan_key(g, kCpuTarget) + ".plan";
  ASSERT_TRUE(std::filesystem::exists(plan));
  std::ofstream(plan, std::ios::app) << "region pointwise 8 " << ops[2] << "\n";
  int calls = 0;
  const FusionFn with_pass = cached_fusion([&](const Graph&) {
    ++calls;
    return std::vector<FusedRegion>{r};
  }, {}, kCpuTarget);
  testing::internal::CaptureStderr();
  EXPECT_EQ(with_pass(g).size(), 1u);
  EXPECT_NE(testing::internal::GetCapturedStderr().find(".plan does not match"), std::string::npos);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(with_pass(g).size(), 1u);
  EXPECT_EQ(calls, 1);
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
  const std::vector<int> ops = kernel_ops(g);
  ASSERT_GE(ops.size(), 2u);
  const std::string a = std::to_string(ops[0]), b = std::to_string(ops[1]);
  EXPECT_THROW_MSG(parse_fusion_plan(g, head + "region pointwise 8 " + b + " " + a + "\n"),
                   "names op " + a + " after op " + b + ", expected its ops in schedule order, each once");
  EXPECT_THROW_MSG(parse_fusion_plan(g, head + "region pointwise 8 " + a + " " + a + "\n"), "in schedule order, each once");
  EXPECT_THROW_MSG(parse_fusion_plan(g, head + "region pointwise 8 " + a + "\nregion pointwise 8 " + a + " " + b + "\n"),
                   "region 1 names op " + a + ", which region 0 holds already");
  EXPECT_EQ(parse_fusion_plan(g, head + "region pointwise 8 " + a + " " + b + "\n").size(), 1u);
  EXPECT_THROW_MSG(fusion_for("maybe"), "expected on or off");
  EXPECT_FALSE(bool(fusion_for("off")));
}

// The second training step of a tiny model (the first, eager, makes AdamW's moments), captured.
Graph training_step(const std::string& family) {
  std::unique_ptr<models::CausalLM> model;
  if (family == "gpt2") model = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 7);
  else model = std::make_unique<models::Llama>(models::LlamaConfig::preset("tiny"), 7);
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  const Tensor idx = randint(0, 101, {2, 8}, DType::i32), tg = randint(0, 101, {2, 8}, DType::i32);
  auto step = [&] { strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, tg}; }, 3e-3, 1.0); };
  step();
  Capture cap;
  cap.classify(idx, BufferKind::step_input);
  cap.classify(tg, BufferKind::step_input);
  step();
  return cap.finish();
}

// text with every " cpu" device field made " cuda": the same step as a CUDA capture writes it.
std::string as_cuda(std::string text) {
  for (size_t at = text.find(" cpu"); at != std::string::npos; at = text.find(" cpu", at + 5)) text.replace(at, 4, " cuda");
  return text;
}

TEST(PortableGraph, TrainingStepsReadBackWithTheSameTextAndKey) {
  for (const std::string family : {"gpt2", "llama"}) {
    const Graph g = training_step(family);
    ASSERT_GT(g.ops.size(), 100u) << family;
    const std::string text = portable_graph_text(g);
    const Graph back = parse_portable_graph_text(text, family);
    EXPECT_EQ(portable_graph_text(back), text) << family;
    EXPECT_EQ(fusion_plan_key(back, kCpuTarget), fusion_plan_key(g, kCpuTarget)) << family;
    ASSERT_EQ(back.ops.size(), g.ops.size());
    ASSERT_EQ(back.values.size(), g.values.size());
    for (size_t i = 0; i < g.ops.size(); ++i) {
      EXPECT_EQ(back.ops[i].name, g.ops[i].name);
      EXPECT_EQ(back.ops[i].rng, g.ops[i].rng) << family << " op " << i << " " << g.ops[i].name;
      EXPECT_EQ(back.ops[i].writes, g.ops[i].writes);
    }
    // Every kind of attribute came back: the graphs hold shapes, dtypes, bools and ints.
    std::set<size_t> kinds;
    for (const Op& op : back.ops)
      for (const auto& [k, v] : op.attrs.items()) kinds.insert(v.index());
    EXPECT_GE(kinds.size(), 4u) << family;

    const std::string cuda = as_cuda(text);
    ASSERT_NE(cuda, text);
    const Graph on_gpu = parse_portable_graph_text(cuda, family + " (cuda)");
    EXPECT_EQ(portable_graph_text(on_gpu), cuda);
    EXPECT_TRUE(on_gpu.values.front().device.is_cuda());
  }
}

TEST(PortableGraph, DamagedTextIsRefusedWithTheLineAndTheField) {
  const std::string text = portable_graph_text(pointwise_chain());
  const size_t o_at = text.find("\no ") + 1;
  const std::string first_o = text.substr(o_at, text.find('\n', o_at) - o_at);
  const int line_of_v = int(std::count(text.begin(), text.begin() + std::ptrdiff_t(text.find("\nv ")), '\n')) + 2;
  // The first line of a record kind replaced, and what the error says. The later cases are ids,
  // positions and layouts that would send a pass reading the graph outside its arrays or buffers.
  const struct {
    char tag;
    std::string line, error;
  } damaged[] = {
      {'v', "v 999 [4] [1] 0 f32 cpu -1",
       "g.graph:" + std::to_string(line_of_v) + ": expected the value's buffer in [0, 4), got '999 [4]"},
      {'v', "v 0 [4] [1] 0 f33 cpu -1", "expected a dtype name, got 'f33'"},
      {'v', "v 0 [4] [1] 0 f32 tpu -1", "expected a device type (cpu or cuda), got 'tpu'"},
      {'v', "v 0 [4 [1] 0 f32 cpu -1", "expected the value's shape"},
      {'o', "o 0 mul ( 0 ) ( 77777 ) views writes", "expected an output value id in [0, 4), got '77777 )"},
      {'o', "o 0 mul ( 0 ) ( 1 ) views writes other#9=1", "expected an attribute type 0..4"},
      {'v', "v 0 [4, 8] [8, 1] 1 f32 cpu -1",
       "expected a layout inside its buffer (it reaches byte 132 of a buffer of 128), got '[4, 8] [8, 1] 1"},
      {'v', "v 0 [4, 8] [-8, 1] 0 f32 cpu -1", "expected dims and strides of at least 0"},
      {'v', "v 0 [4, 8] [8, 1] 99999999999999999999 f32 cpu -1", "expected the value's offset within 64 bits"},
      {'v', "v 0 [4, 8] [8, 1] 0 f32 cuda -1", "expected the device of buffer 0 (cpu)"},
      {'o', "o 0 mul ( 0 ) ( 1 ) views 3:0 writes", "expected a view's output position in [0, 1), got '3:0"},
      {'o', "o 0 mul ( 0 ) ( 1 ) views writes 5", "expected a written input's position in [0, 1), got '5'"},
      {'o', "o 0 mul ( 2 ) ( 1 ) views writes", "expected inputs made by earlier ops (value 2 is made by op 1, this is op 0)"},
      {'o', "v 0 [4] [1] 0 f32 cpu 0\n" + first_o,
       "g.graph: value 4 names op 0 as its producer, but that op does not list it among its outputs"},
  };
  for (const auto& d : damaged) {
    const size_t at = text.find(std::string("\n") + d.tag + " ") + 1;
    const std::string bad = text.substr(0, at) + d.line + text.substr(text.find('\n', at));
    EXPECT_THROW_MSG(parse_portable_graph_text(bad, "g.graph"), d.error);
  }
  EXPECT_THROW_MSG(parse_portable_graph_text(text.substr(0, text.find("\noutputs")), "g.graph"),
                   "g.graph: the graph ends without its 'inputs' and 'outputs'");
  EXPECT_THROW_MSG(parse_portable_graph_text("x 1\n" + text, "g.graph"), "g.graph:1: expected a record");
  EXPECT_THROW_MSG(parse_exported_graph(text, "e.graph"), "e.graph: expected the header 'blu-fusion-graph 1'");
  EXPECT_THROW_MSG(parse_exported_graph("blu-fusion-graph 1\n" + text, "e.graph"), "e.graph:2: expected 'target <target>'");
}

TEST(PortableGraph, ExportedOnAMissPlannedElsewhereIsFoundByTheCapturingSide) {
  use_temp_cache("export");
  const auto dir = std::filesystem::temp_directory_path() / ("blu_plan_export_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const Graph g = pointwise_chain();
  std::vector<std::string> log;
  const FusionFn capturing_side = cached_fusion({}, [&](const std::string& s) { log.push_back(s); }, "cuda-sm_90a",
                                                dir.string());
  EXPECT_TRUE(capturing_side(g).empty());
  const std::string file = (dir / (fusion_plan_key(g, "cuda-sm_90a") + ".graph")).string();
  ASSERT_TRUE(std::filesystem::exists(file)) << (log.empty() ? "" : log.back());
  ASSERT_EQ(log.size(), 2u);
  EXPECT_NE(log[0].find("exported to " + file), std::string::npos) << log[0];

  // Where MLIR is: the file read back, a stand-in pass's regions stored as its plan.
  std::ifstream f(file);
  const std::string text{std::istreambuf_iterator<char>(f), {}};
  const ExportedGraph e = parse_exported_graph(text, file);
  EXPECT_EQ(e.target, "cuda-sm_90a");
  EXPECT_EQ(exported_graph_text(e.graph, e.target), text);
  FusedRegion r;
  r.shape = RegionShape::pointwise;
  r.ops = kernel_ops(e.graph);
  compute_region_io(e.graph, r);
  store_fusion_plan(e.graph, e.target, {r});

  // The capturing side now finds that plan for its own graph, the same ops with the same io.
  log.clear();
  const std::vector<FusedRegion> found = capturing_side(g);
  ASSERT_EQ(found.size(), 1u) << (log.empty() ? "" : log.back());
  EXPECT_EQ(found[0].ops, kernel_ops(g));
  EXPECT_EQ(found[0].inputs, r.inputs);
  EXPECT_EQ(found[0].outputs, r.outputs);
  EXPECT_NE(log.back().find("from the cache, 1 regions"), std::string::npos) << log.back();
  EXPECT_THROW_MSG(fusion_for("off", {}, dir.string()), "needs --compile-fuse on");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace blu::compiler
