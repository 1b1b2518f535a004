// OpInfo entries for ops/attention: scaled dot-product attention, causal and not, against
// torch's F.scaled_dot_product_attention where it exists (PyTorch >= 2.0) and otherwise the same
// computation written out (PyTorch 1.13, the CPU oracle, has no fused function). Grouped-query
// attention (k, v with fewer heads than q) against the same expression on k and v repeated with
// repeat_interleave over dim -3 (what enable_gqa=True means; 1.13 has no enable_gqa), and its
// shape errors; rotary_attention (RoPE, then attention, on one projection's heads) likewise.
#include <gtest/gtest.h>

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

// GQA: each query head h attends with key/value head h / (H / Hkv).
std::string torch_gqa_expr(bool causal) {
  return "(lambda x1, x2: " + torch_expr(causal) +
         ")(x1.repeat_interleave(x0.shape[-3] // x1.shape[-3], -3), x2.repeat_interleave(x0.shape[-3] // "
         "x2.shape[-3], -3))";
}

// (H, Hkv) = (6, 2), (9, 3), (3, 1), (4, 2); T not a power of two; a rank-3 call, Tq != Tk,
// non-contiguous operands. In f32 also a head dim of 64, which the fused CUDA kernels take (the
// CUDA-vs-CPU comparison of the table then runs them with GQA); f64 (gradcheck) keeps to small D.
S gqa_samples(DType dt, Generator& g) {
  S s{{{rnd(g, {2, 6, 5, 3}, dt), rnd(g, {2, 2, 5, 3}, dt), rnd(g, {2, 2, 5, 4}, dt)}, "H6 Hkv2 T5 D3 Dv4"},
      {{rnd(g, {1, 9, 7, 4}, dt), rnd(g, {1, 3, 7, 4}, dt), rnd(g, {1, 3, 7, 4}, dt)}, "H9 Hkv3 T7"},
      {{rnd(g, {2, 3, 6, 3}, dt), rnd(g, {2, 1, 6, 3}, dt), rnd(g, {2, 1, 6, 3}, dt)}, "H3 Hkv1 T6"},
      {{rnd(g, {4, 5, 3}, dt), rnd(g, {2, 5, 3}, dt), rnd(g, {2, 5, 2}, dt)}, "rank 3, H4 Hkv2"},
      {{rnd(g, {2, 4, 3, 3}, dt), rnd(g, {2, 2, 7, 3}, dt), rnd(g, {2, 2, 7, 3}, dt)}, "H4 Hkv2 Tq3 < Tk7"},
      {{noncontig(rnd(g, {1, 6, 5, 4}, dt)), noncontig(rnd(g, {1, 3, 5, 4}, dt)), noncontig(rnd(g, {1, 3, 5, 4}, dt))},
       "non-contiguous H6 Hkv3"}};
  if (dt == DType::f32)
    s.push_back({{rnd(g, {2, 6, 37, 64}, dt), rnd(g, {2, 2, 37, 64}, dt), rnd(g, {2, 2, 37, 64}, dt)},
                 "H6 Hkv2 T37 D64"});
  return s;
}

BLU_OPINFO(OpInfo{.name = "sdpa_gqa_causal",
                  .fn = [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], true); },
                  .samples = gqa_samples,
                  .torch = torch_gqa_expr(true)},
           OpInfo{.name = "sdpa_gqa_full",
                  .fn = [](const V& x) { return scaled_dot_product_attention(x[0], x[1], x[2], false); },
                  .samples = gqa_samples,
                  .torch = torch_gqa_expr(false)});

// GQA's shape errors name what was expected and what came.
TEST(AttentionGqa, ShapeErrors) {
  Generator g(1);
  auto err = [](const Tensor& q, const Tensor& k, const Tensor& v) -> std::string {
    try {
      scaled_dot_product_attention(q, k, v, true);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  const Tensor q = rnd(g, {2, 6, 5, 8}, DType::f32);
  const std::string not_multiple = err(q, rnd(g, {2, 4, 5, 8}, DType::f32), rnd(g, {2, 4, 5, 8}, DType::f32));
  EXPECT_NE(not_multiple.find("multiple of the key/value heads"), std::string::npos) << not_multiple;
  EXPECT_NE(not_multiple.find("[2, 4, 5, 8] (4 heads)"), std::string::npos) << not_multiple;
  const std::string kv_heads = err(q, rnd(g, {2, 2, 5, 8}, DType::f32), rnd(g, {2, 3, 5, 8}, DType::f32));
  EXPECT_NE(kv_heads.find("k and v with the same number of heads"), std::string::npos) << kv_heads;
  const std::string batch = err(q, rnd(g, {1, 2, 5, 8}, DType::f32), rnd(g, {1, 2, 5, 8}, DType::f32));
  EXPECT_NE(batch.find("batch dims of q, k, v equal"), std::string::npos) << batch;
  const std::string head_dim = err(q, rnd(g, {2, 2, 5, 4}, DType::f32), rnd(g, {2, 2, 5, 8}, DType::f32));
  EXPECT_NE(head_dim.find("head dims differ"), std::string::npos) << head_dim;
  // One key/value head is broadcasting (multi-query attention), not an error.
  EXPECT_EQ(err(q, rnd(g, {2, 1, 5, 8}, DType::f32), rnd(g, {2, 1, 5, 8}, DType::f32)), "");
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

// --- rotary_attention: RoPE on a fused projection's q and k heads, then attention ---
// qkv [B, T, H + 2·Hkv, D], cos/sin [T, D] (random values, not a rotation table, as the
// rotary_embedding entries; not differentiated). The oracle rotates the first H + Hkv heads as
// those entries write it out and attends with the GQA expression above. In f32 also D = 64 with
// f32 tables, which the CUDA side of the table runs through the fused node.
std::string torch_rotary_attention(int64_t H, int64_t Hkv) {
  const std::string n = std::to_string(H + Hkv), h = std::to_string(H);
  const std::string r = "torch.cat([x0[:, :, :" + n + "] * x1[:, None, :] + torch.cat([-x0[:, :, :" + n +
                        ", x0.shape[-1] // 2:], x0[:, :, :" + n + ", :x0.shape[-1] // 2]], -1) * x2[:, None, :], x0[:, :, " +
                        n + ":]], 2)";
  return "(lambda r: (lambda x0, x1, x2: " + torch_gqa_expr(true) + ")(r[:, :, :" + h + "].transpose(1, 2), r[:, :, " +
         h + ":" + n + "].transpose(1, 2), r[:, :, " + n + ":].transpose(1, 2)))(" + r + ")";
}
Sample rope_qkv(Generator& g, const Shape& shape, DType dt, DType cs, const std::string& desc) {
  return Sample{{rnd(g, shape, dt), rnd(g, {shape[1], shape[3]}, cs), rnd(g, {shape[1], shape[3]}, cs)}, desc};
}
BLU_OPINFO(OpInfo{.name = "rotary_attention (H2 Hkv1)",
                  .fn = [](const V& x) { return rotary_attention(x[0], x[1], x[2], 2, 1); },
                  .samples = [](DType dt, Generator& g) {
                    return S{rope_qkv(g, {2, 5, 4, 4}, dt, dt, "B2 T5 D4"), rope_qkv(g, {1, 3, 4, 6}, dt, dt, "T3 D6")};
                  },
                  .torch = torch_rotary_attention(2, 1),
                  .no_grad_inputs = {1, 2}},
           OpInfo{.name = "rotary_attention (H4 Hkv2)",
                  .fn = [](const V& x) { return rotary_attention(x[0], x[1], x[2], 4, 2); },
                  .samples = [](DType dt, Generator& g) {
                    S s{rope_qkv(g, {1, 6, 8, 4}, dt, dt, "T6 D4")};
                    if (dt == DType::f32) s.push_back(rope_qkv(g, {2, 37, 8, 64}, dt, DType::f32, "T37 D64, f32 tables"));
                    return s;
                  },
                  .torch = torch_rotary_attention(4, 2),
                  .no_grad_inputs = {1, 2}},
           OpInfo{.name = "rotary_attention (H3 Hkv3)",
                  .fn = [](const V& x) { return rotary_attention(x[0], x[1], x[2], 3, 3); },
                  .samples = [](DType dt, Generator& g) { return S{rope_qkv(g, {2, 4, 9, 4}, dt, dt, "B2 T4 D4")}; },
                  .torch = torch_rotary_attention(3, 3),
                  .no_grad_inputs = {1, 2}});

// rotary_attention names a qkv that does not hold H + 2·Hkv heads.
TEST(RotaryAttention, ShapeErrors) {
  Generator g(2);
  const Tensor cs = rnd(g, {5, 4}, DType::f32);
  try {
    rotary_attention(rnd(g, {1, 5, 5, 4}, DType::f32), cs, cs, 2, 2);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("expected qkv [B, T, 2 + 2·2, D]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1, 5, 5, 4]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace blu::test
