#include "blu/autograd/function.h"

#include "blu/autograd/node.h"
#include "blu/core/grad_mode.h"

namespace blu {

namespace {

struct CallbackIdentityNode final : Node {
  std::function<void()> on_backward;
  std::string label;
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_out) override {
    on_backward();
    return {std::move(grad_out[0])};
  }
  std::string name() const override { return label; }
};

}  // namespace

Tensor identity_with_backward_callback(const Tensor& x, std::function<void()> on_backward, std::string name) {
  if (!GradMode::enabled()) return x;
  BLU_CHECK(x.defined() && is_floating(x.dtype()), "identity_with_backward_callback (", name,
            "): expected a floating tensor, got ", x.defined() ? x.str() : std::string("an undefined tensor"));
  auto node = std::make_shared<CallbackIdentityNode>();
  node->seq = next_node_seq();
  node->on_backward = std::move(on_backward);
  node->label = std::move(name);
  node->next = {gradient_edge(x)};
  node->out_metas.push_back({x.shape(), x.dtype(), x.device()});
  node->diff_outputs = 1;
  Tensor out = x.detach();
  AutogradMeta& m = out.autograd_meta();
  m.requires_grad = true;
  m.grad_fn = std::move(node);
  m.output_nr = 0;
  return out;
}

}  // namespace blu
