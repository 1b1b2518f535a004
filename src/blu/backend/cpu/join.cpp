// CPU kernel for ops/join: cat copies each input (any strides) into its slice of the output.
#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

namespace {

void cat_kernel(const KernelCall& c) {
  Tensor& out = c.out[0];
  const int64_t d = c.attrs.i("dim");
  BLU_DISPATCH_ALL(out.dtype(), "cat", {
    scalar_t* o = out.data<scalar_t>();
    int64_t start = 0;
    for (const Tensor& t : c.in) {
      const scalar_t* src = t.data<scalar_t>();
      scalar_t* dst = o + start * out.strides()[d];
      strided_loop(t.shape(), std::array<Shape, 2>{out.strides(), t.strides()},
                   [&](int64_t, const std::array<int64_t, 2>& off) { dst[off[0]] = src[off[1]]; });
      start += t.shape()[d];
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "cat", cat_kernel);

}  // namespace

}  // namespace blu::cpu
