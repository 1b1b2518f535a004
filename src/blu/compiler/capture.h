// compiler/capture: records one training step into a compiler::Graph at the dispatch point,
// without computing it. A Capture turns on meta dispatch (Note [Meta dispatch], ops/dispatch.h)
// for its thread and observes every call: each op becomes a graph op, each tensor a value, each
// storage a buffer. The step's host logic — the model's forward, autograd's backward (its calls go
// through dispatch too), the optimizer's update, DDP's and ZeRO's hooks — runs as in an eager
// step, so every host-side effect (optimizer step counts, generator offsets, storage versions,
// hooks' bookkeeping) happens exactly once, as eagerly; only the kernels do not run. Collectives
// do not go through dispatch: a process group wrapped by capturable() records them as opaque
// collective ops while a Capture is active and runs them otherwise.
// The tensors the step made are kept (Capture::tensors): their storages are unbacked until the
// runtime (compiler/runtime.h) gives them bytes and runs the kernels over them.
// Depends on compiler/graph, ops/dispatch, dist/process_group. Keep: a Capture is active on one
// thread, one at a time; the step must not read tensor values on the host (an unbacked tensor has
// no bytes) — the loss scaler's and the trainer's reads happen after the step, in Strategy::read.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "blu/compiler/graph.h"
#include "blu/core/tensor.h"
#include "blu/dist/process_group.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/meta_dispatch.h"

namespace blu::compiler {

// What tensors made before a step are, by storage: their buffer kind and name (Capture::classify).
using BufferClasses = std::unordered_map<const Storage*, std::pair<BufferKind, std::string>>;

class Capture {
 public:
  Capture();   // starts recording on this thread (BLU_CHECK: no other Capture active on it)
  ~Capture();  // stops recording if finish() was not called
  // Distinct for every Capture of the process (two captures may share an address in turn).
  uint64_t serial() const { return serial_; }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;

  // Names what a tensor made before the step is, for the graph's buffer kinds (unnamed ones are
  // constants). Call before the step runs.
  void classify(const Tensor& t, BufferKind kind, const std::string& name = "");
  // The same for many tensors at once, kept by the caller and consulted after classify()'s (which
  // wins where both name a storage): `classes` must outlive the capture and not change during it.
  void classify_all(const BufferClasses* classes) { shared_classes_ = classes; }
  // Makes room for a step the size of `like` (a previous capture of the same step), so that
  // recording grows no table on the way.
  void reserve_like(const Graph& like);

  // Stops recording and completes the graph: the buffers the step made that are still referenced
  // outside the capture (the loss, a gradient kept as .grad) become step outputs.
  Graph& finish();

  Graph& graph() { return graph_; }
  // Per value id, the tensor the step used; per buffer id, its storage.
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const std::vector<std::shared_ptr<Storage>>& storages() const { return storages_; }

  // Called after each op the capture records (Note [Streamed replay], compiler/compile.h), with
  // the capture paused: kernels it runs are not recorded, and dispatch is real.
  void set_listener(std::function<void()> listener) { listener_ = std::move(listener); }
  // While a Pause lives the capture records nothing and dispatch on its thread is real.
  class Pause {
   public:
    explicit Pause(Capture& c);
    ~Pause();
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    Capture& c_;
    MetaDispatchGuard real_{false};
  };

  // The Capture recording on this thread, or null.
  static Capture* active();
  // A collective over `in` that writes the inputs listed in `writes` in place, recorded as an
  // opaque op that `call` replays; returns the op's index. `wait` (Note [Deferred collective
  // waits], capture.cpp): what completes it, replayed by the wait op that record_wait(index)
  // records — or finish(), at the end of the step, when nothing did.
  int record_collective(const std::string& name, Attrs attrs, std::vector<Tensor> in, std::vector<int> writes,
                        std::function<void(std::span<const Tensor>)> call, std::function<void()> wait = {});
  // The wait op of collective op `collective` (reads every value it touches); once per collective.
  void record_wait(int collective);

 private:
  void on_op(const OpDef& op, std::span<const Tensor> in, std::span<const Tensor> out, const Attrs& attrs);
  int value_of(const Tensor& t);     // the value of a tensor seen before, or a new input value
  int buffer_of(const Tensor& t, BufferKind kind_if_new);
  // writes: the value holds its buffer's newest contents (a fresh output, an in-place write).
  int new_value(const Tensor& t, int buffer, int producer, bool writes);
  int alias_of_current(const Tensor& t, int buffer);
  // eager_ref_counts (ops/dispatch.h) while this capture records: t's counts without our references.
  RefCounts eager_counts(const Tensor& t) const;

  Graph graph_;
  std::vector<Tensor> tensors_;
  std::vector<std::shared_ptr<Storage>> storages_;
  std::unordered_map<const TensorImpl*, int> value_ids_;
  std::unordered_map<const Storage*, int> buffer_ids_;
  BufferClasses classes_;
  const BufferClasses* shared_classes_ = nullptr;
  std::vector<std::vector<int>> values_on_;  // per buffer: its values' ids
  std::vector<int> latest_;   // per buffer: the value that wrote its current contents (-1: none, an input)
  std::vector<int> version_;  // per value: latest_ of its buffer when the value was defined
  int observer_ = -1;
  std::unique_ptr<MetaDispatchGuard> meta_;
  bool finished_ = false;
  uint64_t serial_ = 0;
  std::map<int, std::function<void()>> unwaited_;  // collective op → its wait, not yet recorded
  std::function<void()> listener_;
  void notify();
};

// A process group that records its collectives into the active Capture and forwards every call
// to `inner` otherwise. Replay issues each recorded collective on `inner` where it was issued and
// waits for it where the caller waited for its Work (Note [Deferred collective waits]).
std::shared_ptr<dist::ProcessGroup> capturable(std::shared_ptr<dist::ProcessGroup> inner);
// Waits for every collective that replays on this thread issued and whose wait op has not run
// (before a step's values leave the arena: Runtime::salvage).
void wait_issued_collectives();

}  // namespace blu::compiler
