#include "blu/core/shape.h"

#include "blu/core/error.h"

namespace blu {

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    BLU_CHECK(da == db || da == 1 || db == 1, "shapes ", to_string(a), " and ", to_string(b),
              " do not broadcast: dim ", i, " is ", da, " vs ", db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int64_t wrap_dim(int64_t dim, int64_t ndim) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  BLU_CHECK(dim >= lo && dim <= hi, "dim ", dim, " is out of range for a tensor of ", ndim,
            " dims (expected ", lo, "..", hi, ")");
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace blu
