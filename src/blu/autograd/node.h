// autograd/node: the graph reverse-mode differentiation walks. Each op call that needs gradients
// leaves an OpNode holding its BackwardContext (only what its backward reads) and one edge per
// input to the node that produced that input — or, for a leaf, to the leaf's AccumulateGrad.
// Depends on ops/dispatch (OpDef, BackwardContext). Keep: nodes own their inputs' producers
// (edges are shared_ptr), never their outputs, so a graph is freed with its last output.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "blu/autograd/saved_hooks.h"
#include "blu/core/tensor.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/early_grad.h"

namespace blu {

struct Edge {
  std::shared_ptr<Node> fn;  // null: this input needs no gradient
  uint32_t input_nr = 0;     // which output of fn the gradient belongs to
};

struct Node {
  virtual ~Node() = default;
  // Gradients of this node's inputs, given those of its outputs (one per output).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) = 0;
  virtual std::string name() const = 0;
  virtual void release_saved() {}
  // The engine tells the next apply() whether it will release the saved tensors right after it
  // (Note [Donated buffers], ops/dispatch.h); only ops can use it.
  virtual void will_release_saved(bool /*yes*/) {}
  // The engine offers `dst` as where input `input`'s gradient may be written (see
  // BackwardContext::grad_dst); only ops can use it.
  virtual void offer_grad_destination(size_t /*input*/, const Tensor& /*dst*/) {}
  // The engine tells the next apply() which output's gradient is its own seed, exactly 1 (-1:
  // none; BackwardContext::unit_grad_output); only ops can use it.
  virtual void offer_unit_grad(int /*output*/) {}
  // Whether the backward can return input `input`'s gradient in a wider dtype, and the engine's
  // request that it do so (Note [Wide gradients], ops/dispatch.h); only ops can.
  virtual bool can_widen_grad(size_t /*input*/) const { return false; }
  virtual void offer_grad_dtype(size_t /*input*/, DType /*dtype*/) {}
  // Whether the backward can add input `input`'s waiting gradient into its own, the engine's offer
  // of it, and whether the last apply() did (Note [Folded gradient sums], ops/dispatch.h).
  virtual bool can_fold_grad(size_t /*input*/) const { return false; }
  virtual void offer_pending_grad(size_t /*input*/, const Tensor& /*pending*/) {}
  virtual bool folded_grad(size_t /*input*/) const { return false; }
  // A cast node whose output gradient may arrive in its source dtype: that dtype (else nullopt).
  virtual std::optional<DType> grad_source_dtype() const { return std::nullopt; }
  // A leaf's grad slot while its grad is undefined (AccumulateGrad); undefined otherwise.
  virtual Tensor fresh_grad_slot() const { return {}; }
  // Run as soon as ready, before any op node (Note [Sinks run first], engine.cpp).
  virtual bool is_sink() const { return false; }
  uint64_t seq = 0;                    // creation order; later nodes run first
  std::vector<Edge> next;              // one per input
  std::vector<TensorMeta> out_metas;   // to check incoming gradients
  int diff_outputs = 0;                // outputs [0, diff_outputs) carry gradients
};

struct OpNode final : Node {
  BackwardContext ctx;
  bool released = false;
  // Saved tensors a hook packed (autograd/saved_hooks.h): empty, or one per input then one per
  // output (null where the tensor sits in ctx as usual). apply() unpacks them into ctx for the
  // backward and drops the unpacked tensors after it.
  std::vector<std::shared_ptr<SavedBox>> boxed;
  // Told of an input's gradient from inside the backward, before the formula finishes (Note [Early
  // input gradients], ops/early_grad.h); empty for almost every node.
  EarlyGradFn early_grad;
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) override;
  std::string name() const override { return ctx.op->name; }
  void release_saved() override;
  void will_release_saved(bool yes) override { ctx.saved_released_after = yes; }
  void offer_grad_destination(size_t input, const Tensor& dst) override;
  void offer_unit_grad(int output) override { ctx.unit_grad_output = output; }
  bool can_widen_grad(size_t input) const override { return input < 32 && (ctx.op->wide_grads >> input & 1u); }
  void offer_grad_dtype(size_t input, DType dtype) override;
  bool can_fold_grad(size_t input) const override { return input < 32 && (ctx.op->folds_grads >> input & 1u); }
  void offer_pending_grad(size_t input, const Tensor& pending) override;
  bool folded_grad(size_t input) const override { return input < ctx.folded.size() && ctx.folded[input]; }
  std::optional<DType> grad_source_dtype() const override;
};

// A leaf's gradient sink: grad ← the incoming gradient (kept when nothing else refers to it, else
// cloned; with a grad slot: the slot, into which the gradient was written or is copied) the first
// time, grad += incoming after (in place), then the leaf's grad hooks.
struct AccumulateGrad final : Node {
  std::shared_ptr<TensorImpl> leaf;
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) override;
  std::string name() const override { return "AccumulateGrad"; }
  Tensor fresh_grad_slot() const override;
  bool is_sink() const override { return true; }
};

// A node with no inputs that hands the gradient of its one output to `sink` (attach_grad_sink).
struct GradSinkNode final : Node {
  std::function<void(const Tensor&)> sink;
  std::string label;
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) override;
  std::string name() const override { return label; }
  bool is_sink() const override { return true; }
};

// An alias of floating `x` that requires grad and whose gradient, when backward reaches it, is
// passed to `sink` (with grad mode off, on the backward's thread) instead of flowing into x's
// graph — x's own producers get nothing from it. `name` labels the node in errors. For a module
// that hands its gradient to someone else (nn::Embedding's row sink, DDP's row exchange).
Tensor attach_grad_sink(const Tensor& x, std::function<void(const Tensor& grad)> sink, std::string name);

// The edge through which a gradient reaches `t` (its producer, or its leaf accumulator).
Edge gradient_edge(const Tensor& t);
uint64_t next_node_seq();

}  // namespace blu
