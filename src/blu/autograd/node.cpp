#include "blu/autograd/node.h"

#include <atomic>

#include "blu/core/grad_mode.h"
#include "blu/memory/memory_report.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/view.h"

namespace blu {

uint64_t next_node_seq() {
  static std::atomic<uint64_t> seq{0};
  return seq.fetch_add(1);
}

std::vector<Tensor> OpNode::apply(std::vector<Tensor>&& grad_out) {
  BLU_CHECK(!released, "backward through the graph of '", ctx.op->name,
            "' a second time: its saved tensors were freed; pass retain_graph=true to the first backward");
  const size_t n_in = ctx.inputs.size();
  for (size_t s = 0; s < boxed.size(); ++s) {
    if (!boxed[s]) continue;
    Tensor& slot = s < n_in ? ctx.inputs[s] : ctx.outputs[s - n_in];
    slot = boxed[s]->unpack();
  }
  std::vector<Tensor> in_grads;
  ctx.folded.clear();
  {
    EarlyGradScope listen(early_grad ? &early_grad : nullptr);
    in_grads = ctx.op->backward(ctx, grad_out);
  }
  for (size_t s = 0; s < boxed.size(); ++s)  // the boxes keep what a second backward needs
    if (boxed[s]) (s < n_in ? ctx.inputs[s] : ctx.outputs[s - n_in]) = Tensor();
  ctx.grad_dst.clear();  // offered for this run only
  ctx.grad_dtypes.clear();
  ctx.pending_grads.clear();  // ctx.folded stays until the next apply: the engine reads it
  ctx.saved_released_after = false;
  ctx.unit_grad_output = -1;
  return in_grads;
}

void OpNode::offer_grad_destination(size_t input, const Tensor& dst) {
  if (ctx.grad_dst.size() < next.size()) ctx.grad_dst.resize(next.size());
  ctx.grad_dst.at(input) = dst;
}

void OpNode::offer_pending_grad(size_t input, const Tensor& pending) {
  if (ctx.pending_grads.size() < next.size()) ctx.pending_grads.resize(next.size());
  ctx.pending_grads.at(input) = pending;
}

void OpNode::offer_grad_dtype(size_t input, DType dtype) {
  if (ctx.grad_dtypes.size() < next.size()) {
    ctx.grad_dtypes.resize(next.size());
    for (size_t i = 0; i < next.size(); ++i) ctx.grad_dtypes[i] = ctx.input_metas[i].dtype;
  }
  ctx.grad_dtypes.at(input) = dtype;
}

std::optional<DType> OpNode::grad_source_dtype() const {
  if (!ctx.op->grad_in_source_dtype || ctx.input_metas.empty()) return std::nullopt;
  const DType src = ctx.input_metas[0].dtype;
  return src != out_metas.at(0).dtype ? std::optional<DType>(src) : std::nullopt;
}

void OpNode::release_saved() {
  boxed.clear();
  ctx.inputs.clear();
  ctx.outputs.clear();
  released = true;
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grad_out) {
  Tensor t(leaf);
  Tensor g = std::move(grad_out[0]);  // a copy of the handle would defeat the `exclusive` test below
  AutogradMeta& meta = t.autograd_meta();
  if (!meta.grad && meta.grad_slot) {
    // Preassigned memory (DDP's bucket view): the gradient goes there, so the bucket needs no copy.
    // The engine has usually had it written there already (a cast's backward, or a sum of several
    // contributions): then there is nothing to copy.
    const Tensor& slot = *meta.grad_slot;
    if (g.storage() != slot.storage() || g.raw_data() != slot.raw_data()) copy_(slot, g);
    meta.grad = std::make_shared<Tensor>(slot);
    tag_memory(slot, MemoryCategory::gradients);
  } else if (!meta.grad) {
    // Keep the incoming gradient only when nothing else refers to it; otherwise own a copy, so a
    // later in-place accumulation cannot change another tensor. A copy too when it is a piece of a
    // larger buffer (the last parameter's rows of a concatenated weight's gradient, Note [Sibling
    // linears] in nn/layers.cpp), which keeping it would hold whole until the next step — unless
    // the buffer is split among leaves (core/storage.h): its other pieces are other parameters'
    // gradients, kept too.
    const RefCounts refs = eager_ref_counts(g);
    const bool whole = refs.storage == 1 && g.nbytes() == g.storage()->nbytes();
    const bool exclusive = refs.impl == 1 && g.is_contiguous() && (whole || g.storage()->split_among_leaves);
    meta.grad = std::make_shared<Tensor>(exclusive ? g : clone(g));
    tag_memory(*meta.grad, MemoryCategory::gradients);  // an out-of-memory report counts it as such
  } else {
    add_(*meta.grad, g);
  }
  // A hook may release the gradient (ZeRO-2 moves it into its bucket): the later ones see none.
  for (auto& hook : meta.grad_hooks)
    if (meta.grad) hook(*meta.grad);
  return {};
}

Tensor AccumulateGrad::fresh_grad_slot() const {
  const AutogradMeta* meta = leaf->autograd.get();
  return meta && meta->grad_slot && !meta->grad ? *meta->grad_slot : Tensor();
}

std::vector<Tensor> GradSinkNode::apply(std::vector<Tensor>&& grad_out) {
  sink(grad_out[0]);
  return {};
}

Tensor attach_grad_sink(const Tensor& x, std::function<void(const Tensor& grad)> sink, std::string name) {
  BLU_CHECK(x.defined() && is_floating(x.dtype()), "attach_grad_sink (", name, "): expected a floating tensor, got ",
            x.defined() ? x.str() : std::string("an undefined tensor"));
  auto node = std::make_shared<GradSinkNode>();
  node->seq = next_node_seq();
  node->sink = std::move(sink);
  node->label = std::move(name);
  node->out_metas.push_back({x.shape(), x.dtype(), x.device()});
  node->diff_outputs = 1;
  Tensor out = x.detach();
  AutogradMeta& m = out.autograd_meta();
  m.requires_grad = true;
  m.grad_fn = std::move(node);
  m.output_nr = 0;
  return out;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  auto& meta = const_cast<Tensor&>(t).autograd_meta();
  if (meta.grad_fn) return {meta.grad_fn, meta.output_nr};
  std::shared_ptr<Node> acc = meta.grad_accumulator.lock();
  if (!acc) {
    auto a = std::make_shared<AccumulateGrad>();
    a->leaf = t.impl_ptr();
    a->seq = next_node_seq();
    a->out_metas = {TensorMeta{t.shape(), t.dtype(), t.device()}};
    a->diff_outputs = 1;
    meta.grad_accumulator = a;
    acc = a;
  }
  return {acc, 0};
}

}  // namespace blu
