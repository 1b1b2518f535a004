// `blutrain compile`: compiles one training step ahead of time into the kernel cache
// (compiler/codegen/kernel_cache.h): the step `blutrain bench --compile` runs for the same --model,
// -B, -T, --precision and --device is captured, the fusion pass (compiler/mlir/) finds its regions,
// the regions are stored as the graph's fusion plan (compiler/fusion_plan.h) and every region's
// kernel is compiled into the cache. A build without MLIR that runs the same step later (bench
// --compile, same shapes and target) reads the plan and the kernels from the cache and compiles
// nothing. Prints one JSON line: the target, the regions, how many kernels were compiled and how
// many came from the cache, and the compile's times (cold: an empty cache; warm: everything found).
// --arch names the CUDA architecture the plan is for (sm_90a). Capture runs the step's host logic
// on its device, and a CUDA step's graph is not the CPU step's (flash attention instead of the
// matmul-softmax attention, f32 instead of f64 norm sums), so a CUDA plan needs a capture on a
// CUDA device: --device cuda with --arch equal to that GPU's architecture, in a build with CUDA and
// MLIR. Refused otherwise, by name (docs/compiler_mlir.md, "Ahead of time"). --from-graph FILE...
// instead fuses steps captured elsewhere — `bench/train --compile --compile-export DIR` on a machine
// without MLIR (the GPU machine) writes them — and stores each plan under the key the capturing
// machine looks up; their kernels are compiled where the step runs (NVRTC, at first use).
// Depends on compiler/{compile,fusion_plan}, dist/strategy, models/registry. Keep: the step is
// bench's compiled step (same model construction, optimizer, clipping, input dtype), or the plan
// it stores is never found by bench.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "blu/blu.h"
#include "blu/compiler/codegen/cpu_kernel.h"
#include "blu/compiler/codegen/kernel_cache.h"
#include "blu/compiler/compile.h"
#include "blu/compiler/exclude.h"
#include "blu/compiler/fusion_plan.h"
#include "blu/compiler/fusion_plugin.h"
#include "blu/dist/strategy.h"
#include "blu/models/registry.h"
#include "blu/train/trainer.h"
#include "commands.h"

namespace blu::cli {

namespace {

struct CompileCmdOptions {
  std::string model = "d12", device = "cpu", precision = "fp32", arch;
  int64_t batch = 16, seq = 1024;
  double lr = 6e-4, beta2 = 0.999;  // bench's; float attributes are kernel arguments, not in the plan
  std::string compile_exclude;
  std::string master_weights = "fp32";  // the train run's --master-weights: its update op differs
  std::string adamw_state = "f32";      // the train run's --adamw-state: likewise
  std::vector<std::string> from_graph;
  bool log = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string read_whole(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  BLU_CHECK(f.good(), "--from-graph ", path, ": cannot be read");
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// --from-graph: each exported step fused and its plan stored, one JSON line each.
int fuse_exported(const CompileCmdOptions& o) {
  for (const std::string& path : o.from_graph) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string text = read_whole(path);
    const compiler::ExportedGraph e = compiler::parse_exported_graph(text, path);
    BLU_CHECK(compiler::exported_graph_text(e.graph, e.target) == text, "--from-graph ", path,
              ": the graph does not read back as the text it was parsed from (edited by hand, or written by another ",
              "version of blutrain): its plan would be stored under a key the capturing machine never looks up");
    // The target carries the excluded op names (" -name"), which the pass must honour.
    std::vector<std::string> excluded;
    for (size_t at = e.target.find(" -"); at != std::string::npos; at = e.target.find(" -", at + 2)) {
      const size_t end = e.target.find(' ', at + 2);
      excluded.push_back(e.target.substr(at + 2, end == std::string::npos ? std::string::npos : end - at - 2));
    }
    compiler::set_excluded_ops(excluded);
    const std::vector<compiler::FusedRegion> regions = compiler::fusion_pass()(e.graph);
    compiler::store_fusion_plan(e.graph, e.target, regions);
    size_t fused_ops = 0, kernel_ops = 0;
    double saved = 0;
    for (const compiler::FusedRegion& r : regions) {
      fused_ops += r.ops.size();
      saved += r.bytes_saved;
    }
    for (const compiler::Op& op : e.graph.ops) kernel_ops += op.kind == compiler::OpKind::kernel;
    const nlohmann::json j = {
        {"graph", path},
        {"target", e.target},
        {"key", compiler::fusion_plan_key(e.graph, e.target)},
        {"cache", compiler::kernel_cache_dir()},
        {"graph_ops", e.graph.ops.size()},
        {"kernel_ops", kernel_ops},
        {"regions", regions.size()},
        {"fused_ops", fused_ops},
        {"bytes_saved", saved},
        {"fuse_s", seconds_since(t0)},
    };
    std::cout << j.dump() << std::endl;
  }
  return 0;
}

int run_compile(const CompileCmdOptions& o) {
  const auto t_start = std::chrono::steady_clock::now();
  BLU_CHECK(compiler::have_fusion_pass(), "blutrain compile needs the fusion pass: the plugin ", compiler::kFusionPluginFile,
            " beside this program (a build with MLIR: BLU_MLIR=ON, libmlir-22-dev) or BLU_FUSION_PLUGIN=<its path>",
            std::getenv("BLU_FUSION_PLUGIN") ? std::string(" (BLU_FUSION_PLUGIN is '") + std::getenv("BLU_FUSION_PLUGIN") + "')" : "",
            "; without it this program only reads fusion plans from the kernel cache");
  if (!o.from_graph.empty()) return fuse_exported(o);
  Device dev(o.device);
  if (!o.arch.empty()) {
    BLU_CHECK(dev.is_cuda(), "--arch ", o.arch, " names a CUDA architecture, but --device is ", o.device,
              ": a CUDA step's graph differs from the CPU step's (flash attention, f32 norm sums), so its plan needs a ",
              "capture on a CUDA device (--device cuda, a GPU of that architecture); the CPU target is ",
              compiler::kCpuTarget, " and needs no --arch");
#ifndef BLU_HAVE_CUDA
    BLU_CHECK(false, "--arch ", o.arch, " with --device cuda needs a build with CUDA (NVRTC) and MLIR and a GPU to ",
              "capture on; this build has no CUDA");
#endif
  }
  if (!o.compile_exclude.empty()) compiler::set_excluded_ops(compiler::checked_op_list(o.compile_exclude, "--compile-exclude"));
  nlohmann::json cfg = models::resolve_model_config(o.model);
  if (cfg.contains("block_size") && cfg["block_size"].get<int64_t>() < o.seq) cfg["block_size"] = o.seq;
  const std::unique_ptr<models::CausalLM> model_ptr = models::build_model(cfg, 0);
  models::CausalLM& model = *model_ptr;
  BLU_CHECK(o.seq <= model.max_seq_len(), "--seq ", o.seq, " is longer than the model's ", model.max_seq_len());
  model.to(dev);
  model.train();
  train::apply_precision(model, o.precision);
  dist::StrategyConfig sc;
  sc.fp16_loss_scaling = o.precision == "fp16";
  BLU_CHECK(o.master_weights == "fp32" || o.precision == "bf16", "--master-weights split needs --precision bf16, got ",
            o.precision);
  sc.split_masters = o.master_weights == "split";
  dist::Strategy strategy(model, nullptr, sc,
                          dist::OptimizerConfig{.lr = o.lr, .weight_decay = 0.1, .beta2 = o.beta2,
                                                .state_dtype = dtype_from_name(o.adamw_state)});
  const double setup_s = seconds_since(t_start);

  std::string target;
  std::vector<std::string> lines;
  compiler::CompileOptions co;
  co.log = o.log;
  co.config = o.precision + ", " + strategy.describe();
  co.fusion = compiler::cached_fusion(compiler::fusion_pass(), [&](const std::string& line) {
    lines.push_back(line);
    if (o.log) std::cerr << "compile: " << line << "\n";
  });
  compiler::CompiledStep compiled(co);
  compiled.set_named(compiler::BufferKind::parameter, model.named_parameters());
  const Tensor cx = empty({o.batch, o.seq}, DType::i64, dev), cy = empty({o.batch, o.seq}, DType::i64, dev);
  Generator gen(1);
  const int64_t vocab = model.vocab_size();
  double step_s[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {  // 1: eager (optimizer state), 2: captured, fused, planned, run
    {
      NoGradGuard no_grad;
      copy_(cx, randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen));
      copy_(cy, randint(0, vocab, {o.batch, o.seq}, DType::i64, dev, &gen));
    }
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss;
    compiled.run({cx, cy}, [&] {  // bench --compile's step, op for op (cmd_bench.cpp): the plan's key is its
      loss = strategy.step(1, [&](int64_t) { return model.forward(cx, cy).loss; }, o.lr, 1.0).loss_sum;
      strategy.optimizer().zero_grad();
    });
    (void)to_vector(to_dtype(loss, DType::f32));
    step_s[i] = seconds_since(t0);
  }
  BLU_CHECK(!compiled.variants().empty() && compiled.counts().compiled == 1,
            "blutrain compile: the step did not compile (", compiled.counts().fallback, " fallbacks, ",
            compiled.counts().guard_failures, " guard failures)");
  const compiler::Variant& v = *compiled.variants()[0];
  const double compile_s = (v.capture_ms + v.plan_ms) / 1000;
  nlohmann::json j = {
      {"model", o.model},
      {"batch", o.batch},
      {"seq", o.seq},
      {"precision", o.precision},
      {"device", dev.str()},
      {"cache", compiler::kernel_cache_dir()},
      {"graph_ops", v.graph.ops.size()},
      {"regions", v.regions},  // generated kernels' regions and GEMM epilogues
      {"gemm_epilogues", v.epilogues},
      {"kernels_compiled", v.kernels_compiled},
      {"kernels_cached", v.kernels_cached},
      {"fusion", v.fusion},
      {"plan", lines.empty() ? "" : lines.back()},
      // The compile: capture, fusion (the pass or the cached plan), kernels (compiled or loaded),
      // memory plan and runtime set-up of the step.
      {"compile_s", compile_s},
      {"capture_s", v.capture_ms / 1000},
      {"fuse_plan_s", v.plan_ms / 1000},
      // Model construction and the eager warm-up step: what a job start spends besides the compile.
      {"setup_s", setup_s},
      {"eager_step_s", step_s[0]},
      {"compiled_step_s", step_s[1]},
      {"total_s", seconds_since(t_start)},
  };
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace

Command add_compile(CLI::App& root) {
  auto o = std::make_shared<CompileCmdOptions>();
  CLI::App* app = root.add_subcommand(
      "compile", "Compile bench's training step ahead of time into the kernel cache (fusion plan and kernels)");
  app->add_option("--model", o->model, "Model: FAMILY:PRESET (gpt2:d12 = GPT-2 124M, llama:llama-250m, ...)")
      ->capture_default_str();
  app->add_option("-B,--batch-size", o->batch, "Batch size")->capture_default_str();
  app->add_option("-T,--seq-len", o->seq, "Sequence length")->capture_default_str();
  app->add_option("--device", o->device, "cpu or cuda[:N]: where the step is captured")->capture_default_str();
  app->add_option("--precision", o->precision, "fp32 | tf32 | bf16 | fp16")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}))
      ->capture_default_str();
  app->add_option("--arch", o->arch,
                  "CUDA architecture of the plan (sm_90a): needs --device cuda on a GPU of that architecture");
  app->add_option("--lr", o->lr, "AdamW's learning rate (a kernel argument: any value gives the same plan)")
      ->capture_default_str();
  app->add_option("--master-weights", o->master_weights, "fp32 or split: as the train run gives it")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "split"}));
  app->add_option("--adamw-state", o->adamw_state, "f32 or bf16: as the train run gives it")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  app->add_option("--compile-exclude", o->compile_exclude, "Comma-separated op names kept out of fusion");
  app->add_flag("--compile-log", o->log, "Print the compiler's log (as BLU_COMPILE_LOG=1)");
  app->add_option("--from-graph", o->from_graph,
                  "Fuse steps exported by `bench/train --compile --compile-export DIR` elsewhere (DIR/<key>.graph) "
                  "and store their plans in the kernel cache, instead of capturing a step here")
      ->check(CLI::ExistingFile)
      ->excludes("--arch")
      ->excludes("--device")
      ->excludes("--compile-exclude");
  return {app, [o] { return run_compile(*o); }};
}

}  // namespace blu::cli
