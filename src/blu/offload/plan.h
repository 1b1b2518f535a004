// offload/plan: the memory budget planner — given the parameter count, the precision, the
// activations' device bytes and the device and host budgets, it decides where the optimizer state
// lives (device, or host with the update on the CPU or streamed through the device, and with it,
// when nothing else fits, the fp32 master weights), predicts the
// device's peak bytes and the step time, prints the plan, and fails early, naming the numbers, when
// no layout fits. `blutrain train|bench --gpu-memory-budget/--host-memory-budget` run it.
// The activation side (selective / whole-block recompute, activation offload: autograd/ and
// models/, not here) hands its decision over as an ActivationPlan: the planner only adds its bytes
// and time; without one, the trainer measures one micro-batch's forward and backward (probe).
// Depends on offload/offload_adamw (bytes of its staging, UpdateOn). Keep: the byte counts are the
// ones the allocators count (requested bytes), so a run's peak can be checked against the plan.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "blu/offload/offload_adamw.h"

namespace blu::offload {

// What the activation planner (recompute/offload of saved activations) decided, per step.
struct ActivationPlan {
  int64_t blocks = 0;              // repeated blocks of the model
  int64_t kept = 0;                // blocks whose saved activations stay on the device
  int64_t offloaded = 0;           // blocks whose saved activations go to host memory
  int64_t recomputed = 0;          // blocks recomputed in backward (whole block or selective)
  std::string regions;             // what selective or mlp recompute rebuilds ("" none, "attention core, MLP", ...)
  int64_t device_bytes = 0;        // peak bytes of activations (and gradients being built) on the device
  int64_t host_bytes = 0;          // bytes of offloaded activations in host memory
  double extra_seconds = 0;        // recompute and exposed transfer time per step
  // Under --compile (compiler::compiled_peak_change): what the compiler's own recompute
  // (--compile-remat) takes off the compiled steps' activations, and what its arena adds beyond
  // their live peak. The first step runs eager before the optimizer has made its moments, with
  // warmup_bytes of activations (every block recomputed: Note [The warm-up step recomputes every
  // block], models/activations.h; -1: device_bytes): the plan's peak is the larger of the two.
  int64_t compiled_saving = 0, compiled_excess = 0;
  int64_t warmup_bytes = -1;
};

struct PlanInput {
  int64_t param_elements = 0;      // this rank's parameter elements
  int64_t compute_copy_bytes = 0;  // bytes per element of the 16-bit compute copies (0 in fp32, 2 in bf16/fp16)
  ActivationPlan activations;      // device_bytes includes the gradients' transient growth? see grads_in_activations
  bool grads_in_activations = false;  // activations.device_bytes already counts the gradients (a probe does)
  int64_t device_budget = 0;       // bytes, 0: none
  // The share of device_budget kept free for what the probe does not see (on a GPU the step's peak
  // came out up to 1.8% above the plan: the trainer keeps 2% there).
  double device_headroom = 0;
  int64_t host_budget = 0;         // bytes, 0: none
  // auto | none | optimizer | master (the optimizer state and the fp32 master weights: Note
  // [Masters on the host], offload/offload_adamw.h; bf16/fp16 only, the update on the cpu) |
  // master+grads (and the released parameters' gradients: Note [Gradients on the host]; one rank,
  // bf16). auto takes master, then master+grads, only when nothing before it fits.
  std::string offload_state = "auto";
  bool single_rank = true;         // master+grads: one rank (data parallelism reduces on the device)
  bool masters_allowed = true;     // master, master+grads: implemented for data parallelism only
  int64_t micro_batches = 1;       // per step (master+grads moves each micro-batch's gradients)
  std::string offload_update = "auto";  // auto | cpu | gpu
  // master: the parameter elements that stay fp32 on the device (looked up in their own dtype:
  // embeddings).
  int64_t resident_elements = 0;
  // Split masters (Note [Split masters], optim/master_split.h; the state on the device): the
  // elements held as their compute copy and 2 low bytes, 2 bytes each below an fp32 master.
  int64_t split_elements = 0;
  // Bytes per element of AdamW's two moments: 8 (f32), or 4 (bf16, --adamw-state bf16: Note
  // [Stochastic bf16 moments], core/round_stochastic.h), which are held on the device only.
  int64_t moment_bytes = 8;
  OffloadOptions offload;          // chunk size, threads (update is decided here)
  // ZeRO-1 over this many ranks (1: none): each rank keeps the moments of its 1/state_shards of
  // the parameters; offloaded, they stream through the device (the update on the device only).
  int64_t state_shards = 1;
  // ZeRO-2 (with state_shards > 1): each rank keeps the averaged gradient of its 1/state_shards (4
  // bytes per element, from the step's first reduced bucket to its update) and the staging buffers
  // of the buckets being reduced (gradient_staging_bytes, added). A probe (grads_in_activations)
  // counts the first with the activations: it releases the synced micro-batch's gradients as
  // backward makes them and opens the shard gradient at the first, as ZeRO-2 does.
  bool shard_gradients = false;
  int64_t gradient_staging_bytes = 0;
  // ZeRO-3 (with state_shards > 1): the parameters are sharded too, so their bytes on the device
  // are measured, not modelled — this rank's parameter and gradient shards (the gathered units
  // are transient: the probe counts them with the activations). -1: (4 + compute_copy_bytes)
  // bytes per parameter element. The moments are planned on top, 1/state_shards of them.
  int64_t measured_parameter_bytes = -1;
  // Speeds for the step-time prediction (from the start-up probe; 0: not predicted).
  double compute_seconds = 0;      // forward + backward of the whole step
  double host_adamw_elements_per_s = 0;
  double transfer_bytes_per_s = 0;  // host <-> device, one direction
  double device_adamw_elements_per_s = 0;
};

struct MemoryPlan {
  bool offload_state = false;
  bool masters_on_host = false;  // the fp32 parameters too (offload_state is then true)
  bool grads_on_host = false;    // and the released parameters' gradients (masters_on_host is then true)
  UpdateOn update = UpdateOn::cpu;
  int64_t device_static_bytes = 0;  // parameters, gradients, copies, state or staging
  int64_t device_peak_bytes = 0;    // static + activations
  int64_t host_bytes = 0;
  double device_bytes_per_param = 0;  // static / parameter elements
  double update_seconds = 0, step_seconds = 0;  // predicted (0: no speeds given)
  double hidden_update_seconds = 0;  // of update_seconds, behind the next forward (in step_seconds)
  ActivationPlan activations;
  std::string text;  // the plan, several lines, for the run header
};

// BLU_CHECK with the budget and what each layout needs when none fits.
MemoryPlan plan_memory(const PlanInput& in);
// The offloaded update the planner would pick for in.param_elements at the probed speeds (the one
// with the shorter predicted update; cpu when neither speed is known), budgets aside: for layouts
// the planner does not model.
UpdateOn faster_update(const PlanInput& in);

// The start-up probe's host side: elements per second of the threaded host AdamW (about 8M
// elements, once).
double probe_host_adamw(int threads);
// Bytes per second of one host -> device copy through `engine` (64 MiB, once; a CPU pool: memcpy).
double probe_transfer(CopyEngine& engine);

int64_t gib_to_bytes(double gib);

}  // namespace blu::offload
