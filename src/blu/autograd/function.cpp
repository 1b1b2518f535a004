#include "blu/autograd/function.h"

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

namespace {
thread_local bool t_last_backward = false;
}

bool function_backward_is_last() { return t_last_backward; }

bool listen_for_input_grad(const Tensor& out, EarlyGradFn fn) {
  auto* node = out.defined() ? dynamic_cast<OpNode*>(out.grad_fn().get()) : nullptr;
  if (!node) return false;
  node->early_grad = std::move(fn);
  return true;
}

void FunctionNode::release_saved() { backward = nullptr; }

std::vector<Tensor> FunctionNode::apply(std::vector<Tensor>&& grad_out) {
  BLU_CHECK(backward, "backward through '", label,
            "' a second time: its closure was freed; pass retain_graph=true to the first backward");
  struct LastFlag {
    bool prev;
    explicit LastFlag(bool now) : prev(t_last_backward) { t_last_backward = now; }
    ~LastFlag() { t_last_backward = prev; }
  } flag(last);
  std::vector<Tensor> in_grads = backward(grad_out);
  BLU_ASSERT(in_grads.size() <= next.size(), "the backward of '", label, "' returned ", in_grads.size(),
             " gradients for ", next.size(), " inputs");
  return in_grads;
}

std::vector<Tensor> record_function(std::string name, const std::vector<Tensor>& inputs, std::vector<Tensor> outputs,
                                    FunctionBackward backward) {
  bool any = false;
  for (const Tensor& t : inputs) any |= t.defined() && t.requires_grad();
  if (!GradMode::enabled() || !any) return outputs;
  auto node = std::make_shared<FunctionNode>();
  node->seq = next_node_seq();
  node->label = std::move(name);
  node->backward = std::move(backward);
  for (const Tensor& t : inputs) node->next.push_back(gradient_edge(t));
  node->diff_outputs = int(outputs.size());
  for (size_t j = 0; j < outputs.size(); ++j) {
    Tensor& o = outputs[j];
    BLU_CHECK(o.defined(), "record_function (", node->label, "): output ", j, " is undefined");
    node->out_metas.push_back({o.shape(), o.dtype(), o.device()});
    o = o.detach();
    if (!is_floating(o.dtype())) continue;
    AutogradMeta& m = o.autograd_meta();
    m.requires_grad = true;
    m.grad_fn = node;
    m.output_nr = uint32_t(j);
  }
  return outputs;
}

}  // namespace blu
