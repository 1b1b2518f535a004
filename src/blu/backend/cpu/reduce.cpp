// CPU kernels for ops/reduce. Floating sums accumulate in double (a reference backend: more
// accurate than the fp32 it stores).
#include <cmath>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"

namespace blu::cpu {

namespace {

std::vector<bool> mask_of(const Tensor& t, const Shape& dims) {
  std::vector<bool> m(size_t(t.dim()), false);
  for (int64_t d : dims) m[d] = true;
  return m;
}

void sum_kernel(const KernelCall& c) {
  const Tensor& in = c.in[0];
  Tensor& out = c.out[0];
  const auto mask = mask_of(in, c.attrs.get<Shape>("dims"));
  BLU_DISPATCH_ALL(in.dtype(), "sum", {
    const scalar_t* p = static_cast<const scalar_t*>(in.raw_data());
    if constexpr (std::is_floating_point_v<acc_t<scalar_t>>) {
      scalar_t* o = out.data<scalar_t>();
      reduce_loop(in, mask, [&](int64_t i, auto&& visit) {
        double s = 0;
        visit([&](int64_t off) { s += double(p[off]); });
        o[i] = scalar_t(s);
      });
    } else {
      int64_t* o = out.data<int64_t>();
      reduce_loop(in, mask, [&](int64_t i, auto&& visit) {
        int64_t s = 0;
        visit([&](int64_t off) { s += int64_t(p[off]); });
        o[i] = s;
      });
    }
  });
}
BLU_REGISTER_KERNEL(cpu, "sum", sum_kernel);

// NaN wins (propagates), as in PyTorch; ties keep the first index.
template <bool kMax>
void extreme_kernel(const KernelCall& c) {
  const Tensor& in = c.in[0];
  Tensor& vals = c.out[0];
  int64_t* idx = c.out[1].data<int64_t>();
  if (in.dim() == 0) {
    BLU_DISPATCH_ALL(in.dtype(), "max", *vals.data<scalar_t>() = *static_cast<const scalar_t*>(in.raw_data()));
    *idx = 0;
    return;
  }
  std::vector<bool> mask(size_t(in.dim()), false);
  mask[c.attrs.i("dim")] = true;
  BLU_DISPATCH_ALL(in.dtype(), "max", {
    using A = acc_t<scalar_t>;
    const scalar_t* p = static_cast<const scalar_t*>(in.raw_data());
    scalar_t* o = vals.data<scalar_t>();
    reduce_loop(in, mask, [&](int64_t i, auto&& visit) {
      A best{};
      int64_t best_k = -1, k = 0;
      bool nan = false;
      visit([&](int64_t off) {
        const A v = A(p[off]);
        if (!nan) {
          bool is_nan = false;
          if constexpr (std::is_floating_point_v<A>) is_nan = std::isnan(v);
          if (is_nan || best_k < 0 || (kMax ? v > best : v < best)) {
            best = v;
            best_k = k;
            nan = is_nan;
          }
        }
        ++k;
      });
      o[i] = scalar_t(best);
      idx[i] = best_k;
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "max_dim", extreme_kernel<true>);
BLU_REGISTER_KERNEL(cpu, "min_dim", extreme_kernel<false>);

// out = zeros(shape); out[..., idx[...], ...] = g along dim (idx has size 1 along dim).
void scatter_dim_kernel(const KernelCall& c) {
  const Tensor& g = c.in[0];
  const Tensor& idx = c.in[1];
  Tensor& out = c.out[0];
  const int64_t dim = c.attrs.i("dim");
  BLU_DISPATCH_FLOATING(out.dtype(), "scatter_dim", {
    scalar_t* o = out.data<scalar_t>();
    std::fill(o, o + out.numel(), scalar_t(0.0f));
    const scalar_t* gp = static_cast<const scalar_t*>(g.raw_data());
    const int64_t* ip = static_cast<const int64_t*>(idx.raw_data());
    const Shape& os = out.strides();
    std::array<Shape, 2> strides{g.strides(), idx.strides()};
    // Walk g's positions; the output position is the same except along dim, where it is idx.
    const Shape gshape = g.shape();
    strided_loop(gshape, strides, [&](int64_t lin, const std::array<int64_t, 2>& off) {
      int64_t rem = lin, out_off = 0;
      for (int64_t d = int64_t(gshape.size()) - 1; d >= 0; --d) {
        const int64_t cd = rem % gshape[d];
        rem /= gshape[d];
        out_off += (d == dim ? ip[off[1]] : cd) * os[d];
      }
      o[out_off] = scalar_t(float(o[out_off]) + float(gp[off[0]]));
    });
  });
}
BLU_REGISTER_KERNEL(cpu, "scatter_dim", scatter_dim_kernel);

}  // namespace

}  // namespace blu::cpu
