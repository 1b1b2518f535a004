// OpInfo entries for ops/join: cat, stack, split, chunk. Split and chunk give several pieces; the
// entries combine them (a weighted sum of per-piece reductions) so every piece's gradient flows.
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;
using S = std::vector<Sample>;

// sum_i (i + 1) * pieces[i].sum(dim)
Tensor weighted_piece_sum(const V& pieces, int64_t dim) {
  Tensor acc;
  for (size_t i = 0; i < pieces.size(); ++i) {
    Tensor term = mul(sum(pieces[i], {dim}), double(i + 1));
    acc = acc.defined() ? add(acc, term) : term;
  }
  return acc;
}
const char* kTorchWeightedPieceSum = "sum(p.sum({dim}) * (i + 1) for i, p in enumerate({pieces}))";

std::string weighted_expr(const std::string& pieces, int64_t dim) {
  std::string s = kTorchWeightedPieceSum;
  s.replace(s.find("{dim}"), 5, std::to_string(dim));
  s.replace(s.find("{pieces}"), 8, pieces);
  return s;
}

BLU_OPINFO(
    OpInfo{.name = "cat_dim0",
           .fn = [](const V& x) { return cat({x[0], x[1]}, 0); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {2, 3}, dt), rnd(g, {5, 3}, dt)}, "2x3 + 5x3"},
                      {{noncontig(rnd(g, {3, 4}, dt)), noncontig(rnd(g, {1, 4}, dt))}, "non-contiguous"},
                      {{rnd(g, {1, 1}, dt), rnd(g, {1, 1}, dt)}, "1-element"},
                      {{rnd(g, {0, 3}, dt), rnd(g, {3, 3}, dt)}, "empty first"}};
           },
           .torch = "torch.cat([x0, x1], 0)"},
    OpInfo{.name = "cat_last_three",
           .fn = [](const V& x) { return cat({x[0], x[1], x[2]}, -1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {3, 2}, dt), rnd(g, {3, 5}, dt), rnd(g, {3, 1}, dt)}, "3x2 + 3x5 + 3x1"},
                      {{noncontig(rnd(g, {3, 2}, dt)), rnd(g, {3, 5}, dt), noncontig(rnd(g, {3, 3}, dt))},
                       "mixed non-contiguous"},
                      {{rnd(g, {5}, dt), noncontig(rnd(g, {1}, dt)), rnd(g, {7}, dt)}, "1-d odd sizes"}};
           },
           .torch = "torch.cat([x0, x1, x2], -1)"},
    OpInfo{.name = "cat_middle",
           .fn = [](const V& x) { return cat({x[0], x[1], x[2]}, 1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {2, 3, 4}, dt), rnd(g, {2, 1, 4}, dt), rnd(g, {2, 5, 4}, dt)}, "2x{3,1,5}x4"},
                      {{noncontig(rnd(g, {2, 3, 5}, dt)), noncontig(rnd(g, {2, 2, 5}, dt)),
                        permute(contiguous(permute(rnd(g, {2, 4, 5}, dt), {1, 2, 0})), {2, 0, 1})},
                       "non-contiguous and permuted"}};
           },
           .torch = "torch.cat([x0, x1, x2], 1)"},
    // A broadcast (stride-0) operand: the expand happens inside fn so gradcheck perturbs real elements.
    OpInfo{.name = "cat_expanded",
           .fn = [](const V& x) { return cat({expand(x[0], {2, 3, 4}), x[1]}, 1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {2, 1, 4}, dt), rnd(g, {2, 2, 4}, dt)}, "expand dim 1"},
                      {{rnd(g, {4}, dt), noncontig(rnd(g, {2, 3, 4}, dt))}, "expand leading dims"}};
           },
           .torch = "torch.cat([x0.expand(2, 3, 4), x1], 1)"},
    OpInfo{.name = "stack_dim0",
           .fn = [](const V& x) { return stack({x[0], x[1]}, 0); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {3, 5}, dt), noncontig(rnd(g, {3, 5}, dt))}, "3x5 mixed layout"},
                      {{rnd(g, {}, dt), rnd(g, {}, dt)}, "0-d"}};
           },
           .torch = "torch.stack([x0, x1], 0)"},
    OpInfo{.name = "stack_middle_three",
           .fn = [](const V& x) { return stack({x[0], x[1], x[2]}, 1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {3, 4}, dt), rnd(g, {3, 4}, dt), noncontig(rnd(g, {3, 4}, dt))}, "3x4"}};
           },
           .torch = "torch.stack([x0, x1, x2], 1)"},
    OpInfo{.name = "stack_last",
           .fn = [](const V& x) { return stack({x[0], x[1]}, -1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{noncontig(rnd(g, {2, 3}, dt)), rnd(g, {2, 3}, dt)}, "2x3"},
                      {{rnd(g, {1}, dt), rnd(g, {1}, dt)}, "1-element"}};
           },
           .torch = "torch.stack([x0, x1], -1)"},
    OpInfo{.name = "split_size_dim0",
           .fn = [](const V& x) { return weighted_piece_sum(split(x[0], 3, 0), 0); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {7, 3}, dt)}, "7x3 (last piece smaller)"},
                      {{noncontig(rnd(g, {6, 5}, dt))}, "non-contiguous, even"},
                      {{rnd(g, {2, 4}, dt)}, "one piece"}};
           },
           .torch = weighted_expr("x0.split(3, 0)", 0)},
    OpInfo{.name = "split_size_last",
           .fn = [](const V& x) { return weighted_piece_sum(split(x[0], 2, -1), -1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{noncontig(rnd(g, {3, 5}, dt))}, "non-contiguous 3x5"}, {{rnd(g, {1}, dt)}, "1-element"}};
           },
           .torch = weighted_expr("x0.split(2, -1)", -1)},
    OpInfo{.name = "split_sizes",
           .fn = [](const V& x) { return weighted_piece_sum(split(x[0], std::vector<int64_t>{2, 0, 4, 3}, 1), 1); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {3, 9}, dt)}, "3x9"}, {{noncontig(rnd(g, {2, 9, 3}, dt))}, "non-contiguous 2x9x3"}};
           },
           .torch = weighted_expr("x0.split([2, 0, 4, 3], 1)", 1)},
    OpInfo{.name = "chunk",
           .fn = [](const V& x) { return weighted_piece_sum(chunk(x[0], 4, 0), 0); },
           .samples = [](DType dt, Generator& g) {
             return S{{{rnd(g, {10, 3}, dt)}, "10 in 4 (3,3,3,1)"},
                      {{noncontig(rnd(g, {6, 2}, dt))}, "6 in 4 gives 3 pieces"},
                      {{rnd(g, {3}, dt)}, "3 in 4 gives 3 pieces"}};
           },
           .torch = weighted_expr("x0.chunk(4, 0)", 0)},
    // Split then cat back in another order: a permutation of row blocks.
    OpInfo{.name = "split_cat_roundtrip",
           .fn = [](const V& x) {
             V p = split(x[0], 2, 1);
             return cat({p[2], p[0], p[1]}, 1);
           },
           .samples = [](DType dt, Generator& g) { return S{{{noncontig(rnd(g, {3, 5}, dt))}, "3x5"}}; },
           .torch = "(lambda p: torch.cat([p[2], p[0], p[1]], 1))(x0.split(2, 1))"});

}  // namespace
}  // namespace blu::test
