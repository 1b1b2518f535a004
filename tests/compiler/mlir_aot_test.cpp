// Ahead-of-time compilation through the kernel cache (compiler/fusion_plan.h, `blutrain compile`):
// - the MLIR fusion pass is the plugin beside the app (compiler/fusion_plugin.h), opened at its
//   first use, and gives the regions the pass gives in process (with and without an excluded op);
//   a file that does not load or is no plugin is refused with its path; `blutrain --version` loads
//   neither libMLIR nor libLLVM;
// - ten steps of the tiny GPT-2 compiled with the cached fusion: the first run makes the plan
//   with the pass and compiles its kernels; a second run with no pass (as a build without MLIR
//   runs) finds the plan and every kernel in the cache, compiles nothing, and both equal eager
//   bitwise (losses and weights);
// - `blutrain train --compile` fuses by default (its log names the regions) and logs the eager
//   run's losses and gradient norms bitwise; --compile-fuse off fuses nothing;
// - `blutrain compile` stores the plan and kernels (a second run finds both: nothing compiled),
//   and `blutrain bench --compile` of the same step reads the plan from the cache;
// - a step exported by `bench --compile --compile-export` and fused by `blutrain compile
//   --from-graph` into another cache gets the plan, byte for byte, that the pass made where it was
//   captured, under the key the capturing machine looks up; that cache alone then serves bench.
// Run: build-cpu/tests/test_compiler_mlir --gtest_filter='Aot*'.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blu/blu.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/compiler/fusion_plugin.h"
#include "blu/compiler/mlir/mlir_api.h"
#include "blu/data/shard.h"
#include "blu/dist/strategy.h"
#include "blu/models/gpt2/gpt2.h"
#include "common/tiny_gpt.h"
#include "train/train_test_util.h"

namespace blu::compiler {
namespace {

namespace fs = std::filesystem;

fs::path blutrain() { return fs::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain"; }

fs::path temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("blu_aot_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}


struct AotRun {
  std::vector<double> losses;
  std::vector<Tensor> params;
  const Variant* variant = nullptr;
  std::unique_ptr<CompiledStep> cs;
  std::string log;
};

AotRun train(FusionFn fusion, bool compiled) {
  auto model = std::make_unique<models::GPT>(::blu::test::tiny_gpt(), 7);
  dist::Strategy strat(*model, nullptr, dist::StrategyConfig{}, dist::OptimizerConfig{.lr = 3e-3});
  std::ostringstream log;
  CompileOptions o;
  o.log = true;
  o.log_stream = &log;
  o.fusion = std::move(fusion);
  AotRun r;
  if (compiled) {
    r.cs = std::make_unique<CompiledStep>(o);
    r.cs->set_named(BufferKind::parameter, model->named_parameters());
  }
  for (int s = 0; s < 10; ++s) {
    std::vector<double> in, tg;
    for (int t = 0; t < 16; ++t) {
      in.push_back(double((s * 131 + t * 7) % 101));
      tg.push_back(double((s * 131 + t * 7 + 5) % 101));
    }
    const Tensor idx = from_vector(in, {2, 8}, DType::i32), y = from_vector(tg, {2, 8}, DType::i32);
    dist::StepValues v;
    auto step = [&] { v = strat.step(1, [&](int64_t) { return std::pair<Tensor, Tensor>{idx, y}; }, 3e-3 * (1 - 0.05 * s), 1.0); };
    if (r.cs) r.cs->run({idx, y}, step);
    else step();
    r.losses.push_back(strat.read(v, false).loss);
  }
  for (const Tensor& p : model->parameters()) r.params.push_back(clone(p.detach()));
  if (r.cs) r.variant = r.cs->variants().at(0).get();
  r.log = log.str();
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

// The pass of these tests is the plugin of this build, as the app's is (compiler/fusion_plugin.h).
const bool plugin_of_this_build = [] { return ::setenv("BLU_FUSION_PLUGIN", BLU_TEST_FUSION_PLUGIN, 0) == 0; }();

TEST(AotFusionPlugin, LoadsAtFirstUseAndFusesAsTheInProcessPass) {
  ASSERT_TRUE(plugin_of_this_build);
  ::setenv("BLU_KERNEL_CACHE", temp_dir("plugin").c_str(), 1);
  ASSERT_TRUE(have_fusion_pass());
  const std::string path = fusion_plugin_path();
  const FusionFn pass = fusion_pass();
  EXPECT_FALSE(fusion_plugin_loaded(path)) << "loaded before the pass ran";
  const AotRun run = train({}, true);  // a captured training step, no fusion
  const Graph& g = run.variant->graph;
  for (const std::vector<std::string>& no_fuse : {std::vector<std::string>{}, std::vector<std::string>{"gelu"}}) {
    set_excluded_ops(no_fuse);
    const std::vector<FusedRegion> plugin = pass(g);
    EXPECT_TRUE(fusion_plugin_loaded(path));
    const std::vector<FusedRegion> in_process = mlir_api::fuse(g, mlir_api::FusionOptions{.no_fuse = no_fuse});
    ASSERT_GE(plugin.size(), 4u);
    ASSERT_EQ(plugin.size(), in_process.size());
    for (size_t i = 0; i < plugin.size(); ++i) {
      EXPECT_EQ(plugin[i].ops, in_process[i].ops) << "region " << i;
      EXPECT_EQ(plugin[i].shape, in_process[i].shape) << "region " << i;
      EXPECT_EQ(plugin[i].bytes_saved, in_process[i].bytes_saved) << "region " << i;
      EXPECT_EQ(plugin[i].inputs, in_process[i].inputs) << "region " << i;
      EXPECT_EQ(plugin[i].outputs, in_process[i].outputs) << "region " << i;
      for (int oi : plugin[i].ops)
        for (const std::string& name : no_fuse) EXPECT_NE(g.ops[size_t(oi)].name, name) << "region " << i;
    }
  }
  set_excluded_ops({});
}

TEST(AotFusionPlugin, ABadPluginIsRefusedWithItsPath) {
  Graph g;
  EXPECT_THROW(
      try { plugin_fusion_pass("/nonexistent/libblutrain_fusion.so")(g); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("/nonexistent/libblutrain_fusion.so does not load"), std::string::npos)
            << e.what();
        throw;
      },
      Error);
  // A shared object that is not a plugin: its path and the missing entry point.
  std::string zlib;
  for (const char* p : {"/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1"})
    if (fs::exists(p)) zlib = p;
  if (zlib.empty()) GTEST_SKIP() << "no libz.so.1 to load as a non-plugin";
  EXPECT_THROW(
      try { plugin_fusion_pass(zlib)(g); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(zlib + ": no entry point blu_fusion_plugin_abi"), std::string::npos)
            << e.what();
        throw;
      },
      Error);
}

TEST(AotFusionPlugin, TheAppDoesNotLoadMlirToStart) {
  if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
  // The dynamic loader's own account of what it loads (LD_DEBUG=libs): no MLIR or LLVM for --version.
  FILE* p = ::popen(("LD_DEBUG=libs " + blutrain().string() + " --version 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
  ASSERT_EQ(::pclose(p), 0) << out;
  ASSERT_NE(out.find("calling init"), std::string::npos) << "LD_DEBUG printed nothing:\n" << out;
  EXPECT_EQ(out.find("libMLIR"), std::string::npos) << out;
  EXPECT_EQ(out.find("libLLVM"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(blutrain().parent_path() / kFusionPluginFile)) << "no plugin beside the app";
}

TEST(AotPlan, CachedPlanWithoutThePassCompilesNothingAndEqualsEager) {
  ::setenv("BLU_KERNEL_CACHE", temp_dir("plan").c_str(), 1);
  const AotRun eager = train({}, false);
  std::vector<std::string> lines;
  auto say = [&](const std::string& s) { lines.push_back(s); };
  const AotRun first = train(cached_fusion(fusion_pass(), say), true);
  ASSERT_FALSE(lines.empty());
  EXPECT_NE(lines.back().find("made by the fusion pass"), std::string::npos) << lines.back();
  EXPECT_GE(first.variant->regions, 4) << first.log;
  EXPECT_GT(first.variant->kernels_compiled, 0) << first.variant->fusion;

  const AotRun second = train(cached_fusion({}, say), true);  // no pass: a build without MLIR
  EXPECT_NE(lines.back().find("from the cache"), std::string::npos) << lines.back();
  EXPECT_EQ(second.variant->regions, first.variant->regions) << second.log;
  EXPECT_EQ(second.variant->kernels_compiled, 0) << second.variant->fusion;
  // Every generated region's kernel from the cache; GEMM epilogues (the GELU after c_fc, c_fc's
  // bias gradient in the GELU's backward) need none.
  EXPECT_EQ(second.variant->kernels_cached, second.variant->regions - second.variant->epilogues)
      << second.variant->fusion;
  EXPECT_EQ(second.cs->counts().compiled, 9) << second.log;
  for (const AotRun* r : {&first, &second}) {
    for (size_t i = 0; i < eager.losses.size(); ++i) EXPECT_EQ(r->losses[i], eager.losses[i]) << "step " << i + 1;
    for (size_t i = 0; i < eager.params.size(); ++i) EXPECT_TRUE(same_bits(r->params[i], eager.params[i])) << "parameter " << i;
  }
}

// --- the command line ---

// Runs a shell command; its exit status and stdout+stderr.
std::pair<int, std::string> shell(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  std::array<char, 4096> buf;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
  const int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::map<int64_t, std::pair<double, double>> step_metrics(const fs::path& run) {
  std::map<int64_t, std::pair<double, double>> m;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == "step")
      m[j["step"].get<int64_t>()] = {j["loss"].get<double>(), j["norm"].get<double>()};
  }
  return m;
}

nlohmann::json last_json_line(const std::string& out) {
  nlohmann::json j;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') j = nlohmann::json::parse(line, nullptr, false);
  return j;
}

class AotCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
    dir = temp_dir("cli");
    write_shard(dir / "d_train_000000.bin", train::test_util::pattern_tokens(16384, 2, 101));
    env = "OMP_NUM_THREADS=1 BLU_KERNEL_CACHE=" + (dir / "cache").string() + " ";
  }
  std::string train_cmd(const std::string& run, const std::string& extra) {
    return env + blutrain().string() + " train --train-pattern " + (dir / "d_train_*.bin").string() +
           " --model tiny -B 2 -T 16 --steps 8 --optimizer adamw --schedule cosine --warmup 3 --lr 3e-3 "
           "--min-lr 3e-4 --grad-clip 1.0 --out " + (dir / run).string() + " " + extra;
  }
  fs::path dir;
  std::string env;
};

TEST_F(AotCli, TrainCompileFusesByDefaultAndEqualsEagerBitwise) {
  const auto eager = shell(train_cmd("eager", ""));
  ASSERT_EQ(eager.first, 0) << eager.second;
  const auto fused = shell(train_cmd("fused", "--compile --compile-log"));
  ASSERT_EQ(fused.first, 0) << fused.second;
  const auto off = shell(train_cmd("off", "--compile --compile-log --compile-fuse off"));
  ASSERT_EQ(off.first, 0) << off.second;
  EXPECT_NE(fused.second.find("compile: fusion plan: made by the fusion pass"), std::string::npos) << fused.second;
  const size_t at = fused.second.find("compile: fusion: ");
  ASSERT_NE(at, std::string::npos) << fused.second;
  EXPECT_GT(std::atoi(fused.second.c_str() + at + std::strlen("compile: fusion: ")), 0) << fused.second.substr(at, 200);
  EXPECT_EQ(off.second.find("compile: fusion"), std::string::npos) << off.second;
  const auto e = step_metrics(dir / "eager"), f = step_metrics(dir / "fused"), o = step_metrics(dir / "off");
  ASSERT_EQ(e.size(), 8u);
  EXPECT_EQ(f, e);
  EXPECT_EQ(o, e);
  std::cout << fused.second.substr(at, fused.second.find('\n', at) - at) << "\n";
}

TEST_F(AotCli, CompileFillsTheCacheThatBenchReads) {
  const std::string args = " --model tiny -B 2 -T 16 --device cpu --precision fp32";
  const auto cold = shell(env + blutrain().string() + " compile" + args);
  ASSERT_EQ(cold.first, 0) << cold.second;
  const nlohmann::json c = last_json_line(cold.second);
  ASSERT_TRUE(c.is_object()) << cold.second;
  EXPECT_GT(c["regions"].get<int>(), 0) << c.dump();
  // Regions of equal text (the same op group in every layer) share one kernel: compiled once. A
  // GEMM epilogue runs the backend's kernels, no generated one: GPT-2's GELU after c_fc and c_fc's
  // bias gradient summed by the GELU's backward (Note [Bias gradient in the GELU's]), one each a
  // layer of the tiny model's two.
  const int generated = c["regions"].get<int>() - c["gemm_epilogues"].get<int>();
  EXPECT_EQ(c["gemm_epilogues"].get<int>(), 4) << c.dump();
  EXPECT_GT(c["kernels_compiled"].get<int>(), 0) << c.dump();
  EXPECT_EQ(c["kernels_compiled"].get<int>() + c["kernels_cached"].get<int>(), generated) << c.dump();
  EXPECT_NE(c["plan"].get<std::string>().find("made by the fusion pass"), std::string::npos) << c.dump();

  const auto warm = shell(env + blutrain().string() + " compile" + args);
  ASSERT_EQ(warm.first, 0) << warm.second;
  const nlohmann::json w = last_json_line(warm.second);
  EXPECT_EQ(w["kernels_compiled"].get<int>(), 0) << w.dump();
  EXPECT_EQ(w["kernels_cached"].get<int>(), generated) << w.dump();
  EXPECT_NE(w["plan"].get<std::string>().find("from the cache"), std::string::npos) << w.dump();

  const auto bench = shell(env + blutrain().string() + " bench" + args + " --steps 4 --compile --compile-log");
  ASSERT_EQ(bench.first, 0) << bench.second;
  EXPECT_NE(bench.second.find("fusion plan: from the cache"), std::string::npos) << bench.second;
  EXPECT_NE(bench.second.find(" 0 compiled, "), std::string::npos) << bench.second;

  const auto arch = shell(env + blutrain().string() + " compile" + args + " --arch sm_90a");
  EXPECT_NE(arch.first, 0);
  EXPECT_NE(arch.second.find("names a CUDA architecture"), std::string::npos) << arch.second;
  std::cout << "cold: " << c.dump() << "\nwarm: " << w.dump() << "\n";
}

TEST_F(AotCli, ExportedStepFusedElsewhereGetsTheCapturingSidesPlan) {
  const std::string args = " --model tiny -B 2 -T 16 --device cpu --precision fp32 --steps 3 --compile --compile-log";
  const fs::path graphs = dir / "graphs", other = dir / "other_cache";
  const auto captured =
      shell(env + blutrain().string() + " bench" + args + " --compile-export " + graphs.string());
  ASSERT_EQ(captured.first, 0) << captured.second;
  EXPECT_NE(captured.second.find("exported to " + graphs.string()), std::string::npos) << captured.second;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(graphs)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const std::string key = files[0].stem().string();
  ASSERT_TRUE(fs::exists(dir / "cache" / (key + ".plan"))) << "the pass's plan where the step was captured";

  const std::string other_env = "OMP_NUM_THREADS=1 BLU_KERNEL_CACHE=" + other.string() + " ";
  const auto fused = shell(other_env + blutrain().string() + " compile --from-graph " + files[0].string());
  ASSERT_EQ(fused.first, 0) << fused.second;
  const nlohmann::json j = last_json_line(fused.second);
  ASSERT_TRUE(j.is_object()) << fused.second;
  EXPECT_EQ(j["key"].get<std::string>(), key) << j.dump();
  EXPECT_GT(j["regions"].get<int>(), 0) << j.dump();
  auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string{std::istreambuf_iterator<char>(f), {}};
  };
  EXPECT_EQ(read(other / (key + ".plan")), read(dir / "cache" / (key + ".plan")));
  EXPECT_EQ(read(other / (key + ".txt")), read(dir / "cache" / (key + ".txt")));

  // bench with only that cache finds the plan (and compiles the region kernels itself).
  const auto served = shell(other_env + blutrain().string() + " bench" + args);
  ASSERT_EQ(served.first, 0) << served.second;
  EXPECT_NE(served.second.find("fusion plan: from the cache, " + std::to_string(j["regions"].get<int>()) + " regions"),
            std::string::npos) << served.second;

  // A damaged file is refused with its name and line; nothing is stored for it.
  const fs::path bad = dir / "bad.graph";
  std::ofstream(bad) << "blu-fusion-graph 1\ntarget cuda-sm_90a\nb 64 cpu 0\nv 3 [4] [1] 0 f32 cpu -1\n";
  const auto refused = shell(other_env + blutrain().string() + " compile --from-graph " + bad.string());
  EXPECT_NE(refused.first, 0);
  EXPECT_NE(refused.second.find(bad.string() + " (after its 2 header lines):2: expected the value's buffer in [0, 1), got '3 [4]"),
            std::string::npos) << refused.second;
  std::cout << j.dump() << "\n";
}

// Without the plugin (BLU_FUSION_PLUGIN=none): `compile` is refused with what it needs, and
// `train --compile` runs unfused, bitwise eager, saying why in its log.
TEST_F(AotCli, WithoutThePluginCompileIsRefusedAndTrainRunsUnfused) {
  const std::string none = "BLU_FUSION_PLUGIN=none ";
  const auto refused = shell(none + env + blutrain().string() + " compile --model tiny -B 2 -T 16 --device cpu");
  EXPECT_NE(refused.first, 0) << refused.second;
  EXPECT_NE(refused.second.find("blutrain compile needs the fusion pass: the plugin libblutrain_fusion.so"),
            std::string::npos) << refused.second;
  EXPECT_NE(refused.second.find("(BLU_FUSION_PLUGIN is 'none')"), std::string::npos) << refused.second;
  const auto eager = shell(train_cmd("eager", ""));
  ASSERT_EQ(eager.first, 0) << eager.second;
  const auto unfused = shell(none + train_cmd("unfused", "--compile --compile-log"));
  ASSERT_EQ(unfused.first, 0) << unfused.second;
  EXPECT_NE(unfused.second.find("none in the cache and no fusion pass"), std::string::npos) << unfused.second;
  EXPECT_EQ(step_metrics(dir / "unfused"), step_metrics(dir / "eager"));
}

}  // namespace
}  // namespace blu::compiler
