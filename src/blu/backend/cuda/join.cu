// CUDA kernel for ops/join: cat copies each input (any strides) into its slice of the output.
// A copy moves bits, so it dispatches on the element size; each input is one launch of the
// elementwise map (vectorised when the input and its slice are contiguous and aligned, e.g.
// cat along dim 0).
#include "blu/backend/cuda/loops.cuh"

namespace blu::cuda {

namespace {

struct identity_op {
  template <typename B>
  __device__ __forceinline__ B operator()(B x) const { return x; }
};

void cat_kernel(const KernelCall& c) {
  const Tensor& out = c.out[0];
  const int64_t d = c.attrs.i("dim");
  int64_t start = 0;
  for (const Tensor& t : c.in) {
    if (t.numel() > 0) {
      const Tensor slice = out.alias_with(t.shape(), out.strides(), out.offset() + start * out.strides()[d]);
      BLU_DISPATCH_BITS(out.itemsize(), "cat", launch_map<bits_t, bits_t>(stream_of(c.ctx), slice, identity_op{}, t));
    }
    start += t.shape()[d];
  }
}
BLU_REGISTER_KERNEL(cuda, "cat", cat_kernel);

}  // namespace

}  // namespace blu::cuda
