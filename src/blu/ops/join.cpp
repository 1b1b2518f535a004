#include "blu/ops/join.h"

#include "blu/ops/dispatch.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// cat: inputs are the tensors to join (any number), attr "dim" already wrapped.
std::vector<TensorMeta> infer_cat(std::span<const Tensor> in, const Attrs& a) {
  BLU_CHECK(!in.empty(), "cat: expected at least one tensor, got none");
  const Tensor& t0 = in[0];
  const int64_t d = a.i("dim");
  Shape shape = t0.shape();
  shape[d] = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const Tensor& t = in[i];
    BLU_CHECK(t.dtype() == t0.dtype(), "cat: tensor ", i, " has dtype ", t.dtype(), " but tensor 0 has ", t0.dtype(),
              " (cast first)");
    BLU_CHECK(t.dim() == t0.dim(), "cat: tensor ", i, " has ", t.dim(), " dims ", t.shape(), " but tensor 0 has ",
              t0.dim(), " dims ", t0.shape());
    for (int64_t k = 0; k < t.dim(); ++k)
      BLU_CHECK(k == d || t.shape()[k] == t0.shape()[k], "cat along dim ", d, ": tensor ", i, " has size ",
                t.shape()[k], " in dim ", k, " but tensor 0 has ", t0.shape()[k], " (shapes ", t.shape(), " and ",
                t0.shape(), ")");
    shape[d] += t.shape()[d];
  }
  return {TensorMeta{shape, t0.dtype(), t0.device()}};
}

// The gradient of each input is the slice of the output's gradient it was copied to.
std::vector<Tensor> cat_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const int64_t d = c.attrs.i("dim");
  std::vector<Tensor> grads(c.input_metas.size());
  int64_t start = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t len = c.input_shape(i)[d];
    if (c.needs_grad[i]) grads[i] = narrow(g[0], d, start, len);
    start += len;
  }
  return grads;
}

const OpDef kCat{.name = "cat", .infer = infer_cat, .backward = cat_backward};

// split: one view op with a piece per output, so its backward is a single cat of the pieces'
// gradients (the engine supplies zeros for unused pieces) instead of one zero-filled buffer and a
// copy per piece.
std::vector<TensorMeta> infer_split(std::span<const Tensor>, const Attrs&) { return {}; }
std::vector<Tensor> split_view(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& t = in[0];
  const int64_t d = a.i("dim");
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t s : a.get<Shape>("sizes")) {
    Shape shape = t.shape();
    shape[d] = s;
    pieces.push_back(t.alias_with(shape, t.strides(), t.offset() + start * t.strides()[d]));
    start += s;
  }
  return pieces;
}
// The pieces' gradients joined along d: a view when they lie side by side in one buffer (the
// attention backward writes dq, dk, dv that way), otherwise a cat.
std::vector<Tensor> split_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const int64_t d = c.attrs.i("dim");
  if (Tensor joined = adjacent_join(g, d); joined.defined()) return {joined};
  return {cat(std::vector<Tensor>(g.begin(), g.end()), d)};
}
const OpDef kSplit{.name = "split", .infer = infer_split, .shard = shard_rule_slice, .backward = split_backward, .view = split_view};

std::vector<Tensor> split_sizes(const Tensor& t, const Shape& sizes, int64_t d) {
  return dispatch(kSplit, {t}, Attrs{{"sizes", sizes}, {"dim", d}});
}

}  // namespace

Tensor adjacent_join(std::span<const Tensor> pieces, int64_t dim) {
  if (pieces.empty() || !pieces[0].defined()) return {};
  const int64_t d = wrap_dim(dim, pieces[0].dim());
  const Tensor& g0 = pieces[0];
  int64_t next = g0.offset(), total = 0;
  for (const Tensor& t : pieces) {
    if (!t.defined() || t.storage() != g0.storage() || t.dtype() != g0.dtype() || t.strides() != g0.strides() ||
        t.dim() != g0.dim() || t.offset() != next)
      return {};
    for (int64_t k = 0; k < t.dim(); ++k)
      if (k != d && t.shape()[k] != g0.shape()[k]) return {};
    next += t.shape()[d] * t.strides()[d];
    total += t.shape()[d];
  }
  Shape shape = g0.shape();
  shape[d] = total;
  return g0.alias_with(shape, g0.strides(), g0.offset());
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  BLU_CHECK(!tensors.empty(), "cat: expected at least one tensor, got none");
  for (size_t i = 0; i < tensors.size(); ++i) {
    BLU_CHECK(tensors[i].defined(), "cat: tensor ", i, " is undefined");
    BLU_CHECK(tensors[i].dim() > 0, "cat: tensor ", i, " is 0-d; zero-dimensional tensors cannot be concatenated");
  }
  const int64_t d = wrap_dim(dim, tensors[0].dim());
  return dispatch1(kCat, tensors, Attrs{{"dim", d}});
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  BLU_CHECK(!tensors.empty(), "stack: expected at least one tensor, got none");
  const Tensor& t0 = tensors[0];
  const int64_t d = wrap_dim(dim, t0.dim() + 1);
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    BLU_CHECK(tensors[i].shape() == t0.shape(), "stack: tensor ", i, " has shape ", tensors[i].shape(),
              " but tensor 0 has ", t0.shape(), " (all must be equal)");
    parts.push_back(unsqueeze(tensors[i], d));
  }
  return cat(parts, d);
}

std::vector<Tensor> split(const Tensor& t, int64_t size, int64_t dim) {
  BLU_CHECK(t.dim() > 0, "split: needs a tensor with at least one dim, got 0-d");
  const int64_t d = wrap_dim(dim, t.dim());
  const int64_t n = t.shape()[d];
  BLU_CHECK(size > 0 || (size == 0 && n == 0), "split: size must be positive, got ", size, " for dim ", d,
            " of size ", n);
  if (n == 0) return {narrow(t, d, 0, 0)};
  Shape sizes;
  for (int64_t start = 0; start < n; start += size) sizes.push_back(std::min(size, n - start));
  return split_sizes(t, sizes, d);
}

std::vector<Tensor> split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim) {
  BLU_CHECK(t.dim() > 0, "split: needs a tensor with at least one dim, got 0-d");
  const int64_t d = wrap_dim(dim, t.dim());
  int64_t total = 0;
  for (int64_t s : sizes) {
    BLU_CHECK(s >= 0, "split: sizes must be non-negative, got ", sizes);
    total += s;
  }
  BLU_CHECK(total == t.shape()[d], "split: sizes ", sizes, " sum to ", total, " but dim ", d, " of ", t.shape(),
            " has size ", t.shape()[d]);
  return split_sizes(t, Shape(sizes.begin(), sizes.end()), d);
}

std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim) {
  BLU_CHECK(chunks > 0, "chunk: expected a positive number of chunks, got ", chunks);
  BLU_CHECK(t.dim() > 0, "chunk: needs a tensor with at least one dim, got 0-d");
  const int64_t d = wrap_dim(dim, t.dim());
  const int64_t n = t.shape()[d];
  if (n == 0) return split(t, std::vector<int64_t>(size_t(chunks), 0), d);  // as torch: `chunks` empty pieces
  return split(t, (n + chunks - 1) / chunks, d);
}

}  // namespace blu
