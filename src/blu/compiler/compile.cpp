#include "blu/compiler/compile.h"

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>

#include "blu/compiler/fused_step.h"
#include "blu/compiler/exclude.h"

namespace blu::compiler {

CompiledStep::CompiledStep(CompileOptions options) : options_(std::move(options)) {
  if (const char* e = std::getenv("BLU_COMPILE_LOG"); e && *e && std::string(e) != "0") options_.log = true;
  if (options_.plan.exclude.empty()) options_.plan.exclude = excluded_ops();
}

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string format_ms(double ms) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << ms << " ms";
  return os.str();
}

}  // namespace

CompiledStep::~CompiledStep() = default;

void CompiledStep::set_named(BufferKind kind, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  named_.emplace_back(kind, tensors);
}

void CompiledStep::log(const std::string& line) {
  if (options_.log) (options_.log_stream ? *options_.log_stream : std::cerr) << "compile: " << line << "\n" << std::flush;
}

void CompiledStep::fail(const std::string& reason) {
  ++counts_.guard_failures;
  failures_.push_back(reason);
  // A guard failure is always reported, log or not: the step did not run compiled.
  (options_.log_stream ? *options_.log_stream : std::cerr) << "compile: guard failed at step " << step_ << ": "
                                                           << reason << "\n"
                                                           << std::flush;
}

std::string CompiledStep::key_of(const std::vector<Tensor>& inputs) const {
  std::ostringstream os;
  for (const Tensor& t : inputs)
    os << to_string(t.shape()) << " " << t.dtype() << " strides " << to_string(t.strides()) << " " << t.device()
       << "; ";
  os << "config " << options_.config;
  return os.str();
}

std::string first_difference(const Graph& a, const Graph& b) {
  const size_t n = std::min(a.ops.size(), b.ops.size());
  for (size_t i = 0; i < n; ++i) {
    const Op& x = a.ops[i];
    const Op& y = b.ops[i];
    if (x.name != y.name || x.kind != y.kind || x.inputs != y.inputs || x.outputs != y.outputs)
      return "op " + std::to_string(i) + " is " + y.name + ", the compiled graph has " + x.name;
    for (size_t j = 0; j < x.outputs.size(); ++j) {
      const Value& u = a.values[size_t(x.outputs[j])];
      const Value& v = b.values[size_t(y.outputs[j])];
      if (u.shape != v.shape || u.dtype != v.dtype || u.strides != v.strides)
        return "op " + std::to_string(i) + " (" + x.name + ") output " + std::to_string(j) + " is " +
               to_string(v.shape) + " " + std::string(dtype_name(v.dtype)) + ", the compiled graph has " +
               to_string(u.shape) + " " + std::string(dtype_name(u.dtype));
    }
  }
  if (a.ops.size() != b.ops.size())
    return "the step has " + std::to_string(b.ops.size()) + " ops, the compiled graph " + std::to_string(a.ops.size());
  return "buffers, values or attributes differ (" + std::to_string(b.buffers.size()) + " buffers, compiled " +
         std::to_string(a.buffers.size()) + ")";
}

FusedGraph CompiledStep::fuse_variant(const Graph& g) {
  if (!options_.fusion) return unfused(g);
  FusedGraph f = fuse_step(g, options_.fusion(g));
  log("fusion: " + f.summary());
  for (const std::string& note : f.notes) log("fusion: " + note);
  return f;
}

void CompiledStep::run(const std::vector<Tensor>& inputs, const std::function<void()>& step) {
  ++step_;
  if (step_ <= options_.warmup_steps) {
    log("step " + std::to_string(step_) + " runs eager (warm-up: optimizer state, allocator, workspace)");
    ++counts_.eager;
    step();
    return;
  }
  const std::string key = key_of(inputs);
  Variant* variant = nullptr;
  for (auto& v : variants_)
    if (v->key == key) variant = v.get();
  if (!variant && int(variants_.size()) >= options_.max_variants) {
    fail("no compiled variant for " + key + " and the limit of " + std::to_string(options_.max_variants) +
         " variants is reached; the step runs eager");
    ++counts_.eager;
    step();
    return;
  }
  if (!variant && !variants_.empty())
    fail("no compiled variant for " + key + " (the others: " + variants_.back()->key + "); compiling variant " +
         std::to_string(variants_.size() + 1) + " of at most " + std::to_string(options_.max_variants));

  const auto t_capture = std::chrono::steady_clock::now();
  Capture cap;
  for (const auto& [kind, tensors] : named_)
    for (const auto& [name, t] : tensors) cap.classify(t, kind, name);
  for (const Tensor& t : inputs) cap.classify(t, BufferKind::step_input);
  try {
    step();
  } catch (...) {
    cap.finish();
    throw;
  }
  Graph& g = cap.finish();
  const uint64_t structure = g.structure_hash();
  if (!variant) {
    auto v = std::make_unique<Variant>();
    v->capture_ms = ms_since(t_capture);
    const auto t_plan = std::chrono::steady_clock::now();
    v->key = key;
    v->structure = structure;
    v->graph = g;
    FusedGraph fused = fuse_variant(g);
    if (options_.fusion) {
      v->fusion = fused.summary();
      v->regions = int(fused.regions.size());
      v->kernels_compiled = fused.kernels_compiled;
      v->kernels_cached = fused.kernels_cached;
    }
    MemoryPlan plan = plan_memory(fused.graph, options_.plan);
    log("variant " + std::to_string(variants_.size() + 1) + " for " + key + ": " + g.summary());
    if (!options_.plan.exclude.empty()) {
      std::map<std::string, int> hits;
      for (const Op& op : g.ops) ++hits[op.name];
      std::string line = "excluded from compilation:";
      for (const std::string& name : options_.plan.exclude)
        line += " " + name + " (" + (hits.count(name) ? std::to_string(hits[name]) + " ops" : "no op of that name") + ")";
      log(line);
    }
    log("memory plan: " + plan.summary());
    v->runtime = std::make_unique<Runtime>(std::move(fused), std::move(plan), options_.runtime);
    v->plan_ms = ms_since(t_plan);
    log("compile time: " + format_ms(v->capture_ms + v->plan_ms) + " (capture " + format_ms(v->capture_ms) +
        ", plan and runtime set-up " + format_ms(v->plan_ms) + ")");
    variants_.push_back(std::move(v));
    variant = variants_.back().get();
  } else if (variant->structure != structure) {
    fail("the step's capture differs from the compiled graph: " + first_difference(variant->graph, g) +
         "; its kernels run unplanned, in eager order");
    ++counts_.fallback;
    Runtime::run_unplanned(cap);
    return;
  }
  ++counts_.compiled;
  counts_.capture_ms += ms_since(t_capture);
  const auto t_replay = std::chrono::steady_clock::now();
  variant->runtime->run(cap);
  counts_.replay_ms += ms_since(t_replay);
}

}  // namespace blu::compiler
