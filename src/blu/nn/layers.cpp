#include "blu/nn/layers.h"

#include "blu/autograd/node.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
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
