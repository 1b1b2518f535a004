// ops/swiglu: OpDefs of SiLU and the SwiGLU gate of the Llama MLP (declared in ops/nn.h), each with
// a dedicated backward op (no double backward). silu saves x; swiglu saves gate and up and
// recomputes silu(gate) in its backward.
// Note [SwiGLU gradients side by side]: the model may compute gate and up with one GEMM into an
// [N, 2I] buffer and take its halves with split/chunk. swiglu reads those row-strided views
// without a copy, and when gate and up are the two adjacent halves of one buffer its backward
// writes d_gate and d_up side by side into one [N, 2I] buffer and returns the halves as views, so
// split's backward joins them as a view of that buffer (adjacent_join, ops/join.cpp) — the GEMM's
// gradient with no cat. narrow's backward does not join (it zero-fills and copies per piece), so
// views taken with narrow get correct gradients but not this saving.
// Keep: 16-bit inputs compute in fp32 and round once.
#include <cstdint>

#include "blu/ops/dispatch.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// --- silu ------------------------------------------------------------------------------------
// Input x (any layout); output silu(x) contiguous. Backward op: inputs (grad, x) of one shape
// (any layouts); output grad·silu'(x), silu'(x) = s·(1 + x·(1 − s)), s = sigmoid(x).
std::vector<TensorMeta> infer_silu(std::span<const Tensor> in, const Attrs&) {
  BLU_CHECK(is_floating(in[0].dtype()), "silu: expected an input of a floating dtype (f32, f64, bf16, f16), got ",
            in[0].dtype());
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
std::vector<TensorMeta> infer_silu_backward(std::span<const Tensor> in, const Attrs&) {
  BLU_ASSERT(in[0].shape() == in[1].shape() && in[0].dtype() == in[1].dtype(), "silu_backward: grad ", in[0].str(),
             " for input ", in[1].str());
  return {TensorMeta{in[1].shape(), in[1].dtype(), in[1].device()}};
}
const OpDef kSiluBackward{.name = "silu_backward", .infer = infer_silu_backward};
std::vector<Tensor> silu_bw(const BackwardContext& c, std::span<const Tensor> g) {
  return {dispatch1(kSiluBackward, {g[0], c.input(0)})};
}
const OpDef kSilu{.name = "silu", .infer = infer_silu, .shard = shard_rule_pointwise, .backward = silu_bw, .save_inputs = 0b1};

// --- swiglu ----------------------------------------------------------------------------------
// The row stride of t seen as [R, I] rows (I = the last dim) with unit stride along I, when its
// leading dims walk rows of one stride (a contiguous tensor, a slice of columns, an expanded
// row); -1 otherwise. 0-d: one row of one element.
int64_t row_stride(const Tensor& t) {
  if (t.dim() == 0) return 1;
  const int64_t I = t.size(-1);
  if (I > 1 && t.stride(-1) != 1) return -1;
  int64_t rs = -1, expect = 0;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (rs < 0) {
      rs = t.stride(d);
    } else if (t.stride(d) != expect) {
      return -1;
    }
    expect = t.stride(d) * t.size(d);
  }
  return rs < 0 ? I : rs;
}
// The layout swiglu_backward's kernels take (row-strided); anything else is copied.
Tensor row_ready(const Tensor& t) { return row_stride(t) >= 0 ? t : contiguous(t); }

// gate and up are the two halves of one buffer's last dim, up right after gate (split/chunk of a
// [.., 2I] projection): their gradients can be written side by side.
bool adjacent_halves(const Tensor& gate, const Tensor& up) {
  return gate.dim() >= 1 && gate.size(-1) > 0 && gate.storage() == up.storage() && gate.strides() == up.strides() &&
         (gate.stride(-1) == 1 || gate.size(-1) == 1) && up.offset() == gate.offset() + gate.size(-1);
}

// Inputs (gate, up) of one shape, dtype and device, any layouts; output silu(gate)·up contiguous.
std::vector<TensorMeta> infer_swiglu(std::span<const Tensor> in, const Attrs&) {
  const Tensor &gate = in[0], &up = in[1];
  BLU_CHECK(is_floating(gate.dtype()), "swiglu: expected gate of a floating dtype (f32, f64, bf16, f16), got ",
            gate.dtype());
  BLU_CHECK(up.dtype() == gate.dtype(), "swiglu: up has dtype ", up.dtype(), " but gate has ", gate.dtype());
  BLU_CHECK(up.shape() == gate.shape(), "swiglu: gate ", gate.shape(), " and up ", up.shape(),
            " must have the same shape");
  return {TensorMeta{gate.shape(), gate.dtype(), gate.device()}};
}
// Inputs (grad, gate, up), each row-strided (row_stride >= 0); attr joined. Outputs d_gate and
// d_up: with joined, one contiguous [..., 2I] buffer holding d_gate in columns [0, I) and d_up in
// [I, 2I) (gate's shape with the last dim doubled); otherwise two contiguous tensors of gate's
// shape.
std::vector<TensorMeta> infer_swiglu_backward(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& gate = in[1];
  for (const Tensor& t : in)
    BLU_ASSERT(t.shape() == gate.shape() && t.dtype() == gate.dtype() && row_stride(t) >= 0,
               "swiglu_backward: operand ", t.str(), " for gate ", gate.str());
  const TensorMeta m{gate.shape(), gate.dtype(), gate.device()};
  if (!a.b("joined")) return {m, m};
  BLU_ASSERT(gate.dim() >= 1, "swiglu_backward: joined gradients of a 0-d gate");
  Shape wide = gate.shape();
  wide.back() *= 2;
  return {TensorMeta{wide, gate.dtype(), gate.device()}};
}
const OpDef kSwigluBackward{.name = "swiglu_backward", .infer = infer_swiglu_backward};

std::vector<Tensor> swiglu_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor &gate = c.input(0), &up = c.input(1);
  const bool joined = adjacent_halves(gate, up);
  auto gs = dispatch(kSwigluBackward, {row_ready(g[0]), row_ready(gate), row_ready(up)}, Attrs{{"joined", joined}});
  if (joined) {
    const int64_t I = gate.size(-1);
    gs = {narrow(gs[0], -1, 0, I), narrow(gs[0], -1, I, I)};
  }
  return {c.needs_grad[0] ? gs[0] : Tensor(), c.needs_grad[1] ? gs[1] : Tensor()};
}
const OpDef kSwiglu{.name = "swiglu", .infer = infer_swiglu, .shard = shard_rule_pointwise, .backward = swiglu_bw, .save_inputs = 0b11};

}  // namespace

Tensor silu(const Tensor& x) {
  BLU_CHECK(x.defined(), "silu: input must be defined");
  return dispatch1(kSilu, {x});
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  BLU_CHECK(gate.defined() && up.defined(), "swiglu: gate and up must be defined");
  return dispatch1(kSwiglu, {gate, up});
}

}  // namespace blu
