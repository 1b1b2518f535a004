// ops/join: putting tensors together and taking them apart along a dim — cat, stack, split,
// chunk. Depends on ops/dispatch, ops/view. Keep: split/chunk return views (no copy).
#pragma once
#include <vector>

#include "blu/core/tensor.h"

namespace blu {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
// Pieces of `size` along dim (the last may be smaller).
std::vector<Tensor> split(const Tensor& t, int64_t size, int64_t dim = 0);
// Pieces of the given sizes (must sum to the dim's size).
std::vector<Tensor> split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim = 0);
// `chunks` pieces as torch.chunk does (ceil-sized, possibly fewer).
std::vector<Tensor> chunk(const Tensor& t, int64_t chunks, int64_t dim = 0);

}  // namespace blu
