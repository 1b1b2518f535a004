#include "blu/ops/attention.h"

#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <mutex>
#include <set>
#include <string>

#include "blu/backend/backend.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"
#include "blu/ops/view.h"

namespace blu {

namespace {

// True above the diagonal of a Tq x Tk grid aligned at the top left (key j is hidden from query i
// when j > i), as torch's is_causal=True: tril(ones(Tq, Tk)) are the visible positions.
Tensor causal_mask(int64_t tq, int64_t tk, Device device) {
  Tensor rows = reshape(arange(0, double(tq), 1, DType::i64, device), {tq, 1});
  Tensor cols = arange(0, double(tk), 1, DType::i64, device);
  return gt(cols, rows);
}

// --- flash_attention (CUDA) ---------------------------------------------------------------------
// Inputs q, k, v [B, H, T, D] of one dtype, any strides with unit stride along D, 16-byte aligned
// rows (see flash_ready); attrs causal (bool), scale (double, > 0).
// Outputs: out as a contiguous [B, T, H, D] buffer (the wrapper returns its [B, H, T, D] transpose
// view, so the usual transpose(1, 2).reshape(B, T, C) that follows is free), and lse [B, H, T]
// f32, the logsumexp of each row of scaled scores (not differentiable, saved for backward).
// The backward op takes (dO, q, k, v, out, lse) all in [B, H, T, D] form and returns dq, dk, dv as
// contiguous [B, T, H, D] buffers (returned as [B, H, T, D] views).

void check_flash_operand(const char* op, const char* what, const Tensor& t, const Shape& want) {
  BLU_CHECK(t.shape() == want, op, ": expected ", what, " of shape ", want, ", got ", t.shape());
  const size_t item = t.itemsize();
  BLU_CHECK(t.stride(3) == 1 || t.size(3) == 1, op, ": ", what, " needs unit stride along D, got strides ",
            t.strides());
  for (int d = 0; d < 3; ++d)
    BLU_CHECK(t.size(d) == 1 || (size_t(t.stride(d)) * item) % 16 == 0, op, ": ", what,
              " strides must be multiples of 16 bytes, got ", t.strides(), " for ", t.dtype());
  BLU_CHECK(reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0, op, ": ", what, " data is not 16-byte aligned");
}

std::vector<TensorMeta> infer_flash_attention(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& q = in[0];
  BLU_CHECK(q.dim() == 4, "flash_attention: expected q [B, H, T, D], got ", q.shape());
  BLU_CHECK(is_floating(q.dtype()) && q.dtype() != DType::f64, "flash_attention: expected f32, bf16 or f16, got ",
            q.dtype());
  BLU_CHECK(a.f("scale") > 0, "flash_attention: expected scale > 0, got ", a.f("scale"));
  (void)a.b("causal");
  const char* names[] = {"q", "k", "v"};
  for (size_t i = 0; i < 3; ++i) {
    BLU_CHECK(in[i].dtype() == q.dtype(), "flash_attention: ", names[i], " has dtype ", in[i].dtype(), ", q has ",
              q.dtype());
    check_flash_operand("flash_attention", names[i], in[i], q.shape());
  }
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  return {TensorMeta{{B, T, H, D}, q.dtype(), q.device()}, TensorMeta{{B, H, T}, DType::f32, q.device()}};
}

std::vector<TensorMeta> infer_flash_attention_backward(std::span<const Tensor> in, const Attrs&) {
  const Tensor& q = in[1];
  const char* names[] = {"grad", "q", "k", "v", "out"};
  for (size_t i = 0; i < 5; ++i) {
    BLU_CHECK(in[i].dtype() == q.dtype(), "flash_attention_backward: ", names[i], " has dtype ", in[i].dtype(),
              ", q has ", q.dtype());
    check_flash_operand("flash_attention_backward", names[i], in[i], q.shape());
  }
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  BLU_ASSERT(in[5].shape() == Shape({B, H, T}) && in[5].dtype() == DType::f32 && in[5].is_contiguous(),
             "flash_attention_backward: lse ", in[5].str());
  // dq, dk, dv side by side in one [B, T, 3, H, D] buffer: when q, k, v are the three pieces of
  // one projection (GPT's qkv split), their gradients are then the pieces of that projection's
  // gradient, and split's backward has nothing to copy (split_backward, ops/join.cpp).
  return {TensorMeta{{B, T, 3, H, D}, q.dtype(), q.device()}};
}
const OpDef kFlashAttentionBackward{.name = "flash_attention_backward", .infer = infer_flash_attention_backward};

// A [B, T, H, D] buffer seen as [B, H, T, D].
Tensor bhtd(const Tensor& bthd) { return transpose(bthd, 1, 2); }

// The layout the kernels take: unit stride along D, 16-byte aligned rows and base. Anything else
// is copied once (a fresh contiguous buffer is always aligned).
Tensor flash_ready(const Tensor& t) {
  bool ok = t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
  for (int d = 0; d < 3 && ok; ++d) ok = t.size(d) == 1 || (size_t(t.stride(d)) * t.itemsize()) % 16 == 0;
  return ok ? t : clone(t);
}

// g[0] is the gradient of the [B, T, H, D] output buffer.
std::vector<Tensor> flash_attention_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor dqkv = dispatch1(kFlashAttentionBackward, {flash_ready(bhtd(g[0])), c.input(0), c.input(1), c.input(2),
                                                          bhtd(c.output(0)), c.output(1)}, c.attrs);
  return {bhtd(select(dqkv, 2, 0)), bhtd(select(dqkv, 2, 1)), bhtd(select(dqkv, 2, 2))};
}
const OpDef kFlashAttention{.name = "flash_attention",
                            .infer = infer_flash_attention,
                            .backward = flash_attention_bw,
                            .save_inputs = 0b111,
                            .save_outputs = 0b11,
                            .diff_outputs = 1};

// Why the fused CUDA path cannot take this call ("" when it can).
std::string flash_unsupported(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!backend(DeviceType::cuda).supports("flash_attention")) return "no flash_attention kernel in this build";
  if (q.dim() != 4) return "q is not 4-d [B, H, T, D]";
  if (k.shape() != q.shape() || v.shape() != q.shape())
    return "q, k, v shapes differ (Tq != Tk, Dv != D or broadcast batch dims)";
  if (q.dtype() == DType::f64) return "dtype f64";
  if (q.size(3) != 64 && q.size(3) != 128) return "head dim " + std::to_string(q.size(3)) + " (supported: 64, 128)";
  if (q.size(0) * q.size(1) > int64_t(INT32_MAX) || q.size(2) > int64_t(INT32_MAX) / 2) return "sizes too large";
  return "";
}

// One line per distinct reason, the first time it happens.
void log_fallback_once(const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(why).second)
    std::fprintf(stderr, "blu: scaled_dot_product_attention on CUDA falls back to the composite path: %s\n",
                 why.c_str());
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  BLU_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, "scaled_dot_product_attention: q, k, v need at least 2 dims ",
            "[..., T, D]; got q ", q.shape(), ", k ", k.shape(), ", v ", v.shape());
  BLU_CHECK(q.dtype() == k.dtype() && k.dtype() == v.dtype(), "scaled_dot_product_attention: q, k, v must share a dtype; ",
            "got ", q.dtype(), ", ", k.dtype(), ", ", v.dtype());
  BLU_CHECK(is_floating(q.dtype()), "scaled_dot_product_attention: expected floating tensors, got ", q.dtype());
  BLU_CHECK(q.size(-1) == k.size(-1), "scaled_dot_product_attention: q and k head dims differ: q ", q.shape(), ", k ",
            k.shape());
  BLU_CHECK(k.size(-2) == v.size(-2), "scaled_dot_product_attention: k and v sequence lengths differ: k ", k.shape(),
            ", v ", v.shape());
  const int64_t tq = q.size(-2), tk = k.size(-2), d = q.size(-1);
  const double s = scale > 0 ? scale : 1.0 / std::sqrt(double(std::max<int64_t>(d, 1)));
  if (q.device().is_cuda()) {
    const std::string why = flash_unsupported(q, k, v);
    if (why.empty()) {
      auto outs = dispatch(kFlashAttention, {flash_ready(q), flash_ready(k), flash_ready(v)},
                           Attrs{{"causal", causal}, {"scale", s}});
      return bhtd(outs[0]);
    }
    log_fallback_once(why);
  }
  Tensor scores = mul(matmul(q, transpose(k, -2, -1)), s);  // [..., Tq, Tk]
  if (causal) scores = masked_fill(scores, causal_mask(tq, tk, q.device()), -std::numeric_limits<double>::infinity());
  return matmul(softmax(scores, -1), v);
}

}  // namespace blu
