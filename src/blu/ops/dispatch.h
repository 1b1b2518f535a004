// ops/dispatch: the one point every op call passes through. `dispatch(op, inputs, attrs)`:
//   1. checks the inputs (defined where required, one device) and runs the op's `infer`, which
//      checks the arguments and gives the outputs' shapes and dtypes;
//   2. makes the outputs — views for view ops, fresh allocations from the device's allocator
//      otherwise — and runs the backend kernel for the device (BLU_CHECK if it has none);
//   3. tells the observers (profiling, graph capture) what ran;
//   4. records autograd history through the recorder autograd/ installs, when grad mode is on
//      and an input requires grad.
// After an in-place kernel it bumps the version of every storage the op wrote (Note [Storage
// versions], core/storage.h).
// An op is an OpDef: a name, shape rules, and its backward formula written in other ops, with
// the inputs/outputs the backward needs declared so nothing else is saved.
// The kernel is found by the op's name in the device type's backend table (backend/ registers
// kernels by name and cannot include ops/) once per op and device type; the OpDef keeps it, so
// every later call reads a pointer instead of hashing the name.
// Depends on core/, memory/, backend/. Keep: no op computes outside this path.
#pragma once
#include <atomic>
#include <functional>
#include <span>
#include <vector>

#include "blu/core/attrs.h"
#include "blu/core/tensor.h"
#include "blu/ops/sharding.h"

namespace blu {

struct TensorMeta {
  Shape shape;
  DType dtype;
  Device device;
};

struct OpDef;
struct KernelCall;  // backend/backend.h

// What a backward formula sees: the attributes, the inputs and outputs the op chose to save (the
// others are undefined), every input's metadata, and which inputs need a gradient.
// grad_dst: where the engine would like input i's gradient written (a leaf's grad slot, see
// Tensor::set_grad_slot; undefined for most inputs). A formula that can produce that gradient in
// place writes it there and returns that very tensor, saving the copy into the slot; the others
// ignore it.
struct BackwardContext {
  const OpDef* op = nullptr;
  Attrs attrs;
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  std::vector<TensorMeta> input_metas;
  std::vector<bool> needs_grad;
  std::vector<Tensor> grad_dst;  // empty, or one per input; set only while the backward runs
  // grad_dtypes: the dtype in which input i's gradient is wanted when it is wider than the input's
  // (Note [Wide gradients]); empty, or one per input (the input's own dtype where not widened).
  std::vector<DType> grad_dtypes;
  // Set by the engine while the backward runs when the saved tensors are freed right after it (no
  // retain_graph): see donated_input().
  bool saved_released_after = false;
  // Set by the engine, while the backward runs, on the node a backward() without a given gradient
  // starts from: the gradient of output `unit_grad_output` is the seed the engine made, exactly 1
  // (ones). A formula may skip multiplying by it (x·1 is x, bit for bit). -1 otherwise.
  int unit_grad_output = -1;
  bool grad_is_one(size_t j) const { return unit_grad_output == int(j); }
  // pending_grads: input i's gradient from its other consumers, already summed and waiting for
  // this one's (Note [Folded gradient sums]); empty, or one per input, set only while the backward
  // runs, for inputs of bit i in OpDef::folds_grads. A formula whose kernel adds it takes it with
  // take_pending_grad(i, kernel_inputs): appended as the kernel's last input when there is one and
  // input i needs a gradient, and marked as folded, so the engine takes the result as the sum.
  std::vector<Tensor> pending_grads;
  mutable std::vector<bool> folded;
  void take_pending_grad(size_t i, std::vector<Tensor>& kernel_inputs) const {
    if (i >= pending_grads.size() || !pending_grads[i].defined() || !needs_grad.at(i)) return;
    kernel_inputs.push_back(pending_grads[i]);
    if (folded.size() <= i) folded.resize(i + 1);
    folded[i] = true;
  }
  const Tensor& input(size_t i) const;
  // Saved input i when this backward may write over it (Note [Donated buffers]): the saved tensors
  // are freed after this backward and nothing else — no tensor, view or other node — refers to
  // its storage. Undefined otherwise.
  Tensor donated_input(size_t i) const;
  Tensor donated_output(size_t j) const;  // the same for saved output j
  const Tensor& output(size_t i) const;
  const Shape& input_shape(size_t i) const { return input_metas.at(i).shape; }
  Tensor grad_destination(size_t i) const { return i < grad_dst.size() ? grad_dst[i] : Tensor(); }
  DType grad_dtype(size_t i) const { return i < grad_dtypes.size() ? grad_dtypes[i] : input_metas.at(i).dtype; }
  // Whether input i's gradient should be written somewhere given (a destination, or a wider
  // dtype than the input's), and where: the destination, else a new tensor in grad_dtype(i).
  bool grad_is_directed(size_t i) const {
    return grad_destination(i).defined() || grad_dtype(i) != input_metas.at(i).dtype;
  }
  Tensor grad_buffer(size_t i) const;
};

// Note [Donated buffers]
// A saved input that only its node still refers to dies with the node's saved tensors right after
// the backward — so the backward may write its result over it instead of allocating. GPT's logits
// are the case that matters: [B·T, V] 16-bit, the largest tensor of the step, saved by
// cross-entropy, whose backward makes a gradient of the same shape and dtype; written over the
// logits, the step's peak holds one such buffer instead of two. The logits qualify only when the
// caller has dropped its own handle to them before backward (the trainer and bench do) and the
// graph is not retained; otherwise the backward allocates as usual. The storage's reference count
// is the test: every tensor or view of the buffer, and every node that saved it, holds one.
// Under compiler capture (compiler/capture.h) the recorder keeps a handle to every tensor the step
// made, so the count would never read 1 and a compiled step would hold both buffers: the count is
// read through eager_ref_counts, which leaves the recorder's own references out.

// Note [Wide gradients]
// Under mixed precision a 16-bit weight is a cast of an fp32 master parameter, and the cast's
// backward widens the weight's gradient back to fp32 — one extra kernel and one 16-bit temporary
// per parameter. An op whose backward can produce input i's gradient in fp32 directly (a GEMM
// writing fp32, a reduction that accumulates in fp32 anyway) sets bit i of OpDef::wide_grads.
// When such an input comes straight from a cast of a wider dtype (OpDef::grad_in_source_dtype),
// the engine sets ctx.grad_dtypes[i] to that wider dtype and, when the cast's source is a leaf
// with an empty grad slot (DDP's bucket view), offers the slot itself as grad_destination(i). The
// backward then returns the gradient in grad_dtype(i) (or in the input's dtype: either is
// accepted), and the cast passes a gradient already in its source dtype through untouched.

// Note [Folded gradient sums]
// A tensor read by two ops gets two gradients, which the engine adds (one kernel: read both, write
// the sum). In a pre-norm decoder every block's residual stream is such a tensor, read by the
// residual add and by the norm: 2 adds a block, 32 in llama-250m's step (0.49 ms of 26 on an H200).
// An op whose backward can add a given tensor into its input-i gradient as it writes it sets bit i
// of OpDef::folds_grads. When the other consumers' gradient is already waiting in the engine (the
// residual add's backward ran first, as it was created later) and has the input's shape, dtype and
// layout, the engine hands it to the backward (ctx.pending_grads[i]); the backward's kernel adds it
// into its result, rounded as the engine's add would round it (the op's gradient rounded to the
// dtype, then the sum rounded: the same bits), take_pending_grad marks it, and the engine replaces the
// waiting gradient with the sum instead of adding. Never for a leaf's accumulator (its first
// gradient may sit in the leaf's grad slot, Note [Wide gradients]) nor between two edges of one op
// to the same tensor.

// The kernel-input side of the Note above: op's optional input i, when given, must have x's shape
// and dtype and be contiguous (a BLU_ASSERT: only a backward formula passes it).
void check_pending_grad(std::string_view op, std::span<const Tensor> in, size_t i, const Tensor& x);

// The reference counts of a tensor's impl and storage that the eager step would see at this point:
// use_count() of each, less the references a recorder on this thread holds of its own (handles to
// tensors the eager step would have dropped by now). Tests of sole ownership (Note [Donated
// buffers], a gradient kept without a copy) read these, so a captured step makes the eager step's
// choices. set_ref_counter installs the recorder's count for this thread (empty: use_count()).
struct RefCounts {
  long impl = 0, storage = 0;
};
using RefCounter = std::function<RefCounts(const Tensor& t)>;
void set_ref_counter(RefCounter counter);
RefCounts eager_ref_counts(const Tensor& t);

using InferFn = std::vector<TensorMeta> (*)(std::span<const Tensor> in, const Attrs& attrs);
using ViewFn = std::vector<Tensor> (*)(std::span<const Tensor> in, const Attrs& attrs);
// Returns one gradient per input (undefined where not needed or not differentiable). Runs with
// grad mode off; `grad_out` holds a defined gradient for every differentiable output.
using BackwardFn = std::vector<Tensor> (*)(const BackwardContext& ctx, std::span<const Tensor> grad_out);

struct OpDef {
  const char* name;
  InferFn infer;
  // The sharding rule beside the shape rule (Note [Sharding rules], ops/sharding.h); null: none,
  // the op is not checked under tensor parallelism.
  ShardFn shard = nullptr;
  BackwardFn backward = nullptr;  // null: not differentiable
  uint32_t save_inputs = 0;       // bit i: the backward reads input i
  uint32_t save_outputs = 0;      // bit j: the backward reads output j
  // Ops that make their own outputs — views of their inputs, or composites computed from other
  // ops under no-grad (so the composite records one node with its own backward). No kernel runs.
  ViewFn view = nullptr;
  bool inplace = false;           // output 0 is input 0, written by the kernel
  // In-place ops: whether the kernel writes input i (null: input 0 only). Every written input's
  // storage version is bumped after the kernel ran, so a kernel must never write an input this
  // does not name.
  bool (*writes)(size_t i, const Attrs& attrs) = nullptr;
  int diff_outputs = -1;          // outputs that carry gradients: the first n (-1: all)
  uint32_t optional_inputs = 0;   // bit i: input i may be undefined
  bool cross_device = false;      // inputs/outputs may sit on different devices (copies)
  uint32_t wide_grads = 0;        // bit i: the backward honours ctx.grad_dtype(i) (Note [Wide gradients])
  uint32_t folds_grads = 0;       // bit i: the backward can add ctx.pending_grads[i] (Note [Folded gradient sums])
  bool grad_in_source_dtype = false;  // a cast: output 0's gradient may arrive in input 0's dtype
  // Not part of the definition (leave it out of the initialiser): the backend kernel per device
  // type, filled by dispatch() on the op's first call on that type, null until then (and while
  // the type has none). Kernels register at static init, so a kernel once found stays valid.
  mutable std::atomic<void (*)(const KernelCall&)> kernel_cache[kNumDeviceTypes] = {};
};

std::vector<Tensor> dispatch(const OpDef& op, std::vector<Tensor> inputs, const Attrs& attrs = {});
inline Tensor dispatch1(const OpDef& op, std::vector<Tensor> inputs, const Attrs& attrs = {}) {
  return dispatch(op, std::move(inputs), attrs)[0];
}

// Observers see every call after it ran (outputs made, autograd recorded).
using OpObserver = std::function<void(const OpDef&, std::span<const Tensor> in, std::span<const Tensor> out,
                                      const Attrs&)>;
int add_op_observer(OpObserver obs);  // returns a handle for remove
void remove_op_observer(int handle);

// Installed by autograd/: links outputs to a new graph node.
using GradRecorder = void (*)(const OpDef&, std::span<const Tensor> in, std::span<Tensor> out, const Attrs&);
void set_grad_recorder(GradRecorder rec);

}  // namespace blu
