// CPU kernels for ops/optim: one pass over each parameter doing its whole optimizer update (AdamW
// also writing the parameter's compute copy when given one; with a norm gate, the gradient
// clipped or the update skipped: Note [Norm gate], ops/optim.h), and the gradients' sum of
// squares for clip_grad_norm. AdamW's moments are f32, or bf16 widened for the arithmetic and stored
// rounded stochastically (Note [Stochastic bf16 moments], core/round_stochastic.h).
// fp32 arithmetic in the order of torch.optim's single-tensor code (each PyTorch op rounds to
// fp32 once; so does each step here), the scalar coefficients computed in double as Python does.
#include <cmath>
#include <type_traits>

#include "blu/backend/backend.h"
#include "blu/backend/cpu/loops.h"
#include "blu/core/round_stochastic.h"
#include "blu/core/split_f32.h"

namespace blu::cpu {

namespace {

// What a norm gate decides (Note [Norm gate]): skip the update, or use each gradient element g
// as g * coef (one fp32 product, as the mul_scalar_ kernel rounds it) when clip is set.
struct GateDecision {
  bool skip = false, clip = false;
  float coef = 1;
};
GateDecision read_gate(const KernelCall& c) {
  const int64_t index = c.attrs.i("gate");
  if (index < 0) return {};
  const Tensor& t = c.in[size_t(index)];
  const double total = t.dtype() == DType::f64 ? *t.data<double>() : double(*t.data<float>());
  const double norm = std::sqrt(total);
  if (!std::isfinite(norm)) return {.skip = true};
  const double coef = c.attrs.f("max_norm") / (norm + 1e-6);
  return {.skip = false, .clip = coef < 1.0, .coef = float(coef)};
}

// PyTorch passes these Python floats to fp32 tensor ops, which round them to float. key_m, key_v:
// bf16 moments' rounding keys for this step (Note [Stochastic bf16 moments]).
struct AdamWCoef {
  float decay, b1, b2, one_m_b1, one_m_b2, bc2_sqrt, eps, neg_step_size;
  uint32_t key_m, key_v;
};
// One element's update in torch.optim.AdamW's order, each operation rounded to fp32.
inline float adamw_element(float p, float g, float& m, float& v, const AdamWCoef& k) {
  p = p * k.decay;
  m = m * k.b1 + k.one_m_b1 * g;
  v = v * k.b2 + k.one_m_b2 * g * g;
  const float denom = std::sqrt(v) / k.bc2_sqrt + k.eps;
  return p + k.neg_step_size * m / denom;
}
// The same with the moments held as M (float, or bf16 rounded stochastically when stored).
template <typename M>
inline float adamw_element(float p, float g, M& m, M& v, const AdamWCoef& k) {
  if constexpr (std::is_same_v<M, float>) {
    return adamw_element(p, g, m, v, k);
  } else {
    float mf = m, vf = v;
    p = adamw_element(p, g, mf, vf, k);
    m = bf16::from_bits(bf16_bits_sr(mf, sr_element_key(k.key_m, p)));
    v = bf16::from_bits(bf16_bits_sr(vf, sr_element_key(k.key_v, p)));
    return p;
  }
}

// adamw_step: inputs in groups of (param, grad, exp_avg, exp_avg_sq[, compute copy]) (ops/optim.cpp),
// one tensor after the other.
template <typename Copy, typename M>
void adamw_one(const Tensor* t, bool with_copy, const GateDecision& gate, const AdamWCoef& k) {
  const Tensor &p = t[0], &g = t[1], &m = t[2], &v = t[3];
  float* pp = p.data<float>();
  const float* gp = g.data<float>();
  M* mp = m.data<M>();
  M* vp = v.data<M>();
  Copy* cp = with_copy ? t[4].data<Copy>() : nullptr;
  // Without a copy, point its operand at the parameter: never read or written then.
  std::array<Shape, 5> strides{p.strides(), g.strides(), m.strides(), v.strides(),
                               with_copy ? t[4].strides() : p.strides()};
  strided_loop(p.shape(), strides, [&](int64_t, const std::array<int64_t, 5>& o) {
    const float pi = adamw_element(pp[o[0]], gate.clip ? gp[o[1]] * gate.coef : gp[o[1]], mp[o[2]], vp[o[3]], k);
    pp[o[0]] = pi;
    if (cp) cp[o[4]] = Copy(pi);  // rounds as the cast kernel does (core/dtype.h)
  });
}

// A split master (Note [Split fp32], core/split_f32.h): the value is (copy, low halves), both
// contiguous, and both are written back.
template <typename M>
void adamw_split_one(const Tensor* t, const GateDecision& gate, const AdamWCoef& k) {
  const Tensor &low = t[0], &g = t[1], &m = t[2], &v = t[3], &copy = t[4];
  auto* lp = static_cast<uint16_t*>(low.raw_data());
  auto* hp = static_cast<uint16_t*>(copy.raw_data());
  const float* gp = g.data<float>();
  M* mp = m.data<M>();
  M* vp = v.data<M>();
  std::array<Shape, 3> strides{g.strides(), m.strides(), v.strides()};
  strided_loop(g.shape(), strides, [&](int64_t i, const std::array<int64_t, 3>& o) {
    const float gi = gate.clip ? gp[o[0]] * gate.coef : gp[o[0]];
    split_f32(adamw_element(join_f32(hp[i], lp[i]), gi, mp[o[1]], vp[o[2]], k), hp[i], lp[i]);
  });
}

template <typename M>
void adamw_tensor(const Tensor* ts, bool copies, bool split, const GateDecision& gate, const AdamWCoef& k) {
  if (split)
    adamw_split_one<M>(ts, gate, k);
  else if (copies && ts[4].dtype() == DType::f16)
    adamw_one<f16, M>(ts, true, gate, k);
  else
    adamw_one<bf16, M>(ts, copies, gate, k);
}

void adamw_step_kernel(const KernelCall& c) {
  const Attrs& a = c.attrs;
  const double lr = a.f("lr"), b1 = a.f("beta1"), b2 = a.f("beta2"), wd = a.f("weight_decay");
  const double t = double(a.i("step"));
  const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  const AdamWCoef k{float(1 - lr * wd), float(b1),           float(b2),         float(1 - b1),
                    float(1 - b2),      float(std::sqrt(bc2)), float(a.f("eps")), float(-(lr / bc1)),
                    sr_key(a.i("step"), 0), sr_key(a.i("step"), 1)};
  const bool copies = a.b("copies"), split = a.has("split") && a.b("split");
  const size_t stride = copies ? 5 : 4;
  const GateDecision gate = read_gate(c);
  if (gate.skip) return;
  const size_t n = a.i("gate") >= 0 ? size_t(a.i("gate")) : c.in.size();  // the gate comes last
  for (size_t i = 0; i < n; i += stride) {
    const Tensor* ts = &c.in[i];
    if (ts[2].dtype() == DType::bf16)
      adamw_tensor<bf16>(ts, copies, split, gate, k);
    else
      adamw_tensor<float>(ts, copies, split, gate, k);
  }
}
BLU_REGISTER_KERNEL(cpu, "adamw_step", adamw_step_kernel);

void sgd_step_kernel(const KernelCall& c) {
  const Tensor& p = c.out[0];
  const Tensor& g = c.in[1];
  const Attrs& a = c.attrs;
  const float neg_lr = float(-a.f("lr")), mom = float(a.f("momentum")), wd = float(a.f("weight_decay"));
  const bool nesterov = a.b("nesterov"), init = a.b("init_buffer"), use_wd = a.f("weight_decay") != 0;
  const bool use_buf = c.in[2].defined();
  const GateDecision gate = read_gate(c);
  if (gate.skip) return;
  float* pp = p.data<float>();
  const float* gp = g.data<float>();
  float* bp = use_buf ? c.in[2].data<float>() : nullptr;
  // Without a buffer, point its operand at the parameter: never read or written then.
  std::array<Shape, 3> strides{p.strides(), g.strides(), use_buf ? c.in[2].strides() : p.strides()};
  strided_loop(p.shape(), strides, [&](int64_t, const std::array<int64_t, 3>& o) {
    float d = gate.clip ? gp[o[1]] * gate.coef : gp[o[1]];
    if (use_wd) d = d + wd * pp[o[0]];
    if (use_buf) {
      const float b = init ? d : bp[o[2]] * mom + d;
      bp[o[2]] = b;
      d = nesterov ? d + mom * b : b;
    }
    pp[o[0]] = pp[o[0]] + neg_lr * d;
  });
}
BLU_REGISTER_KERNEL(cpu, "sgd_step", sgd_step_kernel);

// Σ x² over every (contiguous) input, in double, tensor after tensor in element order.
void sum_squares_kernel(const KernelCall& c) {
  double s = 0;
  for (const Tensor& t : c.in) {
    BLU_DISPATCH_FLOATING(t.dtype(), "sum_squares", {
      const scalar_t* p = static_cast<const scalar_t*>(t.raw_data());
      for (int64_t i = 0, n = t.numel(); i < n; ++i) {
        const double v = double(p[i]);
        s += v * v;
      }
    });
  }
  *c.out[0].data<double>() = s;
}
BLU_REGISTER_KERNEL(cpu, "sum_squares", sum_squares_kernel);

}  // namespace

}  // namespace blu::cpu
