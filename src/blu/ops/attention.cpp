#include "blu/ops/attention.h"

#include <cmath>
#include <limits>

#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// True above the diagonal of a Tq x Tk grid aligned at the top left (key j is hidden from query i
// when j > i), as torch's is_causal=True: tril(ones(Tq, Tk)) are the visible positions.
Tensor causal_mask(int64_t tq, int64_t tk, Device device) {
  Tensor rows = reshape(arange(0, double(tq), 1, DType::i64, device), {tq, 1});
  Tensor cols = arange(0, double(tk), 1, DType::i64, device);
  return gt(cols, rows);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  BLU_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, "scaled_dot_product_attention: q, k, v need at least 2 dims ",
            "[..., T, D]; got q ", q.shape(), ", k ", k.shape(), ", v ", v.shape());
  BLU_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(), "scaled_dot_product_attention: q, k, v must share a dtype; ",
            "got ", q.dtype(), ", ", k.dtype(), ", ", v.dtype());
  BLU_CHECK(is_floating(q.dtype()), "scaled_dot_product_attention: expected floating tensors, got ", q.dtype());
  BLU_CHECK(q.size(-1) == k.size(-1), "scaled_dot_product_attention: q and k head dims differ: q ", q.shape(), ", k ",
            k.shape());
  BLU_CHECK(k.size(-2) == v.size(-2), "scaled_dot_product_attention: k and v sequence lengths differ: k ", k.shape(),
            ", v ", v.shape());
  const int64_t tq = q.size(-2), tk = k.size(-2), d = q.size(-1);
  const double s = scale > 0 ? scale : 1.0 / std::sqrt(double(std::max<int64_t>(d, 1)));
  Tensor scores = mul(matmul(q, transpose(k, -2, -1)), s);  // [..., Tq, Tk]
  if (causal) scores = masked_fill(scores, causal_mask(tq, tk, q.device()), -std::numeric_limits<double>::infinity());
  return matmul(softmax(scores, -1), v);
}

}  // namespace blu
