// offload/offload_adamw: AdamW with its state in host memory — the first and second moments
// (and, when the host runs the update, an fp32 master copy of each parameter) live in pinned host
// memory on CUDA (host memory beside the device pool cpu:N on a CPU
// build), so the device holds only what the forward and backward need: the parameters, their
// gradients and the 16-bit compute copies. Two ways to run the update, chosen per machine
// (OffloadOptions::update; the planner's probe picks for `auto`, offload/plan.h):
//   cpu    — the gradients go to the host in pieces through a staging ring (Note [Gradient
//            staging]), the host runs the threaded AdamW (offload/host_adamw.h) on master, moments
//            and gradient piece by piece, and each new piece goes back on the in lane; the
//            compute lane waits for the uploads by an event. The 16-bit compute copies are
//            re-cast on the device by the next forward. One host read per step: the norm gate's
//            total (the host needs the clip decision). Given the model's blocks, the update of
//            their parameters runs behind the next forward (Note [Update behind the forward]).
//            With masters_on_host the fp32 parameters leave the device too (release_parameters):
//            the host master is the parameter, the update writes its 16-bit rounding into a slot
//            of the up ring that goes up into the compute copy (2 bytes per element instead of 4),
//            and the device keeps the copies and the gradients (Note [Masters on the host]).
//   device — the moments stream through the device in chunks of chunk_elements: chunk i+1 is
//            uploaded on the in lane while chunk i is updated on the compute lane (the adamw_step
//            op: the device kernel, norm gate decided on the device) and chunk i-1 is downloaded
//            on the out lane; two staging buffers, ordered by events, no host wait inside the step.
// Both produce bit for bit the plain AdamW's parameters, moments and compute copies (the host
// update has the kernels' arithmetic; the device update is the kernel), and the state has the plain
// AdamW's names (optim/optimizer.h), so checkpoints move between the two.
// Depends on optim/ (the Optimizer interface, state parsing), ops/ (adamw_step_, views), nn/
// (compute copies), offload/host_adamw, offload/transfer. Keep: host state is read or written only
// after the events of the copies that touch it (state() waits for them); a parameter written by
// anyone else (a checkpoint load, a broadcast) is noticed by its storage version and its master
// re-read before the next host update.
//
// Note [Masters on the host]
// A parameter whose forward reads only its 16-bit compute copy (Module::cast_param: every linear and
// norm of a bf16/fp16 run) needs no fp32 bytes on the device: release_parameters() keeps its value
// as the host master and points its storage at no bytes (shape, dtype and device unchanged, like a
// pipeline's unowned parameters), and the copy stays current because nothing writes the parameter
// but the update, which re-stamps the copy (ComputeCopy::mark_written). The backward still
// accumulates an fp32 gradient on the device. Whoever must read or write the values (checkpoints)
// takes host_view(): while it lives each released parameter's storage views its host master
// (device kCPU), and a write through it is re-cast into the copy when the view ends. Parameters read
// in their own dtype (an nn::Embedding's lookup) must stay resident: the caller chooses.
//
// Note [Gradient staging]
// The host update needs a gradient on the host only while it updates it, so a gradient on the
// device comes down in pieces of at most chunk_elements into kRingSlots host slots: piece t uses
// slot t % kRingSlots, and its copy is queued on the out lane once piece t - kRingSlots has been
// updated, so the copies run ahead of the update by the ring's depth and the host keeps 12 bytes
// per element (master, two moments) instead of 16. The update is elementwise, so the pieces give
// the parameter's update bit for bit.
//
// Note [Update behind the forward]
// The host update needs the clip decision, so it starts after the last backward, and the next
// forward cannot read a parameter before its update is uploaded. Given the model's blocks
// (overlap_with_forward: each block's parameters, in forward order), step() updates the
// parameters no block reads (embeddings, final norm, head) itself, hands the blocks' parameters,
// block by block, to a worker thread and returns: the next forward embeds while the host updates
// block 0, and a hook before each block (wait_block) holds the forward there — the host until that
// block's uploads are queued, the compute lane until they land. A parameter that several blocks
// read belongs to the first. The worker reads only what step() handed it (the host state, the
// rings, the gradients it took from the parameters before returning) and is joined
// (finish_update) before the next backward, before state is read or written, and by step(): the
// next backward's gradients never meet its copies. What it can hide is about one forward a step:
// the forward's last block waits for the update's last piece. The worker's host AdamW leaves a core
// to the calling thread (threads_beside_one). The arithmetic is the same, so the results are bit
// for bit those without it.
//
// Note [Gradients on the host]
// With grads_on_host a released parameter's gradient leaves the device too. A grad hook (run
// after each micro-batch's backward has accumulated the parameter's gradient) queues its copy to
// the host on the out lane, after the compute lane's work so far, and takes the gradient off the
// parameter, so every micro-batch's backward starts it afresh: the first micro-batch's lands in
// the host accumulator, later ones in a slot of the down ring that the host adds in (fp32, the
// device's accumulation order: grad + incoming) before the parameter's next micro-batch lands,
// before the slot is reused, and at the step. The device bytes stay referenced until their copy is
// done (grad_window_bytes of them in flight; past it the compute lane waits for the oldest copy, so
// the allocator reuses nothing a copy still reads). finish_host_gradients() completes the
// accumulation and gives the sum of their squares for the norm gate. Device bytes per released
// parameter: the 16-bit copy alone.
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blu/offload/host_adamw.h"
#include "blu/offload/transfer.h"
#include "blu/optim/optimizer.h"

namespace blu::offload {

enum class UpdateOn : uint8_t { cpu, device };
const char* update_name(UpdateOn u);  // "cpu", "gpu"
UpdateOn parse_update(const std::string& name);  // "cpu", "gpu" (or "device")

struct OffloadOptions {
  UpdateOn update = UpdateOn::cpu;
  int64_t chunk_elements = int64_t(1) << 22;  // elements per streamed chunk (device update) or piece (host update)
  int threads = 0;                             // host update: 0 = OpenMP's default
  bool masters_on_host = false;  // host update only: see Note [Masters on the host]
  // With masters_on_host: the released parameters' gradients go to the host as each micro-batch's
  // backward makes them, and are accumulated there (Note [Gradients on the host]).
  bool grads_on_host = false;
  // Device bytes of such gradients whose copy to the host may still be running; past it the
  // compute lane waits for the oldest copy before its gradient's bytes go back.
  int64_t grad_window_bytes = int64_t(64) << 20;
  // Host update only: the blocks' update runs behind the next forward when the model's blocks are
  // given (Note [Update behind the forward]; dist::Strategy gives them when this is set and the
  // gradients stay on the device). Off by default: on an H200 host it gained -5% to +17%.
  bool overlap_forward = false;
};

class OffloadAdamW final : public optim::Optimizer {
 public:
  // Every parameter on one device (a GPU or a pool cpu:N), f32.
  OffloadAdamW(std::vector<optim::ParamGroup> groups, optim::AdamWOptions opt, OffloadOptions options);
  ~OffloadAdamW() override;
  void step(const NormGate& gate) override;
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;
  void attach_compute_copies(const nn::ComputeCopies& copies) override;

  // masters_on_host: the parameters `release(name, param)` accepts, each with a current 16-bit
  // compute copy, leave the device (Note [Masters on the host]); the others stay resident. Call once,
  // after the copies were made and before the first step. Returns the elements released.
  int64_t release_parameters(const std::function<bool(const std::string&, const Tensor&)>& release);
  bool released(size_t i) const;
  // grads_on_host: waits for the released parameters' gradient copies of this step, adds the last
  // micro-batch's in, and returns the sum of their squares (double, parameter order) for the norm
  // gate. Once per step, after the backward and before step().
  double finish_host_gradients();
  // grads_on_host: forgets the host gradients accumulated so far (Strategy::step, with zero_grad).
  void zero_host_gradients();
  // Host update (Note [Update behind the forward]): `blocks` are the names of the parameters each
  // block of the model reads, in forward order; from the next step on, their update runs behind
  // the next forward, which must call wait_block(b) before block b. Call once, before the first step.
  void overlap_with_forward(const std::vector<std::vector<std::string>>& blocks);
  // Before block b's forward: the host waits until the update of block b's parameters is queued,
  // the compute lane until their uploads have landed. Nothing when no update is running.
  void wait_block(size_t b);
  // The last step's update done and queued, the compute lane after its uploads; rethrows what the
  // worker threw. Nothing when none is running.
  void finish_update() const;
  // Runs on the worker before each block's update (tests slow it down or make it throw).
  void set_worker_hook(std::function<void(size_t block)> hook);
  // While the returned guard lives, every released parameter views its host master (kCPU).
  class HostView {
   public:
    explicit HostView(OffloadAdamW* opt);
    ~HostView();
    HostView(const HostView&) = delete;
    HostView& operator=(const HostView&) = delete;

   private:
    OffloadAdamW* opt_;
  };
  HostView host_view() { return HostView(this); }

  const OffloadOptions& options() const { return options_; }
  Device device() const { return device_; }
  // Host bytes per parameter element once every parameter has state: 8 (moments) for the device
  // update, 12 (moments, master) for the host update, 16 with the gradients on the host too (their
  // accumulator). Plus the rings: a few buffers of chunk_elements (and, with gradients on the
  // host, of the largest released parameter).
  static int64_t host_bytes_per_element(UpdateOn u, bool grads_on_host = false) {
    return u == UpdateOn::cpu ? (grads_on_host ? 16 : 12) : 8;
  }
  // Device bytes of the device update's staging buffers (two chunks of both moments), 0 for cpu.
  static int64_t staging_bytes(const OffloadOptions& o, int64_t total_elements);

 private:
  struct State;
  struct HostJob;
  struct Overlap;
  void step_on_host(const NormGate& gate);
  void run_pieces(HostJob& job, size_t begin, size_t end);  // the host update of job's pieces [begin, end)
  void issue_staged(HostJob& job, size_t until);             // staged pieces [0, until) queued down
  void step_on_device(const NormGate& gate);
  void ensure_state(size_t i);
  void refresh_master(size_t i);
  size_t next_up_slot();                // an up-ring slot whose last upload is done
  // A released parameter's piece [offset, offset + length): its 16-bit rounding in up-slot k into the copy.
  void upload_copy(size_t i, size_t k, int64_t offset, int64_t length);
  void land_gradient(size_t i, const Tensor& grad);  // grads_on_host: the grad hook
  void add_landed(size_t i);           // this parameter's landed micro-batch into its accumulator
  void complete_landing(size_t k);     // down-slot k's micro-batch into its parameter's accumulator
  void drain_in_flight();
  void view_masters();
  void end_view();

  optim::AdamWOptions opt_;
  OffloadOptions options_;
  Device device_;
  std::unique_ptr<CopyEngine> engine_;
  std::vector<std::string> names_;
  std::vector<Tensor> params_;
  std::vector<double> decay_;
  std::vector<std::unique_ptr<State>> state_;
  std::vector<std::shared_ptr<nn::ComputeCopy>> copies_;
  Tensor stage_m_[2], stage_v_[2];  // device update: the two chunk buffers
  // The last step's uploads / downloads (before the first step: the staging buffers' allocation).
  EventPtr pending_in_, pending_out_;
  struct InFlight {
    Tensor grad;  // device bytes a copy to the host still reads
    EventPtr copied;
  };
  std::deque<InFlight> in_flight_;
  // Host buffers used in turn: up_ (chunk_elements each) carries 16-bit roundings up to the compute
  // copies (Note [Masters on the host]), stage_ (chunk_elements each) the device's gradients down
  // to the host update (Note [Gradient staging]), down_ (the largest released parameter's size)
  // the gradients of a step's later micro-batches until they are added in (Note [Gradients on the
  // host]). A few of them instead of one per parameter keep the host at 12 or 16 bytes per element.
  struct Slot {
    Tensor buf;          // flat, host
    EventPtr done;       // the copy that last used it (null: none, or a CPU pool's)
    int64_t param = -1;  // down_: whose gradient it holds, not yet added in
  };
  static constexpr int kRingSlots = 4;
  std::vector<Slot> up_, down_, stage_;
  size_t up_next_ = 0, down_next_ = 0;
  int64_t in_flight_bytes_ = 0;
  std::shared_ptr<OffloadAdamW*> self_;  // the grad hooks hold it weakly: none fires after this is gone
  std::unique_ptr<Overlap> overlap_;     // null until overlap_with_forward
};

}  // namespace blu::offload
