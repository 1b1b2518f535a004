// core/shape: shapes and strides (in elements), broadcasting and dimension wrapping.
// Depends on core/error. Keep: a stride is in elements, never bytes; a 0-d tensor has shape {}.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

namespace blu {

using Shape = std::vector<int64_t>;

int64_t numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
// The shape both broadcast to (NumPy rules); BLU_CHECK names both shapes when they do not.
Shape broadcast_shapes(const Shape& a, const Shape& b);
// Wraps a possibly negative dim into [0, ndim); BLU_CHECK when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim);
std::string to_string(const Shape& shape);  // "[2, 3]"

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << to_string(s); }

}  // namespace blu
