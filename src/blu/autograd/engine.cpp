// The backward engine: from the root's node, count how many edges lead into each reachable node,
// then run nodes when all their incoming gradients are in: sinks (leaf accumulators) as soon as
// they are ready, op nodes latest-created first.
//
// Note [Sinks run first]
// A leaf's AccumulateGrad runs its grad hooks, and DDP's hooks start the bucket all-reduces, so it
// must run as soon as its gradient is complete — not when its creation order says. The order is
// no guide for accumulators: one is made the first time a leaf enters a graph and reused while
// any graph holds it, so when the previous step's graph is still alive (a loss kept for logging)
// every accumulator is older than every node of this step, and "latest first" would run them all
// after the whole backward, every all-reduce after the last kernel (on 2 H200s that order has all
// 18 buckets finish after backward ends). Sinks touch only their own leaf, so running them first
// changes no value; among sinks, and among op nodes, the later-created runs first. Each incoming
// gradient is checked against the metadata the node recorded for that output. A leaf with a grad
// slot (Tensor::set_grad_slot) and no grad yet has its slot offered to the node that makes its
// first gradient, and later contributions are summed into the slot in place. An op that can add
// an input's waiting gradient into its own is handed it (Note [Folded gradient sums],
// ops/dispatch.h).
#include <queue>
#include <unordered_map>

#include "blu/autograd/node.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// `g` is the gradient for output `slot` of `to`, made by the backward of `from` (null: the root
// gradient given to backward()). The message names the op whose backward made the bad gradient.
void check_grad(const Node& to, uint32_t slot, const Tensor& g, const Node* from) {
  const TensorMeta& m = to.out_metas[slot];
  const bool dtype_ok = g.dtype() == m.dtype || (slot == 0 && to.grad_source_dtype() == g.dtype());
  if (g.shape() == m.shape && dtype_ok && g.device() == m.device) return;
  const std::string what = to_string(m.shape) + " " + std::string(dtype_name(m.dtype)) + " " + m.device.str();
  BLU_CHECK(from, "backward(): the gradient given is ", g.str(), " but the tensor is ", what);
  BLU_CHECK(false, "backward of '", from->name(), "' returned a gradient ", g.str(), " for an input that is ",
            what, " (into '", to.name(), "')");
}

}  // namespace

void Tensor::backward(const Tensor& grad_root, bool retain_graph) const {
  BLU_CHECK(requires_grad(), "backward() on a tensor that does not require grad (", str(), ")");
  Tensor g = grad_root;
  const bool seeded = !g.defined();  // the root's gradient is ours: exactly 1
  if (seeded) {
    BLU_CHECK(numel() == 1, "backward() without a gradient needs a 1-element tensor; got shape ", shape(),
              " (pass the gradient explicitly)");
    g = ones(shape(), dtype(), device());
  }
  const Edge root = gradient_edge(*this);
  NoGradGuard no_grad;

  // Dependencies: how many edges from reachable nodes point at each node.
  std::unordered_map<Node*, int> deps;
  {
    std::vector<Node*> stack{root.fn.get()};
    deps[root.fn.get()] = 0;
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next) {
        if (!e.fn) continue;
        auto [it, fresh] = deps.emplace(e.fn.get(), 0);
        ++it->second;
        if (fresh) stack.push_back(e.fn.get());
      }
    }
  }

  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  auto add_to_buffer = [&](Node* n, uint32_t slot, Tensor grad, const Node* from) {
    check_grad(*n, slot, grad, from);
    auto& buf = buffers[n];
    if (buf.empty()) buf.resize(n->out_metas.size());
    if (!buf[slot].defined()) {
      buf[slot] = std::move(grad);
    } else if (buf[slot].dtype() != grad.dtype()) {  // a widened and a plain gradient of a cast's output
      const DType wide = *n->grad_source_dtype();
      buf[slot] = add(to_dtype(buf[slot], wide), to_dtype(grad, wide));
    } else if (const Tensor fresh = n->fresh_grad_slot();
               fresh.defined() && buf[slot].raw_data() == fresh.raw_data() && buf[slot].storage() == fresh.storage()) {
      add_(buf[slot], grad);  // the first contribution was written into the leaf's grad slot: sum there
    } else {
      buf[slot] = add(buf[slot], grad);
    }
  };
  auto later_first = [](Node* a, Node* b) {  // true: b runs before a
    const bool sa = a->is_sink(), sb = b->is_sink();
    return sa != sb ? sb : a->seq < b->seq;
  };
  std::priority_queue<Node*, std::vector<Node*>, decltype(later_first)> ready(later_first);

  add_to_buffer(root.fn.get(), root.input_nr, g, nullptr);
  ready.push(root.fn.get());
  // Keep nodes alive while they run even if their last owner releases them.
  std::vector<std::shared_ptr<Node>> keep{root.fn};
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[n]);
    buffers.erase(n);
    grads.resize(n->out_metas.size());
    for (int j = 0; j < n->diff_outputs; ++j)
      if (!grads[j].defined()) grads[j] = zeros(n->out_metas[j].shape, n->out_metas[j].dtype, n->out_metas[j].device);
    // A leaf whose grad slot is still empty and has no gradient waiting yet: offer the slot as the
    // place for this input's gradient (to one edge only), so a backward that can write it there
    // does and AccumulateGrad has nothing to copy (dist/ddp.h: gradients as bucket views).
    // An input that is a cast of a wider leaf, to an op that can make its gradient in the wider
    // dtype: ask for that dtype, and offer the leaf's slot through the cast (Note [Wide gradients]).
    for (size_t i = 0; i < n->next.size(); ++i) {
      Node* to = n->next[i].fn.get();
      if (!to) continue;
      Tensor dst = to->fresh_grad_slot();
      if (const std::optional<DType> wide = to->grad_source_dtype(); wide && n->can_widen_grad(i)) {
        n->offer_grad_dtype(i, *wide);
        Node* leaf = to->next.empty() ? nullptr : to->next[0].fn.get();
        dst = leaf && !buffers.count(leaf) ? leaf->fresh_grad_slot() : Tensor();
        if (dst.defined() && dst.shape() != to->out_metas[0].shape) dst = Tensor();  // one of several sources
      }
      bool first_edge = true;
      for (size_t j = 0; j < i; ++j) first_edge &= n->next[j].fn.get() != to;
      if (n->can_fold_grad(i) && first_edge && !to->is_sink()) {
        // The other consumers' gradient of this input, when it is waiting and has exactly the
        // layout this op's backward writes (Note [Folded gradient sums]).
        const auto it = buffers.find(to);
        const uint32_t slot = n->next[i].input_nr;
        if (it != buffers.end() && slot < it->second.size() && it->second[slot].defined()) {
          const Tensor& pending = it->second[slot];
          const TensorMeta& m = to->out_metas[slot];
          if (pending.dtype() == m.dtype && pending.shape() == m.shape && pending.is_contiguous())
            n->offer_pending_grad(i, pending);
        }
      }
      if (!dst.defined() || buffers.count(to)) continue;
      if (first_edge) n->offer_grad_destination(i, dst);
    }
    n->will_release_saved(!retain_graph);
    n->offer_unit_grad(seeded && n == root.fn.get() ? int(root.input_nr) : -1);
    std::vector<Tensor> in_grads = n->apply(std::move(grads));
    if (!retain_graph) n->release_saved();
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      if (i < in_grads.size() && in_grads[i].defined()) {
        if (n->folded_grad(i)) {  // the waiting gradient is in it: it replaces that one
          check_grad(*e.fn, e.input_nr, in_grads[i], n);
          buffers.at(e.fn.get()).at(e.input_nr) = std::move(in_grads[i]);
        } else {
          add_to_buffer(e.fn.get(), e.input_nr, std::move(in_grads[i]), n);
        }
      }
      if (--deps[e.fn.get()] == 0) {
        keep.push_back(e.fn);
        ready.push(e.fn.get());
      }
    }
  }
}

}  // namespace blu
