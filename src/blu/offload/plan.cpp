// offload/plan: the memory budget planner (header).
#include "blu/offload/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <vector>

#include "blu/memory/caching_allocator.h"
#include "blu/ops/factory.h"

namespace blu::offload {

int64_t gib_to_bytes(double gib) {
  BLU_CHECK(gib >= 0 && std::isfinite(gib), "a memory budget must be a finite number of GiB >= 0, got ", gib);
  return int64_t(std::llround(gib * double(int64_t(1) << 30)));
}

namespace {

struct Candidate {
  bool offload;
  UpdateOn update;
  bool masters = false;
  int64_t device_static, host;
  double update_seconds;
  bool grads = false;        // the released parameters' gradients on the host too
  int64_t act_credit = 0;    // activation bytes the probe counted that this layout does not keep
  int64_t moments = 0;       // of device_static, the optimizer's moments (made at the first update)
};

// The activation bytes a candidate keeps on the device (eager), those of the compiled steps (less
// the compiler's recompute, plus its arena's packing gaps: ActivationPlan::compiled_*), and the
// peak: the larger of the compiled steps' and the first step's, which runs eager with all of them
// before the optimizer has made its moments.
int64_t kept_activations(const Candidate& c, const PlanInput& in) {
  return in.activations.device_bytes - c.act_credit;
}
int64_t compiled_activations(const Candidate& c, const PlanInput& in) {
  const int64_t act = kept_activations(c, in);
  return act - std::clamp<int64_t>(in.activations.compiled_saving, 0, act) + std::max<int64_t>(0, in.activations.compiled_excess);
}
bool compiled(const PlanInput& in) { return in.activations.compiled_saving > 0 || in.activations.compiled_excess > 0; }
// The first step's: the warm-up's activations when probed apart, before the moments are made.
int64_t first_step_need(const Candidate& c, const PlanInput& in) {
  const int64_t act = in.activations.warmup_bytes >= 0
                          ? std::max<int64_t>(0, in.activations.warmup_bytes - c.act_credit)
                          : kept_activations(c, in);
  return c.device_static - c.moments + act;
}
int64_t device_need(const Candidate& c, const PlanInput& in) {
  return std::max(c.device_static + compiled_activations(c, in), first_step_need(c, in));
}

// The name a candidate goes by in the plan and in errors.
std::string describe(const Candidate& c) {
  if (c.grads) return "optimizer state, fp32 master weights and their gradients on the host, update on the cpu";
  if (c.masters) return "optimizer state and fp32 master weights on the host, update on the cpu";
  return c.offload ? std::string("optimizer state on the host, update on the ") + update_name(c.update)
                   : std::string("everything on the device");
}

// The optimizer state and the masters on the host: the device keeps the 16-bit copies, the fp32
// parameters that stay (resident_elements) and the gradients; the host the master and moments of
// every element (the gradients pass through its staging ring). Per step the gradients
// go down (4 bytes) and the released copies up (2), the resident parameters up in fp32 (4).
Candidate masters_candidate(const PlanInput& in) {
  const int64_t n = in.param_elements, released = n - in.resident_elements;
  Candidate c{true, UpdateOn::cpu, true, 0, 0, 0};
  c.device_static = 4 * in.resident_elements + in.compute_copy_bytes * n + (in.grads_in_activations ? 0 : 4 * n);
  c.host = OffloadAdamW::host_bytes_per_element(UpdateOn::cpu) * n;  // (and the rings' few buffers)
  if (in.transfer_bytes_per_s > 0)
    c.update_seconds = std::max(double(4 * n + in.compute_copy_bytes * released + 4 * in.resident_elements) /
                                    in.transfer_bytes_per_s,
                                in.host_adamw_elements_per_s > 0 ? double(n) / in.host_adamw_elements_per_s : 0.0);
  return c;
}

// And the released parameters' gradients, accumulated on the host (4 more bytes each there): the probe's activations counted every gradient (the
// first micro-batch's kept beside the second), of which only the resident parameters' stay; the
// window of gradients whose copy is in flight is added. Per micro-batch the released gradients
// go down (4 bytes each) instead of once per step.
Candidate grads_candidate(const PlanInput& in, int64_t micro_batches) {
  Candidate c = masters_candidate(in);
  const int64_t n = in.param_elements, released = n - in.resident_elements;
  c.grads = true;
  c.host = OffloadAdamW::host_bytes_per_element(UpdateOn::cpu, true) * n;
  c.device_static = 4 * in.resident_elements + in.compute_copy_bytes * n + (in.grads_in_activations ? 0 : 4 * in.resident_elements) +
                    std::min(in.offload.grad_window_bytes, 4 * released);
  c.act_credit = in.grads_in_activations ? std::min(in.activations.device_bytes, 4 * released) : 0;
  if (in.transfer_bytes_per_s > 0)
    c.update_seconds =
        std::max(double(4 * released * micro_batches + 4 * in.resident_elements + in.compute_copy_bytes * released +
                        4 * in.resident_elements) /
                     in.transfer_bytes_per_s,
                 in.host_adamw_elements_per_s > 0 ? double(n) / in.host_adamw_elements_per_s : 0.0);
  return c;
}

Candidate candidate(const PlanInput& in, bool offload, UpdateOn u) {
  const int64_t n = in.param_elements;
  const int64_t shard = (n + in.state_shards - 1) / in.state_shards;  // the elements whose moments this rank keeps
  // ZeRO-2: this rank's averaged gradient (a probe counts it with the activations) and the buckets
  // being reduced.
  const int64_t grads = (in.grads_in_activations ? 0 : 4 * n) +
                        (in.shard_gradients ? (in.grads_in_activations ? 0 : 4 * shard) + in.gradient_staging_bytes : 0);
  // The parameters and their compute copies, or ZeRO-3's measured shards.
  const int64_t params = in.measured_parameter_bytes >= 0 ? in.measured_parameter_bytes
                                                          : (4 + in.compute_copy_bytes) * n - 2 * in.split_elements;
  Candidate c{offload, u, false, 0, 0, 0};
  if (!offload) {
    c.device_static = params + in.moment_bytes * shard + grads;  // parameters, copies, moments
    c.moments = in.moment_bytes * shard;
    c.update_seconds = in.device_adamw_elements_per_s > 0 ? double(shard) / in.device_adamw_elements_per_s : 0;
    return c;
  }
  OffloadOptions o = in.offload;
  o.update = u;
  c.device_static = params + grads + OffloadAdamW::staging_bytes(o, shard);
  c.host = (in.state_shards > 1 ? 8 : OffloadAdamW::host_bytes_per_element(u)) * shard;
  if (in.transfer_bytes_per_s > 0) {
    if (u == UpdateOn::cpu)  // gradients down, parameters up; the host update overlaps the copies
      c.update_seconds = std::max(8.0 * double(n) / in.transfer_bytes_per_s,
                                  in.host_adamw_elements_per_s > 0 ? double(n) / in.host_adamw_elements_per_s : 0.0);
    else  // both moments up and down (the two directions overlap)
      c.update_seconds = 8.0 * double(shard) / in.transfer_bytes_per_s;
  }
  return c;
}

std::string fmt(int64_t b) { return format_bytes(b); }
// "2% of it kept free" (PlanInput::device_headroom), or "".
std::string headroom_text(const PlanInput& in) {
  return in.device_budget && in.device_headroom > 0
             ? std::to_string(int(std::lround(in.device_headroom * 100))) + "% of it kept free"
             : std::string();
}
std::string fmt_ms(double seconds) {
  std::ostringstream os;
  os << std::round(seconds * 1e4) / 10 << " ms";
  return os.str();
}

}  // namespace

MemoryPlan plan_memory(const PlanInput& in) {
  BLU_CHECK(in.param_elements > 0, "memory plan: no parameters");
  BLU_CHECK(in.offload_state == "auto" || in.offload_state == "none" || in.offload_state == "optimizer" ||
                in.offload_state == "master" || in.offload_state == "master+grads",
            "--offload-state: expected auto, none, optimizer, master or master+grads, got '", in.offload_state, "'");
  const bool masters = in.offload_state.starts_with("master");
  BLU_CHECK(in.offload_state != "master+grads" || in.single_rank,
            "--offload-state master+grads: the gradients go to the host as the backward makes them, so it runs on one "
            "rank (data parallelism reduces them on the device); use --offload-state master");
  BLU_CHECK(!masters || in.compute_copy_bytes > 0,
            "--offload-state master: the device keeps only the 16-bit compute copies of the parameters, so it needs "
            "--precision bf16 or fp16 (an fp32 run reads the fp32 parameters themselves)");
  BLU_CHECK(!masters || (in.offload_update != "gpu" && in.state_shards == 1),
            "--offload-state master: the host runs the update on the masters it holds (--offload-update cpu or auto, "
            "no ZeRO); got --offload-update ", in.offload_update,
            in.state_shards > 1 ? " with ZeRO-1 over " + std::to_string(in.state_shards) + " ranks" : std::string());
  BLU_CHECK(in.resident_elements >= 0 && in.resident_elements <= in.param_elements,
            "memory plan: resident_elements must be in [0, param_elements], got ", in.resident_elements);
  BLU_CHECK(in.offload_update == "auto" || in.offload_update == "cpu" || in.offload_update == "gpu",
            "--offload-update: expected auto, cpu or gpu, got '", in.offload_update, "'");
  BLU_CHECK(in.state_shards >= 1, "memory plan: state_shards must be >= 1, got ", in.state_shards);
  BLU_CHECK(!in.shard_gradients || in.state_shards > 1, "memory plan: sharded gradients (ZeRO-2) need state_shards > 1");
  BLU_CHECK(in.measured_parameter_bytes < 0 || (in.state_shards > 1 && !in.shard_gradients),
            "memory plan: measured parameter bytes (ZeRO-3) need state_shards > 1 and no ZeRO-2 gradient shard");
  BLU_CHECK(in.state_shards == 1 || in.offload_update != "cpu",
            "--offload-update cpu: under ZeRO the offloaded moments stream through the device (--offload-update gpu "
            "or auto)");
  BLU_CHECK(in.moment_bytes == 8 || in.moment_bytes == 4, "memory plan: moment_bytes must be 8 or 4, got ",
            in.moment_bytes);
  BLU_CHECK(in.moment_bytes == 8 || in.offload_state == "auto" || in.offload_state == "none",
            "--offload-state ", in.offload_state, ": offloaded moments are f32; bf16 moments (--adamw-state bf16) are "
            "held on the device only (use --offload-state none or auto)");
  const bool may_offload = in.moment_bytes == 8;  // auto keeps bf16 moments on the device
  const int64_t act = in.activations.device_bytes;
  std::vector<Candidate> tried;
  if (in.offload_state == "auto" || in.offload_state == "none") tried.push_back(candidate(in, false, UpdateOn::device));
  if (may_offload && (in.offload_state == "auto" || in.offload_state == "optimizer")) {
    if (in.offload_update != "gpu" && in.state_shards == 1) tried.push_back(candidate(in, true, UpdateOn::cpu));
    if (in.offload_update != "cpu") tried.push_back(candidate(in, true, UpdateOn::device));
  }
  BLU_CHECK(!masters || in.masters_allowed, "--offload-state ", in.offload_state,
            " is implemented for data parallelism; use --offload-state optimizer");
  const bool auto_masters = may_offload && in.offload_state == "auto" && in.masters_allowed && in.compute_copy_bytes > 0 &&
                            in.offload_update != "gpu" && in.state_shards == 1;
  if (in.offload_state == "master" || auto_masters) tried.push_back(masters_candidate(in));
  if (in.offload_state == "master+grads" || (auto_masters && in.single_rank))
    tried.push_back(grads_candidate(in, std::max<int64_t>(1, in.micro_batches)));
  BLU_CHECK(in.device_headroom >= 0 && in.device_headroom < 1, "memory plan: device headroom must be in [0, 1), got ",
            in.device_headroom);
  const double usable = 1.0 - in.device_headroom;  // of the device budget
  const auto fits = [&](const Candidate& c) {
    return (in.device_budget == 0 || double(device_need(c, in)) <= usable * double(in.device_budget)) &&
           (in.host_budget == 0 || c.host + in.activations.host_bytes <= in.host_budget);
  };
  const Candidate* best = nullptr;
  for (const Candidate& c : tried) {
    if (!fits(c)) continue;
    // Keeping the state on the device wins when it fits, then the optimizer state alone on the host
    // (the faster update), then the masters with it, then their gradients too.
    const auto rank = [](const Candidate& x) { return x.grads ? 3 : x.masters ? 2 : x.offload ? 1 : 0; };
    if (!best || rank(c) < rank(*best) || (rank(c) == rank(*best) && c.update_seconds < best->update_seconds))
      best = &c;
  }
  if (!best) {
    std::ostringstream os;
    os << "no memory layout fits: " << in.param_elements << " parameters with " << fmt(act)
       << " of activations on the device";
    os << " under a device budget of " << (in.device_budget ? fmt(in.device_budget) : std::string("(none)"))
       << (headroom_text(in).empty() ? std::string() : " (" + headroom_text(in) + ")")
       << " and a host budget of " << (in.host_budget ? fmt(in.host_budget) : std::string("(none)")) << ":";
    for (const Candidate& c : tried)
      os << "\n  " << describe(c) << ": device " << fmt(device_need(c, in)) << " (" << fmt(c.device_static)
         << " state + " << fmt(kept_activations(c, in)) << " activations"
         << (compiled(in) ? " eager, " + fmt(compiled_activations(c, in)) + " compiled" : std::string()) << "), host "
         << fmt(c.host + in.activations.host_bytes);
    int64_t least = INT64_MAX;
    for (const Candidate& c : tried) least = std::min(least, int64_t(std::ceil(double(device_need(c, in)) / usable)));
    os << "\n  the smallest device budget that fits is " << fmt(least) << " (--gpu-memory-budget "
       << std::ceil(double(least) / double(int64_t(1) << 30) * 100) / 100 << ")";
    BLU_CHECK(false, os.str());
  }
  MemoryPlan p;
  p.offload_state = best->offload;
  p.masters_on_host = best->masters;
  p.update = best->update;
  p.device_static_bytes = best->device_static;
  p.grads_on_host = best->grads;
  p.device_peak_bytes = device_need(*best, in);
  // The activations of the steps after the first (compiled, when they are).
  const int64_t kept_act = compiled(in) ? compiled_activations(*best, in) : kept_activations(*best, in);
  p.host_bytes = best->host + in.activations.host_bytes;
  p.device_bytes_per_param = double(best->device_static) / double(in.param_elements);
  p.update_seconds = best->update_seconds;
  // The host update of the blocks runs behind the next forward (Note [Update behind the forward]):
  // it hides up to the first micro-batch's forward, taken as a third of its forward and backward.
  if (best->offload && best->update == UpdateOn::cpu && !best->grads && in.offload.overlap_forward &&
      in.state_shards == 1)
    p.hidden_update_seconds =
        std::min(best->update_seconds, in.compute_seconds / double(std::max<int64_t>(1, in.micro_batches)) / 3);
  p.step_seconds = in.compute_seconds > 0 ? in.compute_seconds + best->update_seconds - p.hidden_update_seconds +
                                                in.activations.extra_seconds
                                          : 0;
  p.activations = in.activations;
  std::ostringstream os;
  os << "memory plan: " << describe(*best)
     << (in.state_shards > 1 ? (in.measured_parameter_bytes >= 0 ? " (ZeRO-3: this rank's parameters, gradient and moments, 1/"
                                : in.shard_gradients                ? " (ZeRO-2: this rank's moments and averaged gradient, 1/"
                                                                    : " (ZeRO-1: this rank's moments, 1/") +
                                   std::to_string(in.state_shards) + " of them)"
                             : std::string())
     << "\n  device: " << fmt(p.device_peak_bytes) << " predicted peak = " << fmt(p.device_static_bytes)
     << (p.masters_on_host ? " 16-bit copies/resident parameters/gradients"
                           : p.offload_state ? " parameters/gradients/staging" : " parameters/gradients/optimizer state")
     << " (" << std::round(p.device_bytes_per_param * 100) / 100 << " bytes per parameter) + " << fmt(kept_act) << " activations"
     << (in.device_budget ? " (budget " + fmt(in.device_budget) +
                                (headroom_text(in).empty() ? std::string() : ", " + headroom_text(in)) + ")"
                          : std::string());
  if (compiled(in))
    os << "\n  compiled steps: " << fmt(kept_activations(*best, in)) << " of activations eager, "
       << (in.activations.compiled_saving > 0 ? "less " + fmt(in.activations.compiled_saving) + " the compiler recomputes, "
                                               : std::string())
       << "plus " << fmt(in.activations.compiled_excess) << " of the arena's packing; the first step runs eager"
       << (in.activations.warmup_bytes >= 0 ? " with every block recomputed (" + fmt(in.activations.warmup_bytes) +
                                                  " of activations)"
                                            : std::string())
       << ", before the optimizer state is made, at " << fmt(first_step_need(*best, in));
  os << "\n  host: " << fmt(p.host_bytes) << (in.host_budget ? " (budget " + fmt(in.host_budget) + ")" : std::string());
  const ActivationPlan& a = in.activations;
  os << "\n  activations: " << a.kept << " blocks kept, " << a.offloaded << " offloaded, " << a.recomputed
     << " recomputed" << (a.regions.empty() ? std::string() : " (regions: " + a.regions + ")");
  if (p.step_seconds > 0)
    os << "\n  predicted step: " << std::round(p.step_seconds * 1e4) / 10 << " ms (update "
       << std::round(p.update_seconds * 1e4) / 10 << " ms"
       << (p.hidden_update_seconds > 0
               ? ", " + fmt_ms(p.hidden_update_seconds) + " of it behind the next step's first forward"
               : std::string())
       << ")";
  p.text = os.str();
  return p;
}

UpdateOn faster_update(const PlanInput& in) {
  BLU_CHECK(in.param_elements > 0, "offloaded update: no parameters");
  return candidate(in, true, UpdateOn::device).update_seconds < candidate(in, true, UpdateOn::cpu).update_seconds
             ? UpdateOn::device
             : UpdateOn::cpu;
}

double probe_host_adamw(int threads) {
  const int64_t n = int64_t(1) << 23;
  std::vector<float> p(size_t(n), 0.5f), g(size_t(n), 0.01f), m(size_t(n), 0.f), v(size_t(n), 0.f);
  const auto k = AdamWCoefficients::make(1e-3, 0.9, 0.95, 1e-8, 0.1, 1);
  const auto t0 = std::chrono::steady_clock::now();
  adamw_host_update(p.data(), g.data(), m.data(), v.data(), nullptr, DType::bf16, n, k, {}, threads);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(n) / std::max(s, 1e-9);
}

double probe_transfer(CopyEngine& engine) {
  const int64_t n = int64_t(16) << 20;  // 64 MiB of floats
  Tensor host = empty_from(host_allocator_for(engine.device()), {n}, DType::f32);
  Tensor dev = empty({n}, DType::f32, engine.device());
  engine.copy(dev, host, Lane::in);  // warm-up
  engine.host_wait(engine.record(Lane::in));
  const auto t0 = std::chrono::steady_clock::now();
  engine.copy(dev, host, Lane::in);
  engine.host_wait(engine.record(Lane::in));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(n * 4) / std::max(s, 1e-9);
}

}  // namespace blu::offload
