// OpInfo entries for ops/reduce and ops/view.
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;

std::vector<Sample> reduce_samples(DType dt, Generator& g) {
  return {{{rnd(g, {3, 4, 5}, dt)}, "3x4x5"}, {{noncontig(rnd(g, {4, 6}, dt))}, "non-contiguous"}};
}
#define REDUCE(NAME, CALL, TORCH) \
  OpInfo { .name = NAME, .fn = [](const V& x) { return CALL; }, .samples = reduce_samples, .torch = TORCH }

BLU_OPINFO(REDUCE("sum_all", sum(x[0]), "x0.sum()"),
           REDUCE("sum_dim", sum(x[0], {1}), "x0.sum(1)"),
           REDUCE("sum_dims_keepdim", sum(x[0], {0, -1}, true), "x0.sum((0, -1), keepdim=True)"),
           REDUCE("mean_all", mean(x[0]), "x0.mean()"),
           REDUCE("mean_dim", mean(x[0], {-1}), "x0.mean(-1)"),
           REDUCE("var_dim", var(x[0], {0}), "x0.var(0)"),
           REDUCE("var_all_biased", var(x[0], {}, 0, false), "x0.var(unbiased=False)"),
           REDUCE("max_dim", max(x[0], 1).first, "x0.max(1).values"),
           REDUCE("max_dim_keepdim", max(x[0], 0, true).first, "x0.max(0, keepdim=True).values"),
           REDUCE("min_dim", min(x[0], -1).first, "x0.min(-1).values"),
           REDUCE("max_all", max(x[0]), "x0.max()"),
           OpInfo{.name = "argmax",
                  .fn = [](const V& x) { return to_dtype(argmax(x[0], 1), DType::f32); },
                  .samples = reduce_samples,
                  .torch = "x0.argmax(1).float()",
                  .differentiable = false},
           OpInfo{.name = "sum_0d",
                  .fn = [](const V& x) { return sum(x[0]); },
                  .samples = [](DType dt, Generator& g) { return std::vector<Sample>{{{rnd(g, {}, dt)}, "0-d"}}; },
                  .torch = "x0.sum()"},
           OpInfo{.name = "reshape_permute_narrow",
                  .fn = [](const V& x) { return narrow(permute(reshape(x[0], {2, 3, 4}), {2, 0, 1}), 1, 1, 1); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {6, 4}, dt)}, "contiguous"}, {{noncontig(rnd(g, {6, 4}, dt))}, "non-contiguous"}};
                  },
                  .torch = "x0.reshape(2, 3, 4).permute(2, 0, 1).narrow(1, 1, 1)"},
           OpInfo{.name = "expand_transpose_select",
                  .fn = [](const V& x) { return mul(select(transpose(expand(x[0], {2, 3, 4}), 0, 2), 1, -1), 2.0); },
                  .samples = [](DType dt, Generator& g) { return std::vector<Sample>{{{rnd(g, {3, 1}, dt)}, "3x1"}}; },
                  .torch = "x0.expand(2, 3, 4).transpose(0, 2).select(1, -1) * 2"},
           OpInfo{.name = "unsqueeze_squeeze_flatten",
                  .fn = [](const V& x) { return flatten(squeeze(unsqueeze(x[0], 1), 1), 0); },
                  .samples = [](DType dt, Generator& g) { return std::vector<Sample>{{{noncontig(rnd(g, {3, 4}, dt))}, "nc"}}; },
                  .torch = "x0.unsqueeze(1).squeeze(1).flatten(0)"},
           OpInfo{.name = "cast_roundtrip",
                  .fn = [](const V& x) { return to_dtype(mul(to_dtype(x[0], DType::f64), 3.0), x[0].dtype()); },
                  .samples = [](DType dt, Generator& g) { return std::vector<Sample>{{{rnd(g, {5}, dt)}, "5"}}; },
                  .torch = "(x0.double() * 3).to(x0.dtype)"});

}  // namespace
}  // namespace blu::test
