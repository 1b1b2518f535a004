// OpInfo entries for ops/linalg: matmul over every torch.matmul case, and linear.
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;

std::vector<Sample> matmul_samples(DType dt, Generator& g) {
  auto r = [&](const Shape& s) { return rnd(g, s, dt); };
  return {{{r({5}), r({5})}, "1-D . 1-D"},
          {{r({1}), r({1})}, "1 element . 1 element"},
          {{r({3}), r({3, 4})}, "1-D . 2-D"},
          {{r({3, 5}), r({5})}, "2-D . 1-D"},
          {{r({3, 5}), r({5, 7})}, "2-D . 2-D odd sizes"},
          {{r({1, 1}), r({1, 1})}, "1x1 . 1x1"},
          {{r({2, 3, 5}), r({2, 5, 4})}, "batched 3-D"},
          {{r({2, 1, 3, 4}), r({5, 4, 2})}, "broadcast batch dims"},
          {{r({2, 3, 4}), r({4, 5})}, "batched . 2-D (folded into one gemm)"},
          {{r({3, 4}), r({2, 4, 5})}, "2-D . batched"},
          {{r({4}), r({2, 4, 3})}, "1-D . batched"},
          {{r({2, 3, 4}), r({4})}, "batched . 1-D"},
          {{noncontig(r({3, 4})), noncontig(r({4, 5}))}, "transposed layouts"},
          {{noncontig(r({4})), noncontig(r({4, 3}))}, "strided 1-D . transposed"},
          {{noncontig(r({2, 3, 4})), r({2, 4, 5})}, "batched, transposed a"},
          {{r({3, 0}), r({0, 2})}, "empty inner dim"}};
}

std::vector<Sample> linear_samples(DType dt, Generator& g, bool bias) {
  auto r = [&](const Shape& s) { return rnd(g, s, dt); };
  auto mk = [&](Tensor x, Tensor w) {
    V v{x, w};
    if (bias) v.push_back(r({w.shape()[0]}));
    return v;
  };
  return {{mk(r({3, 5}), r({4, 5})), "2-D x"},
          {mk(r({2, 3, 5}), r({4, 5})), "3-D x"},
          {mk(r({5}), r({4, 5})), "1-D x"},
          {mk(r({1, 1}), r({1, 1})), "1x1"},
          {mk(noncontig(r({3, 5})), noncontig(r({7, 5}))), "non-contiguous x and w"},
          {mk(noncontig(r({2, 3, 4})), r({3, 4})), "non-contiguous 3-D x (copied by reshape)"}};
}

BLU_OPINFO(OpInfo{.name = "matmul",
                  .fn = [](const V& x) { return matmul(x[0], x[1]); },
                  .samples = matmul_samples,
                  .torch = "torch.matmul(x0, x1)"},
           OpInfo{.name = "matmul_expanded_operand",  // stride-0 rows: the kernel packs them
                  .fn = [](const V& x) { return matmul(expand(x[0], {3, 4}), x[1]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {1, 4}, dt), rnd(g, {4, 2}, dt)}, "[1,4] expanded to [3,4]"}};
                  },
                  .torch = "torch.matmul(x0.expand(3, 4), x1)"},
           OpInfo{.name = "matmul_no_unit_stride",  // neither stride is 1: the kernel packs both
                  .fn = [](const V& x) { return matmul(select(x[0], 2, 0), select(x[1], 2, 1)); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {3, 4, 2}, dt), rnd(g, {4, 5, 2}, dt)}, "selected"}};
                  },
                  .torch = "torch.matmul(x0.select(2, 0), x1.select(2, 1))"},
           OpInfo{.name = "linear",
                  .fn = [](const V& x) { return linear(x[0], x[1], x[2]); },
                  .samples = [](DType dt, Generator& g) { return linear_samples(dt, g, true); },
                  .torch = "F.linear(x0, x1, x2)"},
           OpInfo{.name = "linear_weight_grad",  // both outputs, flattened into one
                  .fn = [](const V& x) {
                    const V wb = linear_weight_grad(x[0], x[1]);
                    return cat({flatten(wb[0]), wb[1]});
                  },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {6, 3}, dt), rnd(g, {6, 4}, dt)}, "g [6,3], x [6,4]"},
                                               {{noncontig(rnd(g, {5, 2}, dt)), rnd(g, {5, 3}, dt)}, "transposed g"}};
                  },
                  .torch = "torch.cat([(x0.t() @ x1).flatten(), x0.sum(0)])"},
           OpInfo{.name = "linear_residual",  // residual + linear(x, w, b) in one GEMM
                  .fn = [](const V& x) { return linear(x[0], x[1], x[2], x[3]); },
                  .samples = [](DType dt, Generator& g) {
                    auto r = [&](const Shape& s) { return rnd(g, s, dt); };
                    return std::vector<Sample>{{{r({3, 5}), r({4, 5}), r({4}), r({3, 4})}, "2-D"},
                                               {{r({2, 3, 5}), r({4, 5}), r({4}), r({2, 3, 4})}, "3-D"},
                                               {{r({3, 5}), noncontig(r({4, 5})), Tensor(), noncontig(r({3, 4}))},
                                                "no bias, non-contiguous weight and residual"}};
                  },
                  .torch = "x3 + F.linear(x0, x1, x2)"},
           OpInfo{.name = "linear_no_bias",
                  .fn = [](const V& x) { return linear(x[0], x[1]); },
                  .samples = [](DType dt, Generator& g) { return linear_samples(dt, g, false); },
                  .torch = "F.linear(x0, x1)"});

}  // namespace
}  // namespace blu::test

// ops/fused: gelu_linear against the unfused composition in PyTorch.
namespace blu::test {
namespace {
BLU_OPINFO(OpInfo{.name = "gelu_linear",
                  .fn = [](const std::vector<Tensor>& x) { return gelu_linear(x[0], x[1], x[2]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{
                        {{rnd(g, {5, 7}, dt), rnd(g, {3, 7}, dt), rnd(g, {3}, dt)}, "2-D with bias"},
                        {{rnd(g, {2, 3, 4}, dt), noncontig(rnd(g, {5, 4}, dt)), rnd(g, {5}, dt)}, "3-D, transposed weight"},
                        {{rnd(g, {4}, dt), rnd(g, {2, 4}, dt), Tensor()}, "1-D, no bias"}};
                  },
                  .torch = "F.linear(F.gelu(x0, approximate='tanh'), x1, x2)"},
           OpInfo{.name = "gelu_linear_residual",
                  .fn = [](const std::vector<Tensor>& x) { return gelu_linear(x[0], x[1], x[2], x[3]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{
                        {{rnd(g, {5, 7}, dt), rnd(g, {3, 7}, dt), rnd(g, {3}, dt), rnd(g, {5, 3}, dt)}, "2-D"},
                        {{rnd(g, {2, 3, 4}, dt), rnd(g, {5, 4}, dt), Tensor(), noncontig(rnd(g, {2, 3, 5}, dt))},
                         "3-D, no bias, non-contiguous residual"}};
                  },
                  .torch = "x3 + F.linear(F.gelu(x0, approximate='tanh'), x1, x2)"});
}  // namespace
}  // namespace blu::test
