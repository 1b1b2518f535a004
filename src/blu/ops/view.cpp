#include "blu/ops/view.h"

#include <numeric>
#include <optional>

#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/factory.h"
#include "blu/ops/reduce.h"

namespace blu {

namespace {

std::vector<TensorMeta> same_as_input(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
std::vector<TensorMeta> no_meta(std::span<const Tensor>, const Attrs&) { return {}; }

// Strides for viewing t as `shape`, or empty when the layout does not allow it. Groups of input
// dims that are contiguous among themselves can be split and merged freely.
std::optional<Shape> view_strides(const Tensor& t, const Shape& shape) {
  if (t.numel() == 0 || t.is_contiguous()) return contiguous_strides(shape);
  const Shape& old_shape = t.shape();
  const Shape& old_strides = t.strides();
  Shape out(shape.size());
  int64_t view_d = int64_t(shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.empty() ? 1 : old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = int64_t(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    if (d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

Shape infer_view_shape(const Tensor& t, Shape shape) {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      BLU_CHECK(infer < 0, "view/reshape: only one dim can be -1, got ", shape);
      infer = int64_t(i);
    } else {
      BLU_CHECK(shape[i] >= 0, "view/reshape: bad size in ", shape);
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    BLU_CHECK(known != 0 && t.numel() % known == 0, "view/reshape: cannot infer -1 in ", shape, " for ",
              t.numel(), " elements");
    shape[infer] = t.numel() / known;
  }
  BLU_CHECK(numel(shape) == t.numel(), "view/reshape: shape ", shape, " has ", numel(shape),
            " elements but the tensor ", t.shape(), " has ", t.numel());
  return shape;
}

// --- view ---
std::vector<Tensor> view_view(std::span<const Tensor> in, const Attrs& a) {
  const Shape& shape = a.get<Shape>("shape");
  auto strides = view_strides(in[0], shape);
  BLU_CHECK(strides, "view: a tensor of shape ", in[0].shape(), " and strides ", in[0].strides(),
            " cannot be viewed as ", shape, " without a copy (use reshape, or contiguous first)");
  return {in[0].alias_with(shape, *strides, in[0].offset())};
}
std::vector<Tensor> view_backward(const BackwardContext& c, std::span<const Tensor> g) {
  return {reshape(g[0], c.input_shape(0))};
}
const OpDef kView{.name = "view", .infer = no_meta, .shard = shard_rule_view, .backward = view_backward, .view = view_view};

// --- permute ---
std::vector<Tensor> permute_view(std::span<const Tensor> in, const Attrs& a) {
  const Shape& dims = a.get<Shape>("dims");
  const Tensor& t = in[0];
  BLU_CHECK(int64_t(dims.size()) == t.dim(), "permute: ", dims.size(), " dims given for a tensor of ", t.dim());
  Shape shape(dims.size()), strides(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], t.dim());
    BLU_CHECK(!seen[d], "permute: dim ", d, " repeated in ", dims);
    seen[d] = true;
    shape[i] = t.shape()[d];
    strides[i] = t.strides()[d];
  }
  return {t.alias_with(shape, strides, t.offset())};
}
std::vector<Tensor> permute_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const Shape& dims = c.attrs.get<Shape>("dims");
  Shape inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inv[wrap_dim(dims[i], int64_t(dims.size()))] = int64_t(i);
  return {permute(g[0], inv)};
}
const OpDef kPermute{.name = "permute", .infer = no_meta, .shard = shard_rule_permute, .backward = permute_backward, .view = permute_view};

// --- narrow ---
std::vector<Tensor> narrow_view(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& t = in[0];
  BLU_CHECK(t.dim() > 0, "narrow: needs a tensor with at least one dim");
  const int64_t d = wrap_dim(a.i("dim"), t.dim()), start = a.i("start"), len = a.i("length");
  BLU_CHECK(start >= 0 && len >= 0 && start + len <= t.shape()[d], "narrow: range [", start, ", ", start + len,
            ") is outside dim ", d, " of size ", t.shape()[d]);
  Shape shape = t.shape();
  shape[d] = len;
  return {t.alias_with(shape, t.strides(), t.offset() + start * t.strides()[d])};
}
std::vector<Tensor> narrow_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const TensorMeta& m = c.input_metas[0];
  Tensor full_grad = zeros(m.shape, m.dtype, m.device);
  Tensor part = narrow(full_grad, c.attrs.i("dim"), c.attrs.i("start"), c.attrs.i("length"));
  copy_(part, g[0]);
  return {full_grad};
}
const OpDef kNarrow{.name = "narrow", .infer = no_meta, .shard = shard_rule_slice, .backward = narrow_backward, .view = narrow_view};

// --- expand ---
std::vector<Tensor> expand_view(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& t = in[0];
  const Shape& want = a.get<Shape>("shape");
  BLU_CHECK(int64_t(want.size()) >= t.dim(), "expand: cannot expand ", t.shape(), " to fewer dims ", want);
  Shape shape(want.size()), strides(want.size(), 0);
  const int64_t lead = int64_t(want.size()) - t.dim();
  for (int64_t i = 0; i < int64_t(want.size()); ++i) {
    if (i < lead) {
      BLU_CHECK(want[i] >= 0, "expand: size -1 not allowed for a new leading dim in ", want);
      shape[i] = want[i];
      continue;
    }
    const int64_t have = t.shape()[i - lead];
    const int64_t w = want[i] == -1 ? have : want[i];
    BLU_CHECK(have == w || have == 1, "expand: dim ", i, " of ", t.shape(), " is ", have, " and cannot become ", w);
    shape[i] = w;
    strides[i] = have == w ? t.strides()[i - lead] : 0;
  }
  return {t.alias_with(shape, strides, t.offset())};
}
std::vector<Tensor> expand_backward(const BackwardContext& c, std::span<const Tensor> g) {
  return {sum_to(g[0], c.input_shape(0))};
}
const OpDef kExpand{.name = "expand", .infer = no_meta, .backward = expand_backward, .view = expand_view};

// --- copies ---
std::vector<Tensor> clone_backward(const BackwardContext&, std::span<const Tensor> g) { return {g[0]}; }
const OpDef kClone{.name = "clone", .infer = same_as_input, .shard = shard_rule_linear_unary, .backward = clone_backward};

std::vector<TensorMeta> infer_copy_(std::span<const Tensor> in, const Attrs&) {
  broadcast_shapes(in[1].shape(), in[0].shape());
  BLU_CHECK(numel(broadcast_shapes(in[1].shape(), in[0].shape())) == in[0].numel(), "copy_: source ",
            in[1].shape(), " does not broadcast to destination ", in[0].shape());
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
const OpDef kCopy{.name = "copy_", .infer = infer_copy_, .inplace = true};

// copy_many's inputs: the n destinations, then the n sources (contiguous, checked by copy_many_).
std::vector<TensorMeta> infer_copy_many(std::span<const Tensor> in, const Attrs& a) {
  BLU_ASSERT(int64_t(in.size()) == 2 * a.i("n") && !in.empty(), "copy_many: ", in.size(), " inputs for n = ", a.i("n"));
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
bool copy_many_writes(size_t i, const Attrs& a) { return int64_t(i) < a.i("n"); }
const OpDef kCopyMany{.name = "copy_many", .infer = infer_copy_many, .inplace = true, .writes = copy_many_writes};

std::vector<TensorMeta> infer_cast(std::span<const Tensor> in, const Attrs& a) {
  return {TensorMeta{in[0].shape(), a.get<DType>("dtype"), in[0].device()}};
}
std::vector<Tensor> cast_backward(const BackwardContext& c, std::span<const Tensor> g) {
  // A master weight's grad slot (16-bit compute, DDP): cast straight into the bucket, unless the
  // gradient was already written there (Note [Wide gradients]).
  if (const Tensor dst = c.grad_destination(0); dst.defined()) {
    if (g[0].storage() == dst.storage() && g[0].raw_data() == dst.raw_data() && g[0].dtype() == dst.dtype()) return {g[0]};
    return {copy_(dst, g[0])};
  }
  return {g[0].dtype() == c.input_metas[0].dtype ? g[0] : to_dtype(g[0], c.input_metas[0].dtype)};
}
const OpDef kCast{.name = "cast", .infer = infer_cast, .shard = shard_rule_linear_unary, .backward = cast_backward, .grad_in_source_dtype = true};

// Inputs t_0 … t_{n-1} and the copy: the copy holds their rows joined along dim 0 (n = 1: t_0's
// shape).
std::vector<TensorMeta> infer_cast_with_copy(std::span<const Tensor> in, const Attrs&) {
  const Tensor& copy = in.back();
  const std::span<const Tensor> ts = in.first(in.size() - 1);
  int64_t rows = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    BLU_CHECK(is_floating(t.dtype()) && is_floating(copy.dtype()), "cast_with_copy: expected floating tensors, got ",
              t.str(), " and copy ", copy.str());
    BLU_CHECK(t.dtype() == ts[0].dtype() && t.device() == ts[0].device(), "cast_with_copy: tensor ", i, " ",
              t.str(), " differs in dtype or device from tensor 0 ", ts[0].str());
    if (ts.size() > 1) {
      BLU_CHECK(t.dim() >= 1 && copy.dim() == t.dim(), "cast_with_copy: tensor ", i, " ", t.str(),
                " cannot be rows of copy ", copy.str());
      for (int64_t k = 1; k < t.dim(); ++k)
        BLU_CHECK(t.shape()[k] == copy.shape()[k], "cast_with_copy: tensor ", i, " ", t.str(),
                  " cannot be rows of copy ", copy.str());
      rows += t.shape()[0];
    }
  }
  if (ts.size() == 1)
    BLU_CHECK(copy.shape() == ts[0].shape(), "cast_with_copy: copy ", copy.str(), " must have the shape of ",
              ts[0].str());
  else
    BLU_CHECK(rows == copy.shape()[0], "cast_with_copy: the tensors have ", rows, " rows in all, copy ",
              copy.str(), " has ", copy.shape()[0]);
  return {};
}
// The forward is the copy itself, seen through a new handle (its own autograd state).
std::vector<Tensor> cast_with_copy_view(std::span<const Tensor> in, const Attrs&) {
  const Tensor& copy = in.back();
  return {copy.alias_with(copy.shape(), copy.strides(), copy.offset())};
}
// One source: into its grad slot when there is one, as cast does. Several: each its rows of the
// gradient, in its dtype, copied into its grad slot when it has one. When the gradient is in the
// sources' (wide) dtype (Note [Wide gradients]), nothing else refers to its buffer and every
// source takes its rows as they are, the storage is marked as split among leaves (core/storage.h):
// each parameter keeps its rows without a copy (AccumulateGrad) and together they fill the
// buffer. Otherwise each parameter copies its rows, as it does any piece of a larger buffer.
std::vector<Tensor> cast_with_copy_backward(const BackwardContext& c, std::span<const Tensor> g) {
  const size_t n = c.input_metas.size() - 1;
  if (n == 1) return {cast_backward(c, g)[0], Tensor()};
  std::vector<Tensor> grads(n + 1);
  const RefCounts refs = eager_ref_counts(g[0]);
  bool all = refs.impl == 1 && refs.storage == 1;
  int64_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    const TensorMeta& m = c.input_metas[i];
    all = all && c.needs_grad[i] && !c.grad_destination(i).defined();
    if (c.needs_grad[i]) {
      Tensor rows = narrow(g[0], 0, start, m.shape[0]);
      if (rows.dtype() != m.dtype) rows = to_dtype(rows, m.dtype);
      if (const Tensor dst = c.grad_destination(i); dst.defined()) rows = copy_(dst, rows);
      grads[i] = rows;
    }
    start += m.shape[0];
  }
  if (all && g[0].dtype() == c.input_metas[0].dtype && g[0].is_contiguous() && g[0].offset() == 0 &&
      g[0].nbytes() == g[0].storage()->nbytes())
    g[0].storage()->split_among_leaves = true;
  return grads;
}
const OpDef kCastWithCopy{.name = "cast_with_copy",
                          .infer = infer_cast_with_copy,
                          .backward = cast_with_copy_backward,
                          .view = cast_with_copy_view,
                          .grad_in_source_dtype = true};

std::vector<TensorMeta> infer_to_device(std::span<const Tensor> in, const Attrs& a) {
  const int64_t dev = a.i("device");
  return {TensorMeta{in[0].shape(), in[0].dtype(), Device(DeviceType(dev >> 16), int(dev & 0xffff))}};
}
std::vector<Tensor> to_device_backward(const BackwardContext& c, std::span<const Tensor> g) {
  return {to_device(g[0], c.input_metas[0].device)};
}
const OpDef kToDevice{.name = "to_device", .infer = infer_to_device, .backward = to_device_backward, .cross_device = true};

}  // namespace

Tensor to_device(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  if (device == kCPU) count_host_read();  // core/host_reads.h
  return dispatch1(kToDevice, {t}, Attrs{{"device", int64_t(device.type) << 16 | device.index}});
}

Tensor view(const Tensor& t, Shape shape) {
  return dispatch1(kView, {t}, Attrs{{"shape", infer_view_shape(t, std::move(shape))}});
}
Tensor reshape(const Tensor& t, Shape shape) {
  shape = infer_view_shape(t, std::move(shape));
  if (view_strides(t, shape)) return view(t, shape);
  return view(clone(t), shape);
}
Tensor flatten(const Tensor& t, int64_t start, int64_t end) {
  if (t.dim() == 0) return reshape(t, {1});
  start = wrap_dim(start, t.dim());
  end = wrap_dim(end, t.dim());
  BLU_CHECK(start <= end, "flatten: start_dim ", start, " after end_dim ", end);
  Shape s(t.shape().begin(), t.shape().begin() + start);
  int64_t n = 1;
  for (int64_t d = start; d <= end; ++d) n *= t.shape()[d];
  s.push_back(n);
  s.insert(s.end(), t.shape().begin() + end + 1, t.shape().end());
  return reshape(t, s);
}
Tensor permute(const Tensor& t, const Shape& dims) { return dispatch1(kPermute, {t}, Attrs{{"dims", dims}}); }
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1) {
  Shape dims(t.dim());
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[wrap_dim(d0, t.dim())], dims[wrap_dim(d1, t.dim())]);
  return permute(t, dims);
}
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  if (t.dim() > 0 && start < 0) start += t.size(dim);
  return dispatch1(kNarrow, {t}, Attrs{{"dim", dim}, {"start", start}, {"length", length}});
}
Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  BLU_CHECK(t.dim() > 0, "select: needs a tensor with at least one dim");
  dim = wrap_dim(dim, t.dim());
  const int64_t n = t.shape()[dim];
  BLU_CHECK(index >= -n && index < n, "select: index ", index, " out of range for dim ", dim, " of size ", n);
  if (index < 0) index += n;
  return squeeze(narrow(t, dim, index, 1), dim);
}
Tensor expand(const Tensor& t, const Shape& shape) { return dispatch1(kExpand, {t}, Attrs{{"shape", shape}}); }
Tensor unsqueeze(const Tensor& t, int64_t dim) {
  dim = wrap_dim(dim, t.dim() + 1);
  Shape s = t.shape();
  s.insert(s.begin() + dim, 1);
  return view(t, s);
}
Tensor squeeze(const Tensor& t, int64_t dim) {
  if (t.dim() == 0) return t;
  dim = wrap_dim(dim, t.dim());
  if (t.shape()[dim] != 1) return t;
  Shape s = t.shape();
  s.erase(s.begin() + dim);
  return view(t, s);  // dropping a size-1 dim is always a view
}
Tensor clone(const Tensor& t) { return dispatch1(kClone, {t}); }
Tensor contiguous(const Tensor& t) { return t.is_contiguous() ? t : clone(t); }
const Tensor& copy_(const Tensor& dst, const Tensor& src) {
  dispatch(kCopy, {dst, src});
  return dst;
}
void copy_many_(const std::vector<Tensor>& dst, const std::vector<Tensor>& src) {
  BLU_CHECK(dst.size() == src.size(), "copy_many_: ", dst.size(), " destinations but ", src.size(), " sources");
  std::vector<Tensor> in, srcs;
  for (size_t i = 0; i < dst.size(); ++i) {
    const Tensor &d = dst[i], &s = src[i];
    BLU_CHECK(d.defined() && s.defined(), "copy_many_: pair ", i, " has an undefined tensor");
    BLU_CHECK(d.dtype() == s.dtype() && d.numel() == s.numel(), "copy_many_: pair ", i, ": destination ", d.str(),
              " and source ", s.str(), " must have one dtype and numel");
    BLU_CHECK(d.device() == dst[0].device() && s.device() == dst[0].device(), "copy_many_: pair ", i,
              " is not on ", dst[0].device(), " (", d.str(), ", ", s.str(), ")");
    BLU_CHECK(!GradMode::enabled() || (!d.requires_grad() && !s.requires_grad()), "copy_many_: pair ", i,
              " requires grad; copy under NoGradGuard (no autograd)");
    if (d.numel() == 0) continue;
    if (!d.is_contiguous() || !s.is_contiguous()) {
      copy_(d, s);
      continue;
    }
    in.push_back(d);
    srcs.push_back(s);
  }
  if (in.empty()) return;
  const int64_t n = int64_t(in.size());
  in.insert(in.end(), srcs.begin(), srcs.end());
  dispatch(kCopyMany, std::move(in), Attrs{{"n", n}});
}
Tensor to_dtype(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  return dispatch1(kCast, {t}, Attrs{{"dtype", dtype}});
}
Tensor cast_with_copy(const Tensor& t, const Tensor& copy) { return dispatch1(kCastWithCopy, {t, copy}); }
Tensor cast_with_copy(const std::vector<Tensor>& ts, const Tensor& copy) {
  BLU_CHECK(!ts.empty(), "cast_with_copy: expected at least one tensor, got none");
  std::vector<Tensor> in = ts;
  in.push_back(copy);
  return dispatch1(kCastWithCopy, in);
}

}  // namespace blu
