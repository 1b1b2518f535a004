// OpInfo entries for ops/attention: scaled dot-product attention, causal and not, against
// torch's F.scaled_dot_product_attention where it exists (PyTorch >= 2.0) and otherwise the same
// computation written out (PyTorch 1.13, the CPU oracle, has no fused function).
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;
using S = std::vector<Sample>;

// The explicit form; the causal mask is tril(ones(Tq, Tk)) aligned top-left, as is_causal=True.
std::string torch_sdpa(bool causal, const std::string& scale) {
  std::string scores = "(x0 @ x1.transpose(-2, -1)) * " + scale;
  if (causal)
    scores = "(" + scores +
             ").masked_fill(torch.ones(x0.shape[-2], x1.shape[-2], dtype=torch.bool).triu(1), float('-inf'))";
  return "torch.softmax(" + scores + ", -1) @ x2";
}
std::string torch_expr(bool causal, const std::string& scale = "") {
  const std::string explicit_form = torch_sdpa(causal, scale.empty() ? "x0.shape[-1] ** -0.5" : scale);
  if (!scale.empty()) return explicit_form;  // the fused function's `scale` argument is PyTorch >= 2.1
  return "(F.scaled_dot_product_attention(x0, x1, x2, is_causal=" + std::string(causal ? "True" : "False") +
         ") if hasattr(F, 'scaled_dot_product_attention') else " + explicit_form + ")";
}

S attention_samples(DType dt, Generator& g) {
  return S{{{rnd(g, {2, 4, 3}, dt), rnd(g, {2, 4, 3}, dt), rnd(g, {2, 4, 5}, dt)}, "B2 Tq=Tk=4 D3 Dv5"},
           {{rnd(g, {3, 5}, dt), rnd(g, {7, 5}, dt), rnd(g, {7, 2}, dt)}, "2-d Tq3 < Tk7"},
           {{rnd(g, {2, 5, 3}, dt), rnd(g, {2, 2, 3}, dt), rnd(g, {2, 2, 3}, dt)}, "Tq5 > Tk2"},
           {{noncontig(rnd(g, {2, 3, 4}, dt)), noncontig(rnd(g, {2, 3, 4}, dt)), noncontig(rnd(g, {2, 3, 4}, dt))},
            "non-contiguous"},
           {{rnd(g, {2, 1, 3, 4}, dt), rnd(g, {1, 2, 3, 4}, dt), rnd(g, {2, 2, 3, 1}, dt)}, "broadcast batch, Dv1"},
           {{rnd(g, {1, 1}, dt), rnd(g, {1, 1}, dt), rnd(g, {1, 1}, dt)}, "1 token"}};
}

BLU_OPINFO(OpInfo{.name = "sdpa_causal",
                  .fn = [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); },
                  .samples = attention_samples,
                  .torch = torch_expr(true)},
           OpInfo{.name = "sdpa_full",
                  .fn = [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], false); },
                  .samples = attention_samples,
                  .torch = torch_expr(false)},
           OpInfo{.name = "sdpa_causal_scale",
                  .fn = [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true, 0.3); },
                  .samples = [](DType dt, Generator& g) {
                    return S{{{rnd(g, {2, 4, 3}, dt), rnd(g, {2, 6, 3}, dt), noncontig(rnd(g, {2, 6, 2}, dt))},
                              "Tq4 Tk6"}};
                  },
                  .torch = torch_expr(true, "0.3")});

}  // namespace
}  // namespace blu::test
