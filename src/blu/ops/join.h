// ops/join: putting tensors together and taking them apart along a dim — cat, stack, split,
// chunk. Depends on ops/dispatch, ops/view. Keep: split/chunk return views (no copy).
#pragma once
#include <span>
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Pieces of `size` along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& t, int64_t size, int64_t dim = 0);
// Pieces of the given sizes (must sum to the dim's size).
std::vector<Tensor> split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0);
// The pieces joined along dim as a view, when they already lie side by side in one buffer (same
// storage, dtype and strides, each starting where the previous one ends along dim); undefined
// otherwise. No copy and no autograd: the caller vouches for what the view is used as.
Tensor adjacent_join(std::span<const Tensor> pieces, int64_t dim);
// `chunks` pieces as torch.chunk does (ceil-sized, possibly fewer).
std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);

}  // namespace blu
