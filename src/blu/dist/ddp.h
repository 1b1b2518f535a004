// dist/ddp: data parallelism over a ProcessGroup — every rank holds the whole model, trains on its
// own slice of the global batch, and gradients are averaged across ranks before the optimizer
// step, so all ranks take the same step (PyTorch's DistributedDataParallel, without a forward
// wrapper: call the module as usual).
//   Construction broadcasts rank 0's parameters (and floating buffers) to every rank, then groups
//   the parameters into buckets in reverse registration order (roughly the order backward
//   produces their gradients): the first bucket holds about first_bucket_mib MiB, so the first
//   all-reduce starts as soon as the last layers' gradients exist; the others about bucket_mib.
//   Gradients are bucket views (PyTorch's gradient_as_bucket_view): a bucket is one flat buffer,
//   and each parameter's gradient *is* its slice of it. DDP gives each parameter that slice as its
//   grad slot (Tensor::set_grad_slot): when backward delivers a gradient while .grad is undefined
//   (after zero_grad(), or the first time), the engine puts it straight into the slot and makes
//   the slot the .grad — with 16-bit compute the master weight's cast converts directly into it;
//   otherwise the fresh gradient is copied there — and later micro-batches add into it in place.
//   So the bucket is filled by the engine's own accumulation: the hook copies nothing into the
//   bucket and finish() copies nothing back out of it. A .grad handle kept across steps is bucket
//   memory: it sees the next step's gradient.
//   A grad hook on each parameter marks it ready; when every parameter of a bucket is ready the
//   bucket's all-reduce (average, in place) is issued at once and runs on the group's worker
//   thread (Gloo) or communication stream (NCCL: CUDA parameters, buckets on their device) while
//   backward goes on. Buckets are issued strictly in bucket order, so every rank issues the same
//   sequence of collectives whatever order its hooks fire in.
//   finish() — call after the last backward of a step, before unscaling, clipping and the
//   optimizer — issues the buckets still waiting and waits for all of them; then every .grad is
//   the averaged bucket view. On NCCL the wait is stream-ordered (no host synchronisation).
//   no_sync() (or set_sync(false)) for the micro-batches of gradient accumulation before the last:
//   backward only accumulates locally (into the bucket views); the last micro-batch's backward
//   (sync on) communicates.
// A replaced gradient is never lost: a hook (or finish()) that finds a parameter's .grad is not
// its bucket view — the user called set_grad() with another tensor — copies that gradient into
// the bucket (counted by copied_gradients(), reported once on stderr), and finish() points .grad
// back at the view, which then holds the average.
// Unused parameters: a parameter with no gradient on this rank at finish() contributes zeros, so
// the average is over all ranks with zeros for the ranks that did not use it. A parameter unused
// on every rank ends up with a zero gradient (not an undefined one): AdamW then still decays its
// moments and applies weight decay, where single-process training would skip it. (PyTorch needs
// find_unused_parameters=True for this; here it is always on and costs nothing extra.)
// Row exchange (DDPOptions::exchange_rows), for a tied token embedding such as GPT's wte: its
// weight gets two gradients — the LM head's, dense, made by the first op of backward, and the
// embedding's, a few rows, made by the last. Summed into one .grad, the whole [V, C] gradient is
// ready only when backward ends and its all-reduce (the largest of the step) cannot overlap
// anything. With row exchange the embedding hands its output gradient to DDP (nn::Embedding's row
// sink) instead: the weight's bucket — its own, issued first — holds only the LM head's part and
// is reduced while backward goes on; the rows are exchanged after the last bucket — every rank's
// token ids and output-gradient rows all-gathered when world × tokens ≤ rows_gather_limit ×
// vocabulary (fewer bytes than the dense gradient), else summed locally into a dense [V, C]
// gradient and all-reduced — and finish() adds them, averaged, into the weight's gradient
// (embedding_backward_add_, deterministic: every rank adds the same rows in the same order). The
// result is the same average as without it, up to fp32 rounding. Under no_sync the rows are added
// into the local gradient at once. Every rank's batch must hold the same number of tokens, and the
// embedding must be used in every synced step (finish() raises an error otherwise).
// Depends on dist/process_group, dist/row_exchange, nn/module, nn/layers (Embedding), ops/. Keep: each parameter's hook fires once per
// backward (the engine sums a leaf's incoming gradients before accumulating), so two synced
// backwards without finish() in between are an error; between a synced backward and finish()
// the gradients are being reduced in place — read or write them only after finish(); hooks hold
// only a weak reference, so a destroyed DDP leaves inert hooks behind (and removes its grad
// slots; gradients that are views keep their bucket alive).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/nn/layers.h"
#include "blu/nn/module.h"

namespace blu::dist {

struct DDPOptions {
  double bucket_mib = 25.0;  // bucket capacity; a parameter larger than this gets a bucket alone
  // Capacity of the first bucket (the gradients backward makes first), as PyTorch's 1 MiB: a
  // small first all-reduce starts while the rest of backward runs. >= bucket_mib: no special case.
  double first_bucket_mib = 1.0;
  // Embeddings of the wrapped model (alive as long as the DDP) whose gradient is exchanged as
  // rows (see the header comment); meant for tied embeddings.
  std::vector<nn::Embedding*> exchange_rows;
  // Row exchange gathers the rows while world × tokens ≤ this × num_embeddings; above, it
  // all-reduces them as a dense gradient.
  double rows_gather_limit = 1.0;
  // The dtype the buckets travel in when narrower than theirs (bf16: half the bytes of fp32
  // buckets; each bucket is cast into a temporary before its all-reduce and the average cast back
  // into the bucket by finish()); nullopt: the buckets' own. The rows of exchange_rows travel in
  // their own dtype either way. Changes the arithmetic: the sum over ranks is rounded to this dtype.
  std::optional<DType> reduce_dtype;
};

// Copies rank `root`'s parameters and floating buffers into every rank's module (in place).
void broadcast_parameters(nn::Module& module, ProcessGroup& pg, int root = 0);

class DistributedDataParallel {
 public:
  DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> pg, DDPOptions options = {});
  ~DistributedDataParallel();  // waits for issued buckets (their errors are dropped)
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Sync off: backward does not communicate (gradient accumulation before the last micro-batch).
  void set_sync(bool on);
  bool sync() const;
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& d) : d_(d), prev_(d.sync()) { d.set_sync(false); }
    ~NoSync() { d_.set_sync(prev_); }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& d_;
    bool prev_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Averages the step's gradients across ranks (see the header comment); afterwards every
  // parameter's .grad is its bucket view. A no-op while sync is off. Throws blu::Error if a
  // collective failed (a peer died, the timeout passed).
  void finish();

  nn::Module& module() { return module_; }
  ProcessGroup& process_group() { return *pg_; }
  // Parameter names per bucket, in bucket order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_layout() const;
  // Bucket b's flat buffer (1-d): its parameters' gradients are views into it, in layout order.
  Tensor bucket_buffer(size_t b) const;
  // Gradients that were not their bucket view and had to be copied into the bucket (a .grad the
  // user replaced); stays 0 on the fast path.
  int64_t copied_gradients() const;
  // Each bucket's all-reduce in this step so far: 0 not issued, 1 issued, 2 complete (polled by
  // `blutrain bench --comm-timeline` between backward and finish()).
  std::vector<int> bucket_states() const;
  // How the last synced step exchanged each exchange_rows embedding's rows: "gather" or "dense"
  // ("" before the first).
  std::vector<std::string> row_exchange_paths() const;
  // DDPOptions::reduce_dtype as resolved (with BLU_DDP_REDUCE_DTYPE): buckets of a wider dtype travel in it.
  std::optional<DType> reduce_dtype() const;

 private:
  struct State;
  nn::Module& module_;
  std::shared_ptr<ProcessGroup> pg_;
  std::shared_ptr<State> state_;
};

}  // namespace blu::dist
