// autograd/saved_hooks: what happens to a tensor an op node saves for its backward — PyTorch's
// saved_tensors_hooks. While a SavedTensorHooks scope is open on this thread, every tensor a node
// saves (an op's save_inputs / save_outputs, a recompute region's inputs) is offered to the open
// hooks, innermost first; the first that returns a box keeps the tensor in that box instead of the
// node, and the node's backward gets the tensor back from box->unpack(). A hook that returns null
// declines (the next one is asked; when none takes it, the node keeps the tensor as usual).
// The activation policies use it: a recompute region's dropped output is packed as "run the region
// again" (autograd/checkpoint.h), an activation bound for host memory as "the host copy"
// (models/activations.h).
// Depends on core/tensor. Keep: a box is unpacked only while its node's backward runs (the node
// drops what unpack returned right after that backward, and the box with its saved tensors);
// unpack returns a tensor with the saved one's shape, strides, dtype, device and values.
#pragma once
#include <functional>
#include <memory>

#include "blu/core/tensor.h"

namespace blu {

struct SavedBox {
  virtual ~SavedBox() = default;
  virtual Tensor unpack() = 0;
};

// What a hook is told about a saved tensor: `fresh` is true for an output the op just made (not a
// view and not written in place), false for an input (which may be a parameter or any older
// tensor); `t` still carries its autograd state (a parameter is a leaf that requires grad).
struct SavedInfo {
  const Tensor& t;
  bool fresh;
};
using PackHook = std::function<std::shared_ptr<SavedBox>(const SavedInfo& info)>;

// RAII: adds `pack` as the innermost hook of this thread for the scope.
class SavedTensorHooks {
 public:
  explicit SavedTensorHooks(PackHook pack);
  ~SavedTensorHooks();
  SavedTensorHooks(const SavedTensorHooks&) = delete;
  SavedTensorHooks& operator=(const SavedTensorHooks&) = delete;
};

bool saved_hooks_active();
// The box of the first open hook that takes `t`, innermost first; null when none does (or none is
// open). Hooks run with the hooks of their own scope and inner ones closed, so a hook that runs
// ops saves nothing through itself.
std::shared_ptr<SavedBox> pack_saved(const Tensor& t, bool fresh);

// A saved tensor as a node keeps it: the tensor itself, or the box a hook packed it into.
struct SavedSlot {
  Tensor tensor;
  std::shared_ptr<SavedBox> box;
  // `t` (detached) or its box.
  static SavedSlot save(const Tensor& t, bool fresh);
  Tensor get() const { return box ? box->unpack() : tensor; }
};

}  // namespace blu
