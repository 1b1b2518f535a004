#include "blu/nn/layers.h"

#include "blu/autograd/node.h"
#include "blu/core/grad_mode.h"
#include "blu/memory/memory_report.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu::nn {

void init_normal_(const Tensor& w, double std, Generator& gen) {
  NoGradGuard no_grad;
  Tensor r = randn(w.shape(), DType::f32, w.device(), &gen);
  copy_(w, std == 1.0 ? r : mul(r, std));
}

Linear::Linear(int64_t in, int64_t out, bool with_bias) : in_features(in), out_features(out) {
  BLU_CHECK(in > 0 && out > 0, "Linear: expected positive sizes, got in ", in, ", out ", out);
  register_parameter("weight", weight, zeros({out, in}));
  if (with_bias) register_parameter("bias", bias, zeros({out}));
}

// Mixed precision: parameters stay in their own (master) dtype; the computation runs in x's
// dtype, on the parameters' compute copies, whose backward brings the gradients back to the
// master dtype (Module::cast_param).
Tensor Linear::forward(const Tensor& x) const {
  return linear(x, cast_param(weight, x.dtype()), cast_param(bias, x.dtype()));
}
Tensor Linear::forward(const Tensor& x, const Tensor& residual) const {
  return linear(x, cast_param(weight, x.dtype()), cast_param(bias, x.dtype()), residual);
}

// Note [Sibling linears]
// A GQA model's k and v projections are narrow (Hkv·D columns: 256 for llama-250m), and a GEMM that
// narrow fills few of the GPU's multiprocessors; their weight gradients ([256, C] from a sum over
// every token) fewer still, and the input gradient of n siblings is n GEMMs and n - 1 adds. One
// GEMM over [W_1; …; W_n] makes the same products: the forward one wide GEMM, the backward one
// input-gradient GEMM whose inner dim is Σ out (no adds) and one weight gradient [Σ out, in].
// Under mixed precision the joined 16-bit weight is the siblings' compute copies (Note [Compute
// copies], nn/compute_copy.h) kept as adjacent rows of one buffer: a forward that finds them
// current and side by side reads that buffer as it is (no kernel) — AdamW writes each row range
// in place as it updates the parameter — and otherwise casts every weight into a new buffer,
// which becomes their copies (the first forward, or after any weight was written). The weight
// gradient comes out of the GEMM in fp32 (Note [Wide gradients], ops/dispatch.h) and
// cast_with_copy's backward hands each parameter its rows of it, which each keeps without a copy
// (the buffer is split among them: core/storage.h). Without compute copies (fp32 training, or
// copies off) the weights are concatenated and cast at every forward, and each parameter copies
// its rows of the gradient (AccumulateGrad keeps no piece of a larger buffer it cannot account
// for). The outputs are adjacent column ranges of one buffer: ops that take such pieces without a
// copy (swiglu's halves) do, and split's backward joins their gradients as a view when they come
// back side by side. A consumer that keeps one piece keeps the whole buffer alive (Llama's cache
// copies v; its training step reads the whole output as heads: sibling_linears_joined).
namespace {

// The layers' weights in `dtype` as one [Σ out, in] tensor linked to each weight by autograd,
// from their compute copies; undefined when a layer keeps none.
Tensor joined_compute_copy(const std::vector<const Linear*>& layers, DType dtype) {
  std::vector<std::shared_ptr<ComputeCopy>> copies;
  std::vector<Tensor> weights;
  for (const Linear* l : layers) {
    std::shared_ptr<ComputeCopy> c = l->compute_copy_of(l->weight);
    if (!c || l->weight.dim() != 2) return Tensor();
    copies.push_back(std::move(c));
    weights.push_back(l->weight);
  }
  // The kept copies as one view when they are all current and lie side by side.
  std::vector<Tensor> kept;
  bool current = true;
  for (size_t i = 0; i < copies.size(); ++i) {
    kept.push_back(copies[i]->tensor());
    current = current && copies[i]->current(weights[i]) && kept.back().dtype() == dtype;
  }
  Tensor joined = current ? adjacent_join(kept, 0) : Tensor();
  if (!joined.defined()) {
    int64_t rows = 0;
    for (const Tensor& w : weights) rows += w.size(0);
    joined = empty({rows, weights[0].size(1)}, dtype, weights[0].device());
    tag_memory(joined, MemoryCategory::parameters, "16-bit compute copy");
    int64_t start = 0;
    for (size_t i = 0; i < copies.size(); ++i) {
      copies[i]->cast_into(weights[i], narrow(joined, 0, start, weights[i].size(0)));
      start += weights[i].size(0);
    }
  }
  return cast_with_copy(weights, joined);
}

}  // namespace

Tensor sibling_linears_joined(const Tensor& x, const std::vector<const Linear*>& layers) {
  bool fuse = layers.size() > 1;
  for (const Linear* l : layers)
    fuse = fuse && l->fusable() && !l->bias.defined() && l->weight.dtype() == layers[0]->weight.dtype() &&
           l->weight.device() == layers[0]->weight.device();
  if (!fuse) return Tensor();
  Tensor w;
  if (layers[0]->weight.dtype() != x.dtype()) w = joined_compute_copy(layers, x.dtype());
  if (!w.defined()) {
    std::vector<Tensor> weights;
    for (const Linear* l : layers) weights.push_back(l->weight);
    w = cat(weights, 0);
    if (w.dtype() != x.dtype()) w = to_dtype(w, x.dtype());
  }
  return linear(x, w);
}

std::vector<Tensor> sibling_linears(const Tensor& x, const std::vector<const Linear*>& layers) {
  std::vector<Tensor> out;
  const Tensor joined = sibling_linears_joined(x, layers);
  if (!joined.defined()) {
    for (const Linear* l : layers) out.push_back(l->forward(x));
    return out;
  }
  std::vector<int64_t> widths;
  for (const Linear* l : layers) widths.push_back(l->out_features);
  return split(joined, widths, -1);
}

Embedding::Embedding(int64_t num, int64_t dim) {
  BLU_CHECK(num > 0 && dim > 0, "Embedding: expected positive sizes, got ", num, " x ", dim);
  register_parameter("weight", weight, zeros({num, dim}));
}

Tensor Embedding::forward(const Tensor& idx) const {
  if (!row_sink_ || !weight.requires_grad() || !GradMode::enabled()) return embedding(weight, idx);
  Tensor rows;
  {
    NoGradGuard no_grad;
    rows = embedding(weight, idx);
  }
  return attach_grad_sink(rows, [sink = row_sink_, idx](const Tensor& g) { sink(idx, g); }, "Embedding row sink");
}

LayerNorm::LayerNorm(int64_t dim, bool with_bias, double eps_) : eps(eps_) {
  BLU_CHECK(dim > 0, "LayerNorm: expected a positive size, got ", dim);
  register_parameter("weight", weight, ones({dim}));
  if (with_bias) register_parameter("bias", bias, zeros({dim}));
}

Tensor LayerNorm::forward(const Tensor& x) const {
  return layer_norm(x, cast_param(weight, x.dtype()), cast_param(bias, x.dtype()), eps);
}

Dropout::Dropout(double p_, Generator* gen) : p(p_), gen_(gen) {
  BLU_CHECK(p >= 0.0 && p < 1.0, "Dropout: expected p in [0, 1), got ", p);
}

Tensor Dropout::forward(const Tensor& x) const {
  if (!active()) return x;
  return dropout(x, p, true, gen_);
}

}  // namespace blu::nn
