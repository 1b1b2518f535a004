#include "blu/ops/attention.h"

#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "blu/backend/backend.h"
#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/elementwise.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
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
// Inputs q [B, H, T, D], k, v [B, Hkv, T, D] (H % Hkv == 0: grouped-query attention when Hkv < H)
// of one dtype, any strides with unit stride along D, 16-byte aligned rows (see flash_ready);
// attrs causal (bool), scale (double, > 0).
// Outputs: out as a contiguous [B, T, H, D] buffer (the wrapper returns its [B, H, T, D] transpose
// view, so the usual transpose(1, 2).reshape(B, T, C) that follows is free), and lse [B, H, T]
// f32, the logsumexp of each row of scaled scores (not differentiable, saved for backward).
// The backward op takes (dO, q, k, v, out, lse) in [B, H, T, D] / [B, Hkv, T, D] form and an attr
// `packed`; it returns dq, dk, dv either side by side in one contiguous buffer (packed: [B, T, 3,
// H, D] when H == Hkv, else [B, T, H + 2·Hkv, D]) or, not packed, as three contiguous buffers
// [B, T, H, D], [B, T, Hkv, D], [B, T, Hkv, D]; the wrapper returns [B, H, T, D] views.

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

// The key/value shape [B, Hkv, T, D] that goes with q [B, H, T, D] and k's head count, checked.
Shape flash_kv_shape(const char* op, const Tensor& q, const Tensor& k) {
  BLU_CHECK(k.dim() == 4, op, ": expected k [B, Hkv, T, D], got ", k.shape());
  const int64_t H = q.size(1), Hkv = k.size(1);
  BLU_CHECK(Hkv > 0 && H % Hkv == 0, op, ": expected the query heads (", H, ") to be a multiple of the key/value heads (",
            Hkv, ")");
  return {q.size(0), Hkv, q.size(2), q.size(3)};
}

// RoPE's tables as the fused backward reads them: f32 [T, D] (or more rows), contiguous, on the
// device, D even.
bool rope_tables_fit(const Tensor& cos, const Tensor& sin, int64_t T, int64_t D) {
  for (const Tensor* t : {&cos, &sin})
    if (t->dtype() != DType::f32 || t->dim() != 2 || t->size(0) < T || t->size(1) != D || !t->is_contiguous() ||
        reinterpret_cast<uintptr_t>(t->raw_data()) % 16 != 0)
      return false;
  return D % 2 == 0 && cos.device() == sin.device();
}

std::vector<TensorMeta> infer_flash_attention(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& q = in[0];
  BLU_CHECK(q.dim() == 4, "flash_attention: expected q [B, H, T, D], got ", q.shape());
  BLU_CHECK(is_floating(q.dtype()) && q.dtype() != DType::f64, "flash_attention: expected f32, bf16 or f16, got ",
            q.dtype());
  BLU_CHECK(a.f("scale") > 0, "flash_attention: expected scale > 0, got ", a.f("scale"));
  (void)a.b("causal");
  const Shape kv = flash_kv_shape("flash_attention", q, in[1]);
  const char* names[] = {"q", "k", "v"};
  for (size_t i = 0; i < 3; ++i) {
    BLU_CHECK(in[i].dtype() == q.dtype(), "flash_attention: ", names[i], " has dtype ", in[i].dtype(), ", q has ",
              q.dtype());
    check_flash_operand("flash_attention", names[i], in[i], i == 0 ? q.shape() : kv);
  }
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  return {TensorMeta{{B, T, H, D}, q.dtype(), q.device()}, TensorMeta{{B, H, T}, DType::f32, q.device()}};
}

std::vector<TensorMeta> infer_flash_attention_backward(std::span<const Tensor> in, const Attrs& a) {
  const Tensor& q = in[1];
  const Shape kv = flash_kv_shape("flash_attention_backward", q, in[2]);
  const char* names[] = {"grad", "q", "k", "v", "out"};
  for (size_t i = 0; i < 5; ++i) {
    BLU_CHECK(in[i].dtype() == q.dtype(), "flash_attention_backward: ", names[i], " has dtype ", in[i].dtype(),
              ", q has ", q.dtype());
    check_flash_operand("flash_attention_backward", names[i], in[i], i == 2 || i == 3 ? kv : q.shape());
  }
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = kv[1];
  BLU_ASSERT(in[5].shape() == Shape({B, H, T}) && in[5].dtype() == DType::f32 && in[5].is_contiguous(),
             "flash_attention_backward: lse ", in[5].str());
  // Under RoPE (rotary_attention): its cos, sin tables, and dq, dk come out rotated back.
  BLU_ASSERT(in.size() == 6 || (in.size() == 8 && a.b("packed") && rope_tables_fit(in[6], in[7], T, D)),
             "flash_attention_backward: RoPE tables ", in.size() > 6 ? in[6].str() : std::string("missing"));
  // Packed: dq, dk, dv side by side in one buffer. When q, k, v are the pieces of one projection
  // (GPT's qkv split; a fused q/k/v projection of a GQA model), their gradients are then the
  // pieces of that projection's gradient, and split's backward has nothing to copy
  // (split_backward, ops/join.cpp). Otherwise (GQA with separate projections) three buffers, each
  // of which its [B, T, heads·D] view takes without a copy.
  if (a.b("packed")) {
    if (H == Hkv) return {TensorMeta{{B, T, 3, H, D}, q.dtype(), q.device()}};
    return {TensorMeta{{B, T, H + 2 * Hkv, D}, q.dtype(), q.device()}};
  }
  return {TensorMeta{{B, T, H, D}, q.dtype(), q.device()}, TensorMeta{{B, T, Hkv, D}, q.dtype(), q.device()},
          TensorMeta{{B, T, Hkv, D}, q.dtype(), q.device()}};
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

// Whether k and v (of Hkv < H heads) are the head ranges right after q's in one [B, T, H + 2·Hkv,
// D] buffer: the split of a fused q/k/v projection viewed as heads.
bool adjacent_heads(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t H = q.size(1), Hkv = k.size(1), D = q.size(3);
  return k.storage() == q.storage() && v.storage() == q.storage() && k.strides() == q.strides() &&
         v.strides() == q.strides() && q.stride(3) == 1 && q.stride(1) == D && q.stride(2) == (H + 2 * Hkv) * D &&
         k.offset() == q.offset() + H * D && v.offset() == k.offset() + Hkv * D;
}

// g[0] is the gradient of the [B, T, H, D] output buffer.
std::vector<Tensor> flash_attention_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor &q = c.input(0), &k = c.input(1), &v = c.input(2);
  const int64_t H = q.size(1), Hkv = k.size(1);
  Attrs a = c.attrs;
  a.set("packed", H == Hkv || adjacent_heads(q, k, v));
  const std::vector<Tensor> d =
      dispatch(kFlashAttentionBackward, {flash_ready(bhtd(g[0])), q, k, v, bhtd(c.output(0)), c.output(1)}, a);
  if (d.size() == 3) return {bhtd(d[0]), bhtd(d[1]), bhtd(d[2])};
  if (H == Hkv) return {bhtd(select(d[0], 2, 0)), bhtd(select(d[0], 2, 1)), bhtd(select(d[0], 2, 2))};
  return {bhtd(narrow(d[0], 2, 0, H)), bhtd(narrow(d[0], 2, H, Hkv)), bhtd(narrow(d[0], 2, H + Hkv, Hkv))};
}
const OpDef kFlashAttention{.name = "flash_attention",
                            .infer = infer_flash_attention,
                            .backward = flash_attention_bw,
                            .save_inputs = 0b111,
                            .save_outputs = 0b11,
                            .diff_outputs = 1};

// --- rotary_attention: RoPE and flash attention as one node (ops/attention.h) ---
// Inputs qkv [B, T, H + 2·Hkv, D] (contiguous), cos, sin [T, D] f32; attrs heads (H), kv_heads
// (Hkv), causal, scale. The forward is the composition, unrecorded: r = RoPE of qkv's first H + Hkv
// heads (v copied beside them), then flash_attention on r's head ranges. Outputs: attention's
// [B, T, H, D] buffer, its lse, and r (not differentiable, saved: the backward's q, k, v). qkv is
// not saved — RoPE's backward needs no input — and the backward asks flash_attention_backward for
// the gradient of qkv itself (dq, dk rotated back there), so no pass of RoPE's backward over the
// whole [B, T, H + 2·Hkv, D] gradient remains.
std::vector<TensorMeta> infer_rotary_attention(std::span<const Tensor>, const Attrs&) {
  return {};  // the ops it is made of make (and check) the outputs
}

// r's query, key and value head ranges as the [B, heads, T, D] views flash attention takes.
std::vector<Tensor> head_ranges(const Tensor& r, int64_t H, int64_t Hkv) {
  return {bhtd(narrow(r, 2, 0, H)), bhtd(narrow(r, 2, H, Hkv)), bhtd(narrow(r, 2, H + Hkv, Hkv))};
}

std::vector<Tensor> rotary_attention_compute(std::span<const Tensor> in, const Attrs& a) {
  NoGradGuard no_grad;
  const int64_t H = a.i("heads"), Hkv = a.i("kv_heads");
  const Tensor r = rotary_embedding(in[0], in[1], in[2], H + Hkv);
  Attrs fa{{"causal", a.b("causal")}, {"scale", a.f("scale")}};
  std::vector<Tensor> outs = dispatch(kFlashAttention, head_ranges(r, H, Hkv), fa);
  outs.push_back(r);
  return outs;
}

std::vector<Tensor> rotary_attention_bw(const BackwardContext& c, std::span<const Tensor> g) {
  const Tensor& r = c.output(2);
  const int64_t H = c.attrs.i("heads"), Hkv = c.attrs.i("kv_heads");
  Attrs a{{"causal", c.attrs.b("causal")}, {"scale", c.attrs.f("scale")}, {"packed", true}};
  const std::vector<Tensor> qkv = head_ranges(r, H, Hkv);
  const std::vector<Tensor> d = dispatch(
      kFlashAttentionBackward,
      {flash_ready(bhtd(g[0])), qkv[0], qkv[1], qkv[2], bhtd(c.output(0)), c.output(1), c.input(1), c.input(2)}, a);
  return {reshape(d[0], r.shape()), Tensor(), Tensor()};
}

const OpDef kRotaryAttention{.name = "rotary_attention",
                             .infer = infer_rotary_attention,
                             .backward = rotary_attention_bw,
                             .save_inputs = 0b110,
                             .save_outputs = 0b111,
                             .view = rotary_attention_compute,
                             .diff_outputs = 1};

// Why the fused CUDA path cannot take q, k, v of these shapes and dtype ("" when it can).
std::string flash_unsupported(const Shape& q, const Shape& k, const Shape& v, DType dtype) {
  if (!backend(DeviceType::cuda).supports("flash_attention")) return "no flash_attention kernel in this build";
  if (q.size() != 4 || k.size() != 4 || v.size() != 4) return "q, k, v are not 4-d [B, H, T, D]";
  const Shape kv{q[0], k[1], q[2], q[3]};
  if (k != kv || v != kv) return "q, k, v shapes differ (Tq != Tk, Dv != D or broadcast batch dims)";
  if (k[1] == 0 || q[1] % k[1] != 0) return "query heads not a multiple of the key/value heads";
  if (dtype == DType::f64) return "dtype f64";
  if (q[3] != 64 && q[3] != 128) return "head dim " + std::to_string(q[3]) + " (supported: 64, 128)";
  if (q[0] * q[1] > int64_t(INT32_MAX) || q[2] > int64_t(INT32_MAX) / 2) return "sizes too large";
  return "";
}

// Grouped-query attention (ops/attention.h): k, v [..., Hkv, T, D] with Hkv heads other than q's
// H, neither of them 1 (one head on either side is ordinary broadcasting). Checks the shapes.
bool is_gqa(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() < 3 || k.dim() < 3 || v.dim() < 3) return false;
  const int64_t H = q.size(-3), Hk = k.size(-3), Hv = v.size(-3);
  if (H <= 1 || ((Hk == H || Hk == 1) && (Hv == H || Hv == 1))) return false;
  BLU_CHECK(Hk == Hv, "scaled_dot_product_attention: grouped-query attention needs k and v with the same number of ",
            "heads (dim -3); got k ", k.shape(), ", v ", v.shape());
  BLU_CHECK(Hk > 0 && H % Hk == 0, "scaled_dot_product_attention: grouped-query attention needs the query heads to be ",
            "a multiple of the key/value heads; got q ", q.shape(), " (", H, " heads), k ", k.shape(), " (", Hk,
            " heads)");
  BLU_CHECK(q.dim() == k.dim() && q.dim() == v.dim(), "scaled_dot_product_attention: grouped-query attention needs ",
            "q, k, v of one rank; got q ", q.shape(), ", k ", k.shape(), ", v ", v.shape());
  for (int64_t d = 0; d < q.dim() - 3; ++d)
    BLU_CHECK(k.size(d) == q.size(d) && v.size(d) == q.size(d), "scaled_dot_product_attention: grouped-query ",
              "attention needs the batch dims of q, k, v equal; expected ", q.shape(), "'s in k ", k.shape(), " and v ",
              v.shape());
  return true;
}

// [..., Hkv, T, E] → [..., H, T, E], head h a copy of head h / (H / Hkv): viewed as [..., Hkv, 1,
// T, E], expanded over the group and reshaped (so the gradient sums over each group).
Tensor repeat_heads(const Tensor& t, int64_t H) {
  const int64_t n = t.dim(), Hkv = t.size(-3);
  Shape grouped = t.shape();
  grouped.insert(grouped.begin() + (n - 2), H / Hkv);  // [..., Hkv, G, T, E]
  Shape merged = t.shape();
  merged[size_t(n - 3)] = H;
  return reshape(expand(unsqueeze(t, n - 2), grouped), merged);
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
  const bool gqa = is_gqa(q, k, v);
  if (q.device().is_cuda()) {
    const std::string why = flash_unsupported(q.shape(), k.shape(), v.shape(), q.dtype());
    if (why.empty()) {
      auto outs = dispatch(kFlashAttention, {flash_ready(q), flash_ready(k), flash_ready(v)},
                           Attrs{{"causal", causal}, {"scale", s}});
      return bhtd(outs[0]);
    }
    log_fallback_once(why);
  }
  const Tensor kh = gqa ? repeat_heads(k, q.size(-3)) : k, vh = gqa ? repeat_heads(v, q.size(-3)) : v;
  Tensor scores = mul(matmul(q, transpose(kh, -2, -1)), s);  // [..., Tq, Tk]
  if (causal) scores = masked_fill(scores, causal_mask(tq, tk, q.device()), -std::numeric_limits<double>::infinity());
  return matmul(softmax(scores, -1), vh);
}

namespace {
// BLU_ROTARY_ATTENTION=0 in the environment keeps rotary_attention the plain composition on CUDA
// too (an A/B switch for the fused node, and a way around it).
bool rotary_attention_fused() {
  static const bool on = [] {
    const char* e = std::getenv("BLU_ROTARY_ATTENTION");
    return !(e && std::string_view(e) == "0");
  }();
  return on;
}
}  // namespace

Tensor rotary_attention(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t H, int64_t Hkv, bool causal) {
  BLU_CHECK(qkv.dim() == 4 && H > 0 && Hkv > 0 && qkv.size(2) == H + 2 * Hkv, "rotary_attention: expected qkv [B, T, ",
            H, " + 2·", Hkv, ", D] (the query heads, then the key and value heads), got ", qkv.shape());
  const int64_t T = qkv.size(1), D = qkv.size(3);
  if (qkv.device().is_cuda() && rotary_attention_fused() && qkv.is_contiguous() && rope_tables_fit(cos, sin, T, D) &&
      cos.device() == qkv.device()) {
    // The fused node's attention takes r's head ranges as [B, heads, T, D]: the same checks as on
    // q, k, v.
    const int64_t B = qkv.size(0);
    const Shape kv{B, Hkv, T, D};
    if (flash_unsupported({B, H, T, D}, kv, kv, qkv.dtype()).empty()) {
      const double s = 1.0 / std::sqrt(double(D));
      const std::vector<Tensor> outs =
          dispatch(kRotaryAttention, {qkv, cos, sin},
                   Attrs{{"heads", H}, {"kv_heads", Hkv}, {"causal", causal}, {"scale", s}});
      return bhtd(outs[0]);
    }
  }
  const std::vector<Tensor> r = split(rotary_embedding(qkv, cos, sin, H + Hkv), {H, Hkv, Hkv}, 2);
  return scaled_dot_product_attention(bhtd(r[0]), bhtd(r[1]), bhtd(r[2]), causal);
}

}  // namespace blu
