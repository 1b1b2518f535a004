// dist/ddp: data parallelism over a ProcessGroup — every rank holds the whole model, trains on its
// own slice of the global batch, and gradients are averaged across ranks before the optimizer
// step, so all ranks take the same step (PyTorch's DistributedDataParallel, without a forward
// wrapper: call the module as usual).
//   Construction broadcasts rank 0's parameters (and floating buffers) to every rank.
//   Parameters are grouped into buckets of about bucket_mib MiB, in reverse registration order
//   (roughly the order backward produces their gradients). A grad hook on each parameter copies
//   its gradient into the bucket's flat buffer; when every parameter of a bucket has its gradient
//   the bucket's all-reduce (average) is issued at once and runs on the group's worker thread
//   (Gloo) or communication stream (NCCL: CUDA parameters, buckets on their device) while
//   backward goes on. Buckets are issued strictly in bucket order, so every rank issues the
//   same sequence of collectives whatever order its hooks fire in.
//   finish() — call after the last backward of a step, before clipping and the optimizer — issues
//   the buckets still waiting, waits for all of them and copies the averaged gradients back.
//   no_sync() (or set_sync(false)) for the micro-batches of gradient accumulation before the last:
//   backward only accumulates locally; the last micro-batch's backward (sync on) communicates.
// Unused parameters: a parameter with no gradient on this rank at finish() contributes zeros, so
// the average is over all ranks with zeros for the ranks that did not use it. A parameter unused
// on every rank ends up with a zero gradient (not an undefined one): AdamW then still decays its
// moments and applies weight decay, where single-process training would skip it. (PyTorch needs
// find_unused_parameters=True for this; here it is always on and costs nothing extra.)
// Depends on dist/process_group, nn/module, ops/. Keep: each parameter's hook fires once per
// backward (the engine sums a leaf's incoming gradients before accumulating), so two synced
// backwards without finish() in between are an error; hooks hold only a weak reference, so a
// destroyed DDP leaves inert hooks behind.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "blu/dist/process_group.h"
#include "blu/nn/module.h"

namespace blu::dist {

struct DDPOptions {
  double bucket_mib = 25.0;  // bucket capacity; a parameter larger than this gets a bucket alone
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

  // Averages the step's gradients across ranks (see the header comment). A no-op while sync is
  // off. Throws blu::Error if a collective failed (a peer died, the timeout passed).
  void finish();

  nn::Module& module() { return module_; }
  ProcessGroup& process_group() { return *pg_; }
  // Parameter names per bucket, in bucket order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_layout() const;

 private:
  struct State;
  nn::Module& module_;
  std::shared_ptr<ProcessGroup> pg_;
  std::shared_ptr<State> state_;
};

}  // namespace blu::dist
