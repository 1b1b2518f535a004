// autograd/function: an identity that runs a callback when backward passes through it — the
// smallest custom-function facility, for code that must act at a precise point of the backward
// (ZeRO-3 gathers a block's parameters right before the block's backward and reduces their
// gradients right after it, dist/zero.h).
// Depends on autograd/node. Keep: the output aliases the input (no copy); the gradient passes
// through unchanged; the callback runs once per backward through the node, on the backward's
// thread with grad mode off, before the gradient flows on to the input's producer.
#pragma once
#include <functional>
#include <string>

#include "blu/core/tensor.h"

namespace blu {

// x itself when grad mode is off; else an alias of x that requires grad and whose backward node
// (labelled `name`) calls `on_backward()` and then passes the gradient to x (when x requires one).
Tensor identity_with_backward_callback(const Tensor& x, std::function<void()> on_backward, std::string name);

}  // namespace blu
