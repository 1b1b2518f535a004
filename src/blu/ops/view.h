// ops/view: tensors that share their input's storage with new shape/strides (no copy), their
// gradients, and the copies for when a view is impossible (contiguous, clone, reshape of a
// non-viewable layout). Depends on ops/dispatch. Keep: a view op never copies; a function named
// view/permute/narrow/expand returns an alias or throws BLU_CHECK.
#pragma once
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

// Same elements, new shape; one dim may be -1. Throws if the layout cannot be viewed that way.
Tensor view(const Tensor& t, Shape shape);
// Like view, but copies when the layout cannot be viewed.
Tensor reshape(const Tensor& t, Shape shape);
Tensor flatten(const Tensor& t, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor permute(const Tensor& t, const Shape& dims);
Tensor transpose(const Tensor& t, int64_t d0, int64_t d1);
// Elements [start, start+length) of dim.
Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length);
// Index `index` of dim, removing the dim.
Tensor select(const Tensor& t, int64_t dim, int64_t index);
// Broadcast to `shape` with stride 0 along the new/size-1 dims; -1 keeps a size.
Tensor expand(const Tensor& t, const Shape& shape);
Tensor unsqueeze(const Tensor& t, int64_t dim);
Tensor squeeze(const Tensor& t, int64_t dim);
// A contiguous copy (with autograd); contiguous() returns t itself when it already is.
Tensor clone(const Tensor& t);
Tensor contiguous(const Tensor& t);
// Copies src (broadcast, any dtype) into dst in place. No autograd.
const Tensor& copy_(const Tensor& dst, const Tensor& src);
// dst[i] = src[i] for every pair, as one op: on CUDA one launch per 96 pairs whatever their
// sizes, so many small copies (dist/zero's shards ↔ parameters) do not leave the GPU waiting on
// the host's launches. Pairs share a dtype (no conversion) and a numel, all on one device; a
// non-contiguous pair is copied by copy_ apart. Pairs must not overlap. No autograd.
void copy_many_(const std::vector<Tensor>& dst, const std::vector<Tensor>& src);
// The same values on another device (a copy; the same tensor when already there). Gradients
// flow back to the source device. A copy from a device to the CPU counts as a host read
// (core/host_reads.h).
Tensor to_device(const Tensor& t, Device device);
// Cast to another dtype (a copy; the same tensor when dtype already matches).
Tensor to_dtype(const Tensor& t, DType dtype);
// to_dtype(t, copy.dtype()) when `copy` already holds exactly those values: returns an alias of
// `copy` (no kernel) that autograd links to t — the gradient comes back cast to t's dtype, none
// goes to `copy`. The caller vouches for the values (nn/compute_copy.h, Note [Compute copies]).
Tensor cast_with_copy(const Tensor& t, const Tensor& copy);
// The same over several tensors whose rows (dim 0) `copy` holds joined in order, i.e.
// to_dtype(cat(ts, 0), copy.dtype()): an alias of `copy` linked to every t, each getting its rows
// of the gradient (nn/layers.h: sibling_linears over parameters whose compute copies lie side by
// side).
Tensor cast_with_copy(const std::vector<Tensor>& ts, const Tensor& copy);

}  // namespace blu
