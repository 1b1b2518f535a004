// autograd/function: differentiable steps whose backward the caller writes, for code that is not
// a dispatched op and must act inside the graph:
//   identity_with_backward_callback — an identity that runs a callback when backward passes
//     through it (ZeRO-3 gathers a block's parameters right before the block's backward and
//     reduces their gradients right after it, dist/zero.h);
//   listen_for_input_grad — a listener told of an op's input gradient from inside its backward
//     (tensor parallelism starts a collective there: ops/early_grad.h);
//   record_function — outputs the caller computed, recorded as one node over the inputs whose
//     backward maps the outputs' gradients to the inputs' (the collectives inside the graph of
//     tensor parallelism, dist/tensor_parallel.h: ops/ cannot call them, dist/ sits above it).
// Depends on autograd/node. Keep: identity_with_backward_callback's output aliases the input (no
// copy) and its gradient passes through unchanged; a callback or backward runs once per backward
// through its node, on the backward's thread with grad mode off, in the engine's order — the same
// on every rank for the same graph, which is what lets a backward call a collective; a
// record_function backward sees only what its closure captured (capture what it reads: the node
// lives as long as the graph).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "blu/autograd/node.h"
#include "blu/core/tensor.h"

namespace blu {

// x itself when grad mode is off; else an alias of x that requires grad and whose backward node
// (labelled `name`) calls `on_backward()` and then passes the gradient to x (when x requires one).
Tensor identity_with_backward_callback(const Tensor& x, std::function<void()> on_backward, std::string name);

// Gradients of the outputs (one per output, zeros where none arrived) → gradients of the inputs
// (one per input; an undefined tensor: none for that input).
using FunctionBackward = std::function<std::vector<Tensor>(const std::vector<Tensor>& grad_out)>;

struct FunctionNode final : Node {
  FunctionBackward backward;
  std::string label;
  bool last = false;  // the backward is dropped right after the next apply (no retain_graph)
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) override;
  std::string name() const override { return label; }
  void will_release_saved(bool yes) override { last = yes; }
  void release_saved() override;  // drops the backward and what it captured
};

// Inside a record_function backward: whether its node drops the backward, and what the closure
// captured, right after this call (no retain_graph). A buffer only the closure refers to may then
// take the gradient in place (Note [Donated buffers], ops/dispatch.h); a backward that runs again
// must leave it as it was.
bool function_backward_is_last();

// Makes `fn` the listener of the op node that produced `out` (Note [Early input gradients],
// ops/early_grad.h): its backward formula may call it with an input's gradient before finishing.
// False, and nothing set, when `out` was not made by an op node (grad mode off, a leaf, a
// record_function output).
bool listen_for_input_grad(const Tensor& out, EarlyGradFn fn);

// `outputs` recorded as the outputs of one node over `inputs` whose backward is `backward`. With
// grad mode off, or when no input requires grad, the outputs come back as they are. Floating
// outputs only carry gradients; `name` labels the node in errors.
std::vector<Tensor> record_function(std::string name, const std::vector<Tensor>& inputs, std::vector<Tensor> outputs,
                                    FunctionBackward backward);

}  // namespace blu
