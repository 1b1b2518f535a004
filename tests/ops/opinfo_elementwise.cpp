// OpInfo entries for ops/elementwise.
#include <cmath>

#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;

// Shapes every unary op is sampled on: 0-d, 1 element, odd sizes, and a non-contiguous layout.
std::vector<Sample> unary_samples(DType dt, Generator& g, bool positive = false) {
  auto mk = [&](const Shape& s) { return positive ? rnd_positive(g, s, dt) : rnd(g, s, dt); };
  return {{{mk({})}, "0-d"}, {{mk({1})}, "1 element"}, {{mk({3, 5})}, "3x5"}, {{noncontig(mk({4, 3}))}, "non-contiguous"}};
}

std::vector<Sample> binary_samples(DType dt, Generator& g, bool positive_b = false) {
  auto b = [&](const Shape& s) { return positive_b ? rnd_positive(g, s, dt) : rnd(g, s, dt); };
  return {{{rnd(g, {}, dt), b({})}, "0-d"},
          {{rnd(g, {3, 4}, dt), b({3, 4})}, "same shape"},
          {{rnd(g, {2, 3, 4}, dt), b({3, 1})}, "broadcast"},
          {{rnd(g, {1, 4}, dt), b({3, 1})}, "both broadcast"},
          {{noncontig(rnd(g, {3, 4}, dt)), noncontig(b({3, 4}))}, "non-contiguous"},
          {{rnd(g, {5}, dt), b({})}, "with 0-d"}};
}

#define UNARY(NAME, CALL, TORCH, ...)                                                      \
  OpInfo {                                                                                 \
    .name = NAME, .fn = [](const V& x) { return CALL; },                                   \
    .samples = [](DType dt, Generator& g) { return unary_samples(dt, g __VA_ARGS__); }, \
    .torch = TORCH                                                                         \
  }
#define BINARY(NAME, CALL, TORCH, ...)                                                      \
  OpInfo {                                                                                  \
    .name = NAME, .fn = [](const V& x) { return CALL; },                                    \
    .samples = [](DType dt, Generator& g) { return binary_samples(dt, g __VA_ARGS__); }, \
    .torch = TORCH                                                                          \
  }

BLU_OPINFO(UNARY("neg", neg(x[0]), "-x0"),
           UNARY("exp", exp(x[0]), "torch.exp(x0)"),
           UNARY("log", log(x[0]), "torch.log(x0)", , true),
           UNARY("sqrt", sqrt(x[0]), "torch.sqrt(x0)", , true),
           UNARY("rsqrt", rsqrt(x[0]), "torch.rsqrt(x0)", , true),
           UNARY("tanh", tanh(x[0]), "torch.tanh(x0)"),
           UNARY("sigmoid", sigmoid(x[0]), "torch.sigmoid(x0)"),
           UNARY("relu", relu(x[0]), "torch.relu(x0)"),
           UNARY("gelu", gelu(x[0]), "F.gelu(x0)"),
           UNARY("gelu_tanh", gelu(x[0], true), "F.gelu(x0, approximate='tanh')"),
           UNARY("abs", abs(x[0]), "torch.abs(x0)"),
           UNARY("clamp", clamp(x[0], -0.5, 0.7), "torch.clamp(x0, -0.5, 0.7)"),
           UNARY("clamp_min", clamp(x[0], -0.3, INFINITY), "torch.clamp(x0, min=-0.3)"),
           UNARY("pow_scalar", pow(x[0], 2.5), "torch.pow(x0, 2.5)", , true),
           UNARY("pow_scalar_int", pow(x[0], 3.0), "torch.pow(x0, 3.0)"),
           UNARY("add_scalar", add(x[0], 1.5), "x0 + 1.5"),
           UNARY("mul_scalar", mul(x[0], -2.5), "x0 * -2.5"),
           UNARY("rsub_scalar", 2.0 - x[0], "2.0 - x0"),
           OpInfo{.name = "gelu_and_backward",  // both outputs, flattened into one
                  .fn = [](const V& x) {
                    const V r = gelu_and_backward(x[0], x[1], true);
                    return cat({flatten(r[0]), flatten(r[1])});
                  },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {3, 37}, dt), rnd(g, {3, 37}, dt)}, "vectors and a tail"},
                                               {{rnd(g, {4, 3}, dt), noncontig(rnd(g, {4, 3}, dt))}, "strided x"}};
                  },
                  .torch = "torch.cat([F.gelu(x1, approximate='tanh').flatten(), "
                           "torch.ops.aten.gelu_backward(x0, x1, approximate='tanh').flatten()])",
                  .differentiable = false},
           BINARY("add", add(x[0], x[1]), "x0 + x1"),
           BINARY("sub", sub(x[0], x[1]), "x0 - x1"),
           BINARY("mul", mul(x[0], x[1]), "x0 * x1"),
           BINARY("div", div(x[0], x[1]), "x0 / x1", , true),
           OpInfo{.name = "pow",
                  .fn = [](const V& x) { return pow(x[0], x[1]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd_positive(g, {3, 4}, dt), rnd(g, {3, 4}, dt)}, "same shape"},
                                               {{rnd_positive(g, {2, 3}, dt), rnd(g, {3}, dt)}, "broadcast"}};
                  },
                  .torch = "torch.pow(x0, x1)"},
           OpInfo{.name = "where",
                  .fn = [](const V& x) { return where(gt(x[0], 0.0), x[1], x[2]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{
                        {{rnd(g, {3, 4}, dt), rnd(g, {3, 4}, dt), rnd(g, {3, 4}, dt)}, "same shape"},
                        {{rnd(g, {3, 1}, dt), rnd(g, {4}, dt), noncontig(rnd(g, {3, 4}, dt))}, "broadcast"}};
                  },
                  .torch = "torch.where(x0 > 0, x1, x2)",
                  .no_grad_inputs = {0}},
           OpInfo{.name = "masked_fill",
                  .fn = [](const V& x) { return masked_fill(x[0], lt(x[1], 0.0), -3.0); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {3, 4}, dt), rnd(g, {3, 4}, dt)}, "same shape"},
                                               {{rnd(g, {2, 3, 4}, dt), rnd(g, {3, 1}, dt)}, "broadcast mask"}};
                  },
                  .torch = "x0.masked_fill(x1 < 0, -3.0)",
                  .no_grad_inputs = {1}},
           OpInfo{.name = "compare",
                  .fn = [](const V& x) {
                    // All six comparisons, as 0/1 values stacked along a new last dim.
                    auto f = [&](const Tensor& b) { return unsqueeze(to_dtype(b, x[0].dtype()), -1); };
                    Tensor parts[] = {f(eq(x[0], x[1])), f(ne(x[0], x[1])), f(lt(x[0], x[1])),
                                      f(le(x[0], x[1])), f(gt(x[0], x[1])), f(ge(x[0], x[1]))};
                    Tensor out = zeros({}, x[0].dtype(), x[0].device());
                    for (int k = 0; k < 6; ++k) out = add(mul(out, 2.0), parts[k]);
                    return out;
                  },
                  .samples = [](DType dt, Generator& g) {
                    Tensor a = rnd(g, {3, 4}, dt);
                    Tensor b = contiguous(a);
                    copy_(narrow(b, 0, 0, 1), rnd(g, {1, 4}, dt));  // some equal, some not
                    return std::vector<Sample>{{{a, b}, "with ties"}, {{rnd(g, {2, 3}, dt), rnd(g, {3}, dt)}, "broadcast"}};
                  },
                  .torch = "((((((x0 == x1).to(x0.dtype)*2 + (x0 != x1).to(x0.dtype))*2 + (x0 < x1).to(x0.dtype))*2 + "
                           "(x0 <= x1).to(x0.dtype))*2 + (x0 > x1).to(x0.dtype))*2 + (x0 >= x1).to(x0.dtype)).unsqueeze(-1)",
                  .differentiable = false});

}  // namespace
}  // namespace blu::test
