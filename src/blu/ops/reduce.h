// ops/reduce: reductions over dims — sum, mean, var, max/min (values and indices), argmax —
// and sum_to, which folds a broadcast gradient back to an input's shape.
// Depends on ops/dispatch. Keep: `dims` empty means every dim; keepdim keeps them as size 1.
#pragma once
#include <utility>

#include "blu/core/tensor.h"

namespace blu {

Tensor sum(const Tensor& t, const Shape& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& t, const Shape& dims = {}, bool keepdim = false);
// Variance with Bessel's correction `correction` (1 = unbiased, as PyTorch's default).
Tensor var(const Tensor& t, const Shape& dims = {}, int64_t correction = 1, bool keepdim = false);
// Largest/smallest along dim and where (first occurrence); indices are i64.
std::pair<Tensor, Tensor> max(const Tensor& t, int64_t dim, bool keepdim = false);
std::pair<Tensor, Tensor> min(const Tensor& t, int64_t dim, bool keepdim = false);
// Over all elements.
Tensor max(const Tensor& t);
Tensor min(const Tensor& t);
Tensor argmax(const Tensor& t, int64_t dim, bool keepdim = false);
// Sums g over the dims that broadcasting added or stretched, giving `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape);

}  // namespace blu
