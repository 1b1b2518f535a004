// nn/norms: normalisation modules beyond LayerNorm (nn/layers) — RMSNorm, the Llama family's norm.
// Its forward is one dispatched op (ops/nn.h: rms_norm), so the module adds a name and a weight,
// never math.
// Depends on nn/module, ops/nn. Keep: the weight is constructed as ones; forwards read it through
// cast_param (mixed precision: the weight stays in its own dtype, the output is in x's dtype).
#pragma once
#include "blu/nn/module.h"

namespace blu::nn {

// y = weight · x / sqrt(mean(x², last dim) + eps), as Hugging Face's LlamaRMSNorm.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-5);
  Tensor forward(const Tensor& x) const;  // x [..., dim] → [..., dim]
  double eps;
  Tensor weight;  // [dim], ones
};

}  // namespace blu::nn
