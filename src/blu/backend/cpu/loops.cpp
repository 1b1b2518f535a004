#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  const size_t nd = shape.size(), td = t.shape().size();
  BLU_ASSERT(td <= nd, "broadcast of ", t.str(), " to ", to_string(shape));
  BLU_ASSERT(nd <= 16, "tensors of more than 16 dims are not supported (", nd, ")");
  Shape s(nd, 0);
  for (size_t i = 0; i < td; ++i) {
    const size_t d = nd - td + i;
    BLU_ASSERT(t.shape()[i] == shape[d] || t.shape()[i] == 1, "broadcast of ", t.str(), " to ", to_string(shape));
    s[d] = t.shape()[i] == 1 ? 0 : t.strides()[i];
  }
  return s;
}

}  // namespace blu::cpu
