// OpInfo entries for the Llama family's ops (ops/norm_rotary.cpp, ops/swiglu.cpp): rms_norm,
// rotary_embedding, silu, swiglu. PyTorch 1.13 (the CPU oracle) has neither F.rms_norm nor a
// rotary function, so the oracle expressions write them out in torch terms. cos and sin are
// random values (not a rotation table), so the oracle also checks which of cos[j] and cos[j + D/2]
// each term reads; they are not differentiated (rotary_embedding is differentiable in x only).
#include "common/opinfo.h"

namespace blu::test {
namespace {

using V = std::vector<Tensor>;
using S = std::vector<Sample>;

// --- rms_norm ---
// (C == 1 is left out as for layer_norm: y is ±w there, and PyTorch's f32 gradient is rounding noise.)
S rms_samples(DType dt, Generator& g, bool weight) {
  auto w = [&](int64_t c) { return weight ? rnd(g, {c}, dt) : Tensor(); };
  S out;
  for (const Shape& s : std::vector<Shape>{{4, 7}, {2, 3, 5}, {6}, {1, 3}, {3, 33}}) {
    Tensor x = rnd(g, s, dt);
    out.push_back({{x, w(s.back())}, to_string(s)});
  }
  Tensor x = noncontig(rnd(g, {5, 4}, dt));
  Tensor wt = w(4);
  out.push_back({{x, wt.defined() ? noncontig(wt) : wt}, "non-contiguous 5x4"});
  return out;
}
constexpr const char* kTorchRms = "x0 * torch.rsqrt(x0.pow(2).mean(-1, keepdim=True) + {eps})";
std::string torch_rms(bool weight, const std::string& eps) {
  std::string e = kTorchRms;
  e.replace(e.find("{eps}"), 5, eps);
  return weight ? "x1 * (" + e + ")" : e;
}

BLU_OPINFO(OpInfo{.name = "rms_norm",
                  .fn = [](const V& x) { return rms_norm(x[0], x[1]); },
                  .samples = [](DType dt, Generator& g) { return rms_samples(dt, g, true); },
                  .torch = torch_rms(true, "1e-5")},
           OpInfo{.name = "rms_norm_no_weight",
                  .fn = [](const V& x) { return rms_norm(x[0], x[1]); },
                  .samples = [](DType dt, Generator& g) { return rms_samples(dt, g, false); },
                  .torch = torch_rms(false, "1e-5")},
           OpInfo{.name = "rms_norm_eps",
                  .fn = [](const V& x) { return rms_norm(x[0], x[1], 0.1); },
                  .samples = [](DType dt, Generator& g) {
                    return S{{{mul(rnd(g, {3, 6}, dt), 0.3), rnd(g, {6}, dt)}, "3x6, small values"}};
                  },
                  .torch = torch_rms(true, "0.1")});

// --- rotary_embedding ---
// x [B, T, H, D], cos/sin [T, D]. The oracle broadcasts cos/sin over B and H.
Sample rope(Generator& g, Tensor x, DType cs, const std::string& desc) {
  const int64_t T = x.size(1), D = x.size(3);
  return Sample{{x, rnd(g, {T, D}, cs), rnd(g, {T, D}, cs)}, desc};
}
S rope_samples(DType dt, Generator& g) {
  // Heads 1 and 2 of a [2, 3, 5, 4] buffer: the strided q/k slice of a fused qkv projection.
  Tensor qkv = rnd(g, {2, 3, 5, 4}, dt);
  S out{rope(g, rnd(g, {2, 3, 2, 4}, dt), dt, "2x3x2x4"),
        rope(g, rnd(g, {1, 5, 3, 6}, dt), dt, "1x5x3x6, odd half"),
        rope(g, rnd(g, {2, 1, 1, 2}, dt), dt, "D2"),
        rope(g, rnd(g, {1, 2, 2, 16}, dt), dt, "D16"),
        rope(g, noncontig(rnd(g, {2, 2, 3, 4}, dt)), dt, "non-contiguous x"),
        rope(g, narrow(qkv, 2, 1, 2), dt, "head slice of a qkv buffer"),
        rope(g, rnd(g, {2, 3, 2, 8}, dt), DType::f32, "f32 cos/sin")};
  Sample nc = rope(g, rnd(g, {1, 4, 2, 6}, dt), dt, "non-contiguous cos/sin");
  nc.inputs[1] = noncontig(nc.inputs[1]);
  nc.inputs[2] = noncontig(nc.inputs[2]);
  out.push_back(nc);
  return out;
}
BLU_OPINFO(OpInfo{.name = "rotary_embedding",
                  .fn = [](const V& x) { return rotary_embedding(x[0], x[1], x[2]); },
                  .samples = rope_samples,
                  .torch = "x0 * x1[:, None, :] + torch.cat([-x0[..., x0.shape[-1] // 2:], "
                           "x0[..., :x0.shape[-1] // 2]], -1) * x2[:, None, :]",
                  .no_grad_inputs = {1, 2}});

// Only the first two heads rotated, the rest copied (a GQA model's packed q/k/v with v last).
S rope_partial_samples(DType dt, Generator& g) {
  return S{rope(g, rnd(g, {2, 3, 4, 4}, dt), dt, "2x3x4x4, heads 2 and 3 copied"),
           rope(g, rnd(g, {1, 2, 2, 6}, dt), dt, "1x2x2x6, every head rotated"),
           rope(g, narrow(rnd(g, {2, 3, 5, 4}, dt), 2, 1, 3), DType::f32, "head slice, f32 cos/sin")};
}
BLU_OPINFO(OpInfo{.name = "rotary_embedding (rotate 2)",
                  .fn = [](const V& x) { return rotary_embedding(x[0], x[1], x[2], 2); },
                  .samples = rope_partial_samples,
                  .torch = "torch.cat([x0[:, :, :2] * x1[:, None, :] + torch.cat([-x0[:, :, :2, x0.shape[-1] // 2:], "
                           "x0[:, :, :2, :x0.shape[-1] // 2]], -1) * x2[:, None, :], x0[:, :, 2:]], 2)",
                  .no_grad_inputs = {1, 2}});

// --- silu / swiglu ---
S silu_samples(DType dt, Generator& g) {
  return S{{{rnd(g, {3, 4, 5}, dt)}, "3x4x5"},
           {{noncontig(rnd(g, {2, 5, 3}, dt))}, "non-contiguous 2x5x3"},
           {{rnd(g, {7}, dt)}, "7"},
           {{rnd(g, {}, dt)}, "0-d"}};
}
S swiglu_samples(DType dt, Generator& g) {
  // The halves of one [.., 2I] projection: views, side by side (the backward joins their
  // gradients), and the same halves in the other order (not joined).
  Tensor h = rnd(g, {3, 2, 10}, dt);
  Tensor h2 = rnd(g, {4, 6}, dt);
  return S{{{rnd(g, {4, 6}, dt), rnd(g, {4, 6}, dt)}, "4x6"},
           {{rnd(g, {2, 3, 5}, dt), rnd(g, {2, 3, 5}, dt)}, "2x3x5"},
           {{rnd(g, {}, dt), rnd(g, {}, dt)}, "0-d"},
           {{noncontig(rnd(g, {3, 4}, dt)), noncontig(rnd(g, {3, 4}, dt))}, "non-contiguous"},
           {{narrow(h, -1, 0, 5), narrow(h, -1, 5, 5)}, "halves of one 3x2x10 buffer"},
           {{narrow(h2, -1, 3, 3), narrow(h2, -1, 0, 3)}, "halves of one 4x6 buffer, swapped"},
           {{rnd(g, {5, 1}, dt), rnd(g, {5, 1}, dt)}, "I = 1"}};
}
BLU_OPINFO(OpInfo{.name = "silu", .fn = [](const V& x) { return silu(x[0]); }, .samples = silu_samples,
                  .torch = "F.silu(x0)"},
           OpInfo{.name = "swiglu",
                  .fn = [](const V& x) { return swiglu(x[0], x[1]); },
                  .samples = swiglu_samples,
                  .torch = "F.silu(x0) * x1"});

}  // namespace
}  // namespace blu::test
