#include "blu/nn/norms.h"

#include "blu/ops/factory.h"
#include "blu/ops/nn.h"

namespace blu::nn {

RMSNorm::RMSNorm(int64_t dim, double eps_) : eps(eps_) {
  BLU_CHECK(dim > 0, "RMSNorm: expected a positive size, got ", dim);
  BLU_CHECK(eps > 0, "RMSNorm: expected eps > 0, got ", eps);
  register_parameter("weight", weight, ones({dim}));
}

Tensor RMSNorm::forward(const Tensor& x) const {
  BLU_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0), "RMSNorm: expected x [..., ", weight.size(0), "], got ",
            x.shape());
  return rms_norm(x, cast_param(weight, x.dtype()), eps);
}

}  // namespace blu::nn
