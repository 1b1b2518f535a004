// OpInfo entries for ops/nn. Class ids and indices are i64 (or i32) inputs: sent to PyTorch as
// they are, never differentiated. Dropout cannot share PyTorch's RNG, so its samples carry the
// mask (dropout of ones under the same seed) as a second input and the oracle is x0 * x1.
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;

Tensor ids(const std::vector<double>& v, const Shape& shape, DType dt = DType::i64) { return from_vector(v, shape, dt); }

// --- softmax / log_softmax ---
std::vector<Sample> softmax_samples(DType dt, Generator& g) {
  return {{{rnd(g, {3, 4, 5}, dt)}, "3x4x5"}, {{noncontig(rnd(g, {2, 5, 3}, dt))}, "non-contiguous 2x5x3"}};
}
std::vector<Sample> softmax_1d_samples(DType dt, Generator& g) {
  return {{{rnd(g, {}, dt)}, "0-d"}, {{rnd(g, {1}, dt)}, "1 element"}, {{rnd(g, {7}, dt)}, "7"},
          {{noncontig(rnd(g, {6}, dt))}, "non-contiguous 6"}};
}
#define SOFTMAX(NAME, CALL, TORCH, SAMPLES) \
  OpInfo { .name = NAME, .fn = [](const V& x) { return CALL; }, .samples = SAMPLES, .torch = TORCH }

BLU_OPINFO(SOFTMAX("softmax_dim0", softmax(x[0], 0), "torch.softmax(x0, 0)", softmax_samples),
           SOFTMAX("softmax_dim_mid", softmax(x[0], 1), "torch.softmax(x0, 1)", softmax_samples),
           SOFTMAX("softmax_dim_last", softmax(x[0], -1), "torch.softmax(x0, -1)", softmax_samples),
           SOFTMAX("softmax_1d", softmax(x[0], 0), "torch.softmax(x0, 0)", softmax_1d_samples),
           SOFTMAX("log_softmax_dim0", log_softmax(x[0], 0), "torch.log_softmax(x0, 0)", softmax_samples),
           SOFTMAX("log_softmax_dim_mid", log_softmax(x[0], 1), "torch.log_softmax(x0, 1)", softmax_samples),
           SOFTMAX("log_softmax_dim_last", log_softmax(x[0], -1), "torch.log_softmax(x0, -1)", softmax_samples),
           SOFTMAX("log_softmax_1d", log_softmax(x[0], -1), "torch.log_softmax(x0, -1)", softmax_1d_samples));

// --- cross_entropy ---
std::vector<Sample> ce_samples(DType dt, Generator& g) {
  return {{{rnd(g, {5, 7}, dt), ids({3, 0, -100, 6, 2}, {5})}, "5x7 with an ignored row"},
          {{rnd(g, {1, 4}, dt), ids({2}, {1})}, "1 row"},
          {{noncontig(rnd(g, {6, 3}, dt)), ids({0, 2, 1, 1, -100, 0}, {6})}, "non-contiguous 6x3"},
          {{rnd(g, {4, 9}, dt), ids({8, 0, 4, 4}, {4}, DType::i32)}, "i32 target"},
          {{rnd(g, {5}, dt), ids({3}, {})}, "[C] logits, 0-d target"}};
}
#define CE(NAME, CALL, TORCH) \
  OpInfo { .name = NAME, .fn = [](const V& x) { return CALL; }, .samples = ce_samples, .torch = TORCH }

BLU_OPINFO(CE("cross_entropy_mean", cross_entropy(x[0], x[1]), "F.cross_entropy(x0, x1.long())"),
           CE("cross_entropy_sum", cross_entropy(x[0], x[1], -100, Reduction::sum),
              "F.cross_entropy(x0, x1.long(), reduction='sum')"),
           CE("cross_entropy_none", cross_entropy(x[0], x[1], -100, Reduction::none),
              "F.cross_entropy(x0, x1.long(), reduction='none')"),
           // ignore_index 1: rows whose target is 1 drop out of the sum and of the mean's count.
           OpInfo{.name = "cross_entropy_custom_ignore_mean",
                  .fn = [](const V& x) { return cross_entropy(x[0], x[1], 1); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {6, 5}, dt), ids({1, 4, 1, 0, 3, 2}, {6})}, "6x5, two ignored"}};
                  },
                  .torch = "F.cross_entropy(x0, x1.long(), ignore_index=1)"},
           OpInfo{.name = "cross_entropy_custom_ignore_sum",
                  .fn = [](const V& x) { return cross_entropy(x[0], x[1], 1, Reduction::sum); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{{{rnd(g, {6, 5}, dt), ids({1, 4, 1, 0, 3, 2}, {6})}, "6x5, two ignored"},
                                               {{rnd(g, {3}, dt), ids({1}, {})}, "[C], the one target ignored"}};
                  },
                  .torch = "F.cross_entropy(x0, x1.long(), ignore_index=1, reduction='sum')"});

// num_classes K < C: only the first K columns are classes (GPT-2's padded vocabulary); the oracle
// narrows the logits, so PyTorch's gradient of the columns ≥ K is exactly 0, as ours must be.
std::vector<Sample> ce_classes_samples(DType dt, Generator& g) {
  return {{{rnd(g, {5, 7}, dt), ids({3, 0, -100, 4, 2}, {5})}, "5x7, 5 classes, an ignored row"},
          {{rnd(g, {4, 9}, dt), ids({0, 4, 4, 1}, {4}, DType::i32)}, "4x9, 5 classes, i32 target"},
          {{noncontig(rnd(g, {6, 8}, dt)), ids({0, 4, 1, 3, -100, 2}, {6})}, "non-contiguous 6x8, 5 classes"},
          {{rnd(g, {8}, dt), ids({4}, {})}, "[C] logits, 5 classes, 0-d target"}};
}
std::vector<Sample> ce_all_classes_samples(DType dt, Generator& g) {
  return {{{rnd(g, {5, 7}, dt), ids({3, 0, 6, 6, 2}, {5})}, "5x7, 7 classes"}};
}
std::vector<Sample> ce_one_class_samples(DType dt, Generator& g) {
  return {{{rnd(g, {3, 4}, dt), ids({0, 0, -100}, {3})}, "3x4, 1 class"}};
}
#define CE_K(NAME, CALL, TORCH, SAMPLES) \
  OpInfo { .name = NAME, .fn = [](const V& x) { return CALL; }, .samples = SAMPLES, .torch = TORCH }

BLU_OPINFO(CE_K("cross_entropy_classes_mean", cross_entropy(x[0], x[1], -100, Reduction::mean, 5),
                "F.cross_entropy(x0[..., :5], x1.long())", ce_classes_samples),
           CE_K("cross_entropy_classes_sum", cross_entropy(x[0], x[1], -100, Reduction::sum, 5),
                "F.cross_entropy(x0[..., :5], x1.long(), reduction='sum')", ce_classes_samples),
           CE_K("cross_entropy_classes_none", cross_entropy(x[0], x[1], -100, Reduction::none, 5),
                "F.cross_entropy(x0[..., :5], x1.long(), reduction='none')", ce_classes_samples),
           CE_K("cross_entropy_classes_all", cross_entropy(x[0], x[1], -100, Reduction::mean, 7),
                "F.cross_entropy(x0, x1.long())", ce_all_classes_samples),
           CE_K("cross_entropy_classes_one", cross_entropy(x[0], x[1], -100, Reduction::sum, 1),
                "F.cross_entropy(x0[..., :1], x1.long(), reduction='sum')", ce_one_class_samples));

// --- linear_cross_entropy (ops/fused.h, Note [Chunked loss]) ---
// The head and its loss in row pieces against the whole logits in PyTorch: pieces that split the
// rows evenly and unevenly, more pieces than rows, padded classes (GPT-2's vocabulary), ignored
// rows, an i32 target; the gradient the op table sends back is not 1, so the backward's scaling
// of the forward-made gradients is checked too.
std::vector<Sample> lce_samples(DType dt, Generator& g) {
  return {{{rnd(g, {6, 4}, dt), rnd(g, {9, 4}, dt), ids({3, 0, -1, 8, 2, 4}, {6})}, "6 rows, 9 classes, an ignored row"},
          {{rnd(g, {7, 5}, dt), rnd(g, {6, 5}, dt), ids({0, 5, 4, 1, 3, -1, 2}, {7}, DType::i32)},
           "7 rows, 6 classes, i32 target"},
          {{rnd(g, {2, 3}, dt), noncontig(rnd(g, {4, 3}, dt)), ids({1, 3}, {2})}, "2 rows, non-contiguous weight"}};
}
std::vector<Sample> lce_classes_samples(DType dt, Generator& g) {
  return {{{rnd(g, {7, 5}, dt), rnd(g, {9, 5}, dt), ids({0, 4, 4, 1, 3, -1, 2}, {7}, DType::i32)},
           "7 rows, 5 of 9 classes, i32 target"}};
}
#define LCE(NAME, CHUNKS, K, SAMPLES, TORCH)                                                              \
  OpInfo {                                                                                                \
    .name = NAME, .fn = [](const V& x) { return linear_cross_entropy(x[0], x[1], x[2], -1, K, CHUNKS); }, \
    .samples = SAMPLES, .torch = TORCH                                                                    \
  }
#define LCE_TORCH "F.cross_entropy(F.linear(x0, x1), x2.long(), ignore_index=-1)"
BLU_OPINFO(LCE("linear_cross_entropy_1_piece", 1, -1, lce_samples, LCE_TORCH),
           LCE("linear_cross_entropy_3_pieces", 3, -1, lce_samples, LCE_TORCH),
           LCE("linear_cross_entropy_8_pieces", 8, -1, lce_samples, LCE_TORCH),
           LCE("linear_cross_entropy_classes", 2, 5, lce_classes_samples,
               "F.cross_entropy(F.linear(x0, x1)[..., :5], x2.long(), ignore_index=-1)"));

// --- layer_norm ---
// (C == 1 is degenerate — the output is the bias — and tested in nn_test.cpp: PyTorch's f32
// gradient there is rounding noise, not a reference.)
std::vector<Sample> ln_samples(DType dt, Generator& g, bool weight, bool bias) {
  auto params = [&](int64_t c) {
    return std::pair{weight ? rnd(g, {c}, dt) : Tensor(), bias ? rnd(g, {c}, dt) : Tensor()};
  };
  std::vector<Sample> out;
  for (const Shape& s : std::vector<Shape>{{4, 7}, {2, 3, 5}, {6}, {1, 3}}) {
    Tensor x = rnd(g, s, dt);
    auto [w, b] = params(s.back());
    out.push_back({{x, w, b}, to_string(s)});
  }
  Tensor x = noncontig(rnd(g, {5, 4}, dt));
  auto [w, b] = params(4);
  out.push_back({{x, w, b.defined() ? noncontig(b) : b}, "non-contiguous 5x4"});
  return out;
}
#define LN(NAME, W, B, EPS, EPS_PY)                                                                        \
  OpInfo {                                                                                                \
    .name = NAME, .fn = [](const V& x) { return layer_norm(x[0], x[1], x[2], EPS); },                     \
    .samples = [](DType dt, Generator& g) { return ln_samples(dt, g, W, B); },                           \
    .torch = "F.layer_norm(x0, x0.shape[-1:], x1, x2, eps=" EPS_PY ")"                                  \
  }

BLU_OPINFO(LN("layer_norm", true, true, 1e-5, "1e-5"),
           LN("layer_norm_no_affine", false, false, 1e-5, "1e-5"),
           LN("layer_norm_weight_only", true, false, 1e-5, "1e-5"),
           LN("layer_norm_bias_only_eps", false, true, 0.1, "0.1"));

// --- embedding ---
BLU_OPINFO(OpInfo{.name = "embedding",
                  .fn = [](const V& x) { return embedding(x[0], x[1]); },
                  .samples = [](DType dt, Generator& g) {
                    return std::vector<Sample>{
                        {{rnd(g, {7, 4}, dt), ids({1, 3, 1, 6, 0, 1}, {6})}, "repeated indices"},
                        {{rnd(g, {5, 3}, dt), ids({4, 4, 0, 2, 4, 1}, {2, 3})}, "2-D indices"},
                        {{noncontig(rnd(g, {6, 5}, dt)), ids({5, 0, 5}, {3}, DType::i32)}, "non-contiguous weight, i32"},
                        {{rnd(g, {3, 2}, dt), ids({2}, {})}, "0-d index"}};
                  },
                  .torch = "F.embedding(x1.long(), x0)"});

// --- dropout ---
// fn re-seeds a local generator, so every call (gradcheck evaluates many) draws the same mask.
constexpr uint64_t kDropSeed = 42;
constexpr double kDropP = 0.3;
Tensor seeded_dropout(const Tensor& x) {
  Generator gen(kDropSeed);
  return dropout(x, kDropP, true, &gen);
}
BLU_OPINFO(OpInfo{.name = "dropout",
                  .fn = [](const V& x) { return seeded_dropout(x[0]); },
                  .samples = [](DType dt, Generator& g) {
                    auto with_mask = [&](Tensor x, const std::string& desc) {
                      NoGradGuard ng;
                      return Sample{{x, seeded_dropout(ones(x.shape(), dt))}, desc};
                    };
                    return std::vector<Sample>{with_mask(rnd(g, {5, 7}, dt), "5x7"),
                                               with_mask(noncontig(rnd(g, {4, 6}, dt)), "non-contiguous 4x6"),
                                               with_mask(rnd(g, {}, dt), "0-d")};
                  },
                  .torch = "x0 * x1",
                  .no_grad_inputs = {1}});

}  // namespace
}  // namespace blu::test
