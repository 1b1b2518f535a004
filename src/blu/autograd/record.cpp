// Records op calls into the autograd graph: installed into the dispatcher at start-up.
#include "blu/autograd/node.h"
#include "blu/autograd/saved_hooks.h"

namespace blu {

static void record(const OpDef& op, std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  auto node = std::make_shared<OpNode>();
  node->seq = next_node_seq();
  BackwardContext& ctx = node->ctx;
  ctx.op = &op;
  ctx.attrs = attrs;
  ctx.inputs.resize(in.size());
  ctx.needs_grad.resize(in.size());
  const bool hooked = saved_hooks_active();  // saved tensors may go into boxes (autograd/saved_hooks.h)
  node->next.resize(in.size());
  ctx.input_metas.reserve(in.size());
  node->out_metas.reserve(out.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].defined()) {
      ctx.input_metas.push_back({in[i].shape(), in[i].dtype(), in[i].device()});
      // Saved tensors are detached aliases: the graph must not keep itself alive through them.
      if (op.save_inputs >> i & 1u) {
        if (std::shared_ptr<SavedBox> box = hooked ? pack_saved(in[i], false) : nullptr) {
          node->boxed.resize(in.size() + out.size());
          node->boxed[i] = std::move(box);
        } else {
          ctx.inputs[i] = in[i].detach();
        }
      }
    } else {
      ctx.input_metas.push_back({{}, DType::f32, kCPU});
    }
    node->next[i] = gradient_edge(in[i]);
    ctx.needs_grad[i] = node->next[i].fn != nullptr;
  }
  const int ndiff = op.diff_outputs < 0 ? int(out.size()) : op.diff_outputs;
  node->diff_outputs = ndiff;
  ctx.outputs.resize(out.size());
  for (size_t j = 0; j < out.size(); ++j) {
    node->out_metas.push_back({out[j].shape(), out[j].dtype(), out[j].device()});
    if (op.save_outputs >> j & 1u) {
      if (std::shared_ptr<SavedBox> box = hooked ? pack_saved(out[j], !op.view && !op.inplace) : nullptr) {
        node->boxed.resize(in.size() + out.size());
        node->boxed[in.size() + j] = std::move(box);
      } else {
        ctx.outputs[j] = out[j].detach();
      }
    }
  }
  for (int j = 0; j < ndiff; ++j) {
    if (!is_floating(out[j].dtype())) continue;
    AutogradMeta& m = out[j].autograd_meta();
    m.requires_grad = true;
    m.grad_fn = node;
    m.output_nr = uint32_t(j);
  }
}

static const bool g_installed = (set_grad_recorder(&record), true);

}  // namespace blu
