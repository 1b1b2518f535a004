#include "blu/nn/layers.h"

#include "blu/autograd/node.h"
#include "blu/core/grad_mode.h"
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
// The weights are concatenated in their master dtype and cast once (16-bit under mixed
// precision), so the weight gradient comes out of the GEMM in fp32 (Note [Wide gradients],
// ops/dispatch.h) and cat's backward hands each parameter its rows, copied into a gradient of its
// own (AccumulateGrad keeps no piece of a larger buffer). The price: the concatenation and cast of
// the weights at every forward (Σ out · in elements: 1.5M for llama-250m's q/k/v, against the
// 12.6M-element activations of its B·T = 8192 tokens), and those copies of the gradients: on an
// H200, estimated from the llama-250m step's per-op profile, ~0.8 ms of the ~1.2 ms a step the
// single GEMMs save (with the join of q/k/v's gradients and the copy of v). Parameters stored side
// by side (views of one buffer, with their gradients and compute copies) would remove most of it.
// The outputs are adjacent column ranges of one buffer: ops that take such pieces without a copy
// (swiglu's halves) do, and split's backward joins their gradients as a view when they come back
// side by side. A consumer that keeps one piece keeps the whole buffer alive (Llama copies v).
std::vector<Tensor> sibling_linears(const Tensor& x, const std::vector<const Linear*>& layers) {
  bool fuse = layers.size() > 1;
  for (const Linear* l : layers)
    fuse = fuse && l->fusable() && !l->bias.defined() && l->weight.dtype() == layers[0]->weight.dtype() &&
           l->weight.device() == layers[0]->weight.device();
  std::vector<Tensor> out;
  if (!fuse) {
    for (const Linear* l : layers) out.push_back(l->forward(x));
    return out;
  }
  std::vector<Tensor> weights;
  std::vector<int64_t> widths;
  for (const Linear* l : layers) weights.push_back(l->weight), widths.push_back(l->out_features);
  Tensor w = cat(weights, 0);
  if (w.dtype() != x.dtype()) w = to_dtype(w, x.dtype());
  return split(linear(x, w), widths, -1);
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
