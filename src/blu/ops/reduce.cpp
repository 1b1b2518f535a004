#include "blu/ops/reduce.h"

#include <algorithm>

#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// Normalised, sorted, unique dims; empty input means all dims.
Shape reduce_dims(const Tensor& t, const Shape& dims) {
  Shape out;
  if (dims.empty()) {
    for (int64_t d = 0; d < t.dim(); ++d) out.push_back(d);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, t.dim()));
  std::sort(out.begin(), out.end());
  BLU_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), "reduction: dim repeated in ", dims);
  return out;
}

Shape reduced_shape(const Shape& in, const Shape& dims, bool keepdim) {
  Shape out;
  for (int64_t d = 0; d < int64_t(in.size()); ++d) {
    const bool r = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!r) out.push_back(in[d]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

std::vector<TensorMeta> infer_sum(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& t = in[0];
  const DType out = is_floating(t.dtype()) ? t.dtype() : DType::i64;
  return {TensorMeta{reduced_shape(t.shape(), a.get<Shape>("dims"), a.b("keepdim")), out, t.device()}};
}
// Re-inserts reduced dims as size 1 so g broadcasts against the input.
Tensor unsqueeze_reduced(Tensor g, const Shape& dims, bool keepdim) {
  if (!keepdim)
    for (int64_t d : dims) g = unsqueeze(g, d);
  return g;
}
std::vector<Tensor> sum_bw(const BackwardContext& c, std::span<const Tensor> g) {
  Tensor gi = unsqueeze_reduced(g[0], c.attrs.get<Shape>("dims"), c.attrs.b("keepdim"));
  return {contiguous(expand(gi, c.input_shape(0)))};
}
const OpDef kSum{.name = "sum", .infer = infer_sum, .backward = sum_bw};

std::vector<TensorMeta> infer_max_dim(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& t = in[0];
  const int64_t d = a.i("dim");
  BLU_CHECK(t.dim() == 0 || t.shape()[d] > 0, "max/min/argmax over an empty dim ", d, " of ", t.shape());
  Shape s = t.dim() == 0 ? Shape{} : reduced_shape(t.shape(), {d}, a.b("keepdim"));
  return {TensorMeta{s, t.dtype(), t.device()}, TensorMeta{s, DType::i64, t.device()}};
}
// Places g at the chosen indices along dim, zeros elsewhere.
std::vector<TensorMeta> infer_scatter_dim(std::span<const Tensor> in, const Attrs& a) {
  return {TensorMeta{a.get<Shape>("shape"), in[0].dtype(), in[0].device()}};
}
const OpDef kScatterDim{.name = "scatter_dim", .infer = infer_scatter_dim};
std::vector<Tensor> max_dim_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const bool keep = c.attrs.b("keepdim");
  const int64_t d = c.attrs.i("dim");
  if (c.input_shape(0).empty()) return {g[0]};
  Tensor gi = keep ? g[0] : unsqueeze(g[0], d);
  Tensor idx = keep ? c.output(1) : unsqueeze(c.output(1), d);
  return {dispatch1(kScatterDim, {gi, idx}, Attrs{{"shape", c.input_shape(0)}, {"dim", d}})};
}
const OpDef kMaxDim{.name = "max_dim", .infer = infer_max_dim, .backward = max_dim_bw, .save_outputs = 2, .diff_outputs = 1};
const OpDef kMinDim{.name = "min_dim", .infer = infer_max_dim, .backward = max_dim_bw, .save_outputs = 2, .diff_outputs = 1};

std::pair<Tensor, Tensor> max_min(const OpDef& op, const Tensor& t, int64_t dim, bool keepdim) {
  dim = wrap_dim(dim, t.dim());
  auto out = dispatch(op, {t}, Attrs{{"dim", dim}, {"keepdim", keepdim}});
  return {out[0], out[1]};
}

}  // namespace

Tensor sum(const Tensor& t, const Shape& dims, bool keepdim) {
  return dispatch1(kSum, {t}, Attrs{{"dims", reduce_dims(t, dims)}, {"keepdim", keepdim}});
}

Tensor mean(const Tensor& t, const Shape& dims, bool keepdim) {
  BLU_CHECK(is_floating(t.dtype()), "mean: expected a floating tensor, got ", t.str());
  int64_t n = 1;
  for (int64_t d : reduce_dims(t, dims)) n *= t.shape()[d];
  return mul(sum(t, dims, keepdim), 1.0 / double(n));
}

Tensor var(const Tensor& t, const Shape& dims, int64_t correction, bool keepdim) {
  BLU_CHECK(is_floating(t.dtype()), "var: expected a floating tensor, got ", t.str());
  int64_t n = 1;
  for (int64_t d : reduce_dims(t, dims)) n *= t.shape()[d];
  Tensor centered = sub(t, mean(t, dims, true));
  return mul(sum(mul(centered, centered), dims, keepdim), 1.0 / double(std::max<int64_t>(n - correction, 0)));
}

std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim) { return max_min(kMaxDim, t, dim, keepdim); }
std::pair<Tensor, Tensor> min(const Tensor& t, int64_t dim, bool keepdim) { return max_min(kMinDim, t, dim, keepdim); }
Tensor max(const Tensor& t) { return max(reshape(t, {-1}), 0).first; }
Tensor min(const Tensor& t) { return min(reshape(t, {-1}), 0).first; }
Tensor argmax(const Tensor& t, int64_t dim, bool keepdim) { return max(t, dim, keepdim).second; }

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int64_t lead = g.dim() - int64_t(shape.size());
  BLU_ASSERT(lead >= 0, "sum_to: ", g.shape(), " to ", to_string(shape));
  Shape dims;
  for (int64_t d = 0; d < g.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && g.shape()[d] != 1)) dims.push_back(d);
  Tensor s = dims.empty() ? g : sum(g, dims, true);
  return reshape(s, shape);
}

}  // namespace blu
