// compiler/epilogue: see epilogue.h.
#include "blu/compiler/epilogue.h"

#include <algorithm>
#include <array>

#include "blu/backend/backend.h"
#include "blu/compiler/exclude.h"

namespace blu::compiler {

namespace {

int buffer_of(const Graph& g, int v) { return g.values[size_t(v)].buffer; }

// Whether value v is its whole buffer, contiguous from its start, of n elements.
bool whole(const Graph& g, int v, int64_t n) {
  const Value& x = g.values[size_t(v)];
  return x.contiguous() && x.offset == 0 && numel(x.shape) == n && x.nbytes() == g.buffers[size_t(x.buffer)].nbytes;
}

// The add's operand that the fold adds to the product: a residual (the product's shape) or, when
// the linear has no bias, a bias (a contiguous vector of `out` elements, broadcast over the rows).
enum class Fold { none, residual, bias };

Fold fold_kind(const Graph& g, const Op& linear, int product_view, int other) {
  const Value& y = g.values[size_t(product_view)];
  const Value& o = g.values[size_t(other)];
  const int64_t out = g.values[size_t(linear.outputs[0])].shape[1];
  if (o.dtype != y.dtype || o.device != y.device || !o.contiguous()) return Fold::none;
  if (o.shape == y.shape) return Fold::residual;
  const bool vector = !o.shape.empty() && o.shape.back() == out && numel(o.shape) == out;
  return vector && linear.inputs[2] < 0 ? Fold::bias : Fold::none;
}

// For a region of epilogue_regions: which add operand lies on the product's buffer (0 or 1).
int product_operand(const Graph& g, const FusedRegion& r) {
  const int by = buffer_of(g, g.ops[size_t(r.ops.front())].outputs[0]);
  const Op& add = g.ops[size_t(r.ops.back())];
  return buffer_of(g, add.inputs[0]) == by ? 0 : 1;
}

// Where value v sits among region r's inputs (-1 for an absent optional operand, v < 0).
int input_slot(const FusedRegion& r, int v) {
  if (v < 0) return -1;
  const auto it = std::find(r.inputs.begin(), r.inputs.end(), v);
  BLU_CHECK(it != r.inputs.end(), "epilogue_launch: value %", v, " is not an input of region ", r.index);
  return int(it - r.inputs.begin());
}

// Where value v sits among region r's outputs.
int output_slot(const FusedRegion& r, int v) {
  const auto it = std::find(r.outputs.begin(), r.outputs.end(), v);
  BLU_CHECK(it != r.outputs.end(), "epilogue_launch: value %", v, " is not an output of region ", r.index);
  return int(it - r.outputs.begin());
}

bool is_gelu_tanh(const Op& o) {
  return o.kind == OpKind::kernel && o.name == "gelu" && o.inputs.size() == 1 && o.outputs.size() == 1 &&
         o.writes.empty() && o.attrs.has("approximate") && o.attrs.b("approximate");
}

// A linear with a bias whose product's first reader after views is a tanh GELU: the region
// {linear, views, gelu}, its outputs the GELU's and the product itself (whole: the backward's
// GELU gradient reads it), which the GEMM writes as its auxiliary output. `users`: the ops on the
// product's buffer, in order.
bool gelu_region(const Graph& g, const std::vector<int>& users, int lin, FusedRegion& r) {
  const Op& l = g.ops[size_t(lin)];
  if (l.inputs[2] < 0 || op_excluded("gelu")) return false;
  const int y = l.outputs[0];
  const int64_t n = numel(g.values[size_t(y)].shape);
  std::vector<int> views;
  int gelu = -1;
  for (int k : users) {
    if (k <= lin) continue;
    const Op& o = g.ops[size_t(k)];
    if (o.kind == OpKind::view) {
      views.push_back(k);
      continue;
    }
    if (is_gelu_tanh(o)) gelu = k;
    break;
  }
  if (gelu < 0) return false;
  const Op& ge = g.ops[size_t(gelu)];
  const int h = ge.outputs[0];
  if (!whole(g, ge.inputs[0], n) || !g.values[size_t(h)].contiguous() ||
      buffer_of(g, h) == buffer_of(g, y) || numel(g.values[size_t(h)].shape) != n)
    return false;
  r.kind = RegionKind::gemm_epilogue;
  r.ops.push_back(lin);
  for (int v : views)
    if (v < gelu) r.ops.push_back(v);
  r.ops.push_back(gelu);
  compute_region_io(g, r);
  // Outputs: the GELU's, and values that are each the whole product (the GEMM's aux; the linear's
  // own output and a view of it are the same bytes), at least one.
  int aux = 0;
  for (int v : r.outputs) {
    if (v == h) continue;
    if (buffer_of(g, v) != buffer_of(g, y) || !whole(g, v, n)) return false;
    ++aux;
  }
  if (aux == 0 || std::find(r.outputs.begin(), r.outputs.end(), h) == r.outputs.end()) return false;
  r.bytes_saved = double(g.buffers[size_t(buffer_of(g, y))].nbytes);  // the product read back
  return true;
}

bool is_weight_grad(const Op& o) {
  return o.kind == OpKind::kernel && (o.name == "linear_weight_grad_into" || o.name == "linear_weight_grad");
}

// The weight-gradient op's g operand (linear_weight_grad: input 0; _into: input 1).
int weight_grad_g(const Op& o) { return o.inputs.size() >= 2 ? o.inputs[o.name == "linear_weight_grad" ? 0 : 1] : -1; }

// {gelu_and_backward, views of its gradient output, the weight-gradient op that sums that gradient
// for a bias}: gelu_and_backward makes gu ([rows, n], its whole buffer); a later
// linear_weight_grad(_into) reads all of gu's buffer (through views) as g, with a bias gradient and
// no accumulation, and no op between writes gu's buffer. Both of the GELU's outputs must be read
// outside the region (c_proj's weight gradient reads the GELU, c_fc's input gradient reads gu), so
// the region defines nothing that would get no bytes.
bool bias_grad_region(const Graph& g, const std::vector<std::vector<int>>& users, int ga, FusedRegion& r) {
  const Op& a = g.ops[size_t(ga)];
  if (a.kind != OpKind::kernel || a.name != "gelu_and_backward" || a.inputs.size() != 2 || a.outputs.size() != 2 ||
      !a.writes.empty() || op_excluded("gelu_and_backward") || op_excluded("linear_weight_grad_into"))
    return false;
  const int gu = a.outputs[1];
  const Value& guv = g.values[size_t(gu)];
  const int64_t n = numel(guv.shape);
  const int bgu = buffer_of(g, gu);
  if (guv.shape.size() != 2 || !whole(g, gu, n) || !whole(g, a.outputs[0], n)) return false;
  std::vector<int> views;
  int wg = -1;
  for (int k : users[size_t(bgu)]) {
    if (k <= ga) continue;
    const Op& o = g.ops[size_t(k)];
    if (o.kind == OpKind::view) {
      views.push_back(k);
      continue;
    }
    const bool writes = std::any_of(o.writes.begin(), o.writes.end(),
                                    [&](int i) { return buffer_of(g, o.inputs[size_t(i)]) == bgu; }) ||
                        std::any_of(o.outputs.begin(), o.outputs.end(), [&](int v) { return buffer_of(g, v) == bgu; });
    if (writes) return false;
    if (!is_weight_grad(o)) continue;  // another reader (the input gradient)
    const int gv = weight_grad_g(o);
    if (gv < 0 || buffer_of(g, gv) != bgu || !whole(g, gv, n) || g.values[size_t(gv)].shape.size() != 2) return false;
    wg = k;
    break;
  }
  if (wg < 0) return false;
  const Op& b = g.ops[size_t(wg)];
  const bool into = b.name == "linear_weight_grad_into";
  const int gb = into ? (b.inputs.size() == 4 ? b.inputs[3] : -1) : (b.outputs.size() == 2 ? b.outputs[1] : -1);
  if (gb < 0 || (into && b.attrs.has("accumulate"))) return false;
  const Value& gbv = g.values[size_t(gb)];
  if (!gbv.contiguous() || gbv.shape != Shape{guv.shape[1]}) return false;
  r.kind = RegionKind::gemm_epilogue;
  r.ops.push_back(ga);
  r.ops.insert(r.ops.end(), views.begin(), views.end());
  r.ops.push_back(wg);
  compute_region_io(g, r);
  for (int v : a.outputs)  // each read outside, itself or through a view
    if (std::none_of(r.outputs.begin(), r.outputs.end(), [&](int o) { return buffer_of(g, o) == buffer_of(g, v); }))
      return false;
  r.bytes_saved = double(g.buffers[size_t(bgu)].nbytes);  // gu read once for the sum
  return true;
}

}  // namespace

std::vector<FusedRegion> epilogue_regions(const Graph& g) {
  std::vector<FusedRegion> out;
  if (op_excluded("linear")) return out;
  const bool adds = !op_excluded("add");
  // Per buffer: the ops that touch it, in order; and the buffers read after the step.
  std::vector<std::vector<int>> users(g.buffers.size());
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    auto use = [&](int v) {
      if (v < 0) return;
      std::vector<int>& u = users[size_t(buffer_of(g, v))];
      if (u.empty() || u.back() != int(i)) u.push_back(int(i));
    };
    for (int v : op.inputs) use(v);
    for (int v : op.outputs) use(v);
  }
  std::vector<bool> read_after(g.buffers.size(), false);
  for (int v : g.outputs) read_after[size_t(buffer_of(g, v))] = true;
  for (size_t i = 0; i < g.ops.size(); ++i)
    if (FusedRegion r; bias_grad_region(g, users, int(i), r)) {
      r.index = int(out.size());
      out.push_back(std::move(r));
    }

  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& lin = g.ops[i];
    if (lin.kind != OpKind::kernel || lin.name != "linear" || lin.inputs.size() != 4 || lin.inputs[3] >= 0 ||
        lin.outputs.size() != 1)
      continue;
    const int y = lin.outputs[0];
    const int by = buffer_of(g, y);
    const Value& yv = g.values[size_t(y)];
    if (g.buffers[size_t(by)].kind != BufferKind::temporary || read_after[size_t(by)] || yv.shape.size() != 2) continue;
    const int64_t n = numel(yv.shape);
    if (!whole(g, y, n)) continue;
    if (FusedRegion r; gelu_region(g, users[size_t(by)], int(i), r)) {
      r.index = int(out.size());
      out.push_back(std::move(r));
      continue;
    }
    if (!adds) continue;
    // Every later op on the product's buffer: views of it, then exactly one add.
    std::vector<int> views;
    int add = -1;
    bool ok = true;
    for (int k : users[size_t(by)]) {
      if (k <= int(i)) continue;
      const Op& o = g.ops[size_t(k)];
      if (add < 0 && o.kind == OpKind::view) {
        views.push_back(k);
      } else if (add < 0 && o.kind == OpKind::kernel && o.name == "add" && o.writes.empty() && o.inputs.size() == 2 &&
                 o.outputs.size() == 1) {
        add = k;
      } else {
        ok = false;
        break;
      }
    }
    if (!ok || add < 0) continue;
    const Op& a = g.ops[size_t(add)];
    const bool first = buffer_of(g, a.inputs[0]) == by, second = buffer_of(g, a.inputs[1]) == by;
    if (first == second) continue;  // the product on neither side, or on both (y + y)
    const int product_view = a.inputs[first ? 0 : 1], other = a.inputs[first ? 1 : 0];
    const int z = a.outputs[0];
    if (!whole(g, product_view, n) || !g.values[size_t(z)].contiguous() || g.values[size_t(z)].shape !=
        g.values[size_t(product_view)].shape)
      continue;
    if (fold_kind(g, lin, product_view, other) == Fold::none) continue;
    FusedRegion r;
    r.kind = RegionKind::gemm_epilogue;
    r.ops.push_back(int(i));
    r.ops.insert(r.ops.end(), views.begin(), views.end());
    r.ops.push_back(add);
    compute_region_io(g, r);
    if (r.outputs != std::vector<int>{z}) continue;
    r.bytes_saved = double(2 * g.buffers[size_t(by)].nbytes);  // the product written and read back
    r.index = int(out.size());
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

// {linear, views, gelu}: on the GPU in 16 bits, one GEMM writing gelu(x·wᵀ + b) and, as its
// auxiliary output, x·wᵀ + b (the backend's `linear_gelu`, cuBLASLt's GELU_AUX_BIAS); elsewhere the
// linear and the gelu kernels one after the other, eager's arithmetic.
FusedLaunch gelu_launch(const Graph& g, const FusedRegion& r) {
  const Op& lin = g.ops[size_t(r.ops.front())];
  const Op& ge = g.ops[size_t(r.ops.back())];
  const int sx = input_slot(r, lin.inputs[0]), sw = input_slot(r, lin.inputs[1]), sb = input_slot(r, lin.inputs[2]);
  const auto h = std::find(r.outputs.begin(), r.outputs.end(), ge.outputs[0]);
  BLU_CHECK(sb >= 0 && h != r.outputs.end() && r.outputs.size() >= 2, "epilogue_launch: region ", r.index,
            " is not a linear with its bias and a GELU");
  const int sh = int(h - r.outputs.begin()), sa = sh == 0 ? 1 : 0;  // any other output: the product
  const Value& y = g.values[size_t(lin.outputs[0])];
  const Shape rows_out = y.shape, row_major{y.shape[1], 1};
  const Backend& be = backend(y.device.type);
  const bool sixteen = y.dtype == DType::bf16 || y.dtype == DType::f16;
  const bool fits = sixteen && y.shape[1] % 8 == 0 && g.values[size_t(lin.inputs[2])].contiguous();
  const Kernel fused = fits ? be.find("linear_gelu") : nullptr;
  const Kernel linear = be.find("linear"), gelu = be.find("gelu");
  BLU_CHECK(linear && gelu, "epilogue_launch: no linear or gelu kernel for ", y.device);
  const int linear_op = r.ops.front(), gelu_op = r.ops.back();
  return [=](const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext& ctx) {
    std::array<Tensor, 2> result{out[size_t(sh)].alias_with(rows_out, row_major, out[size_t(sh)].offset()),
                                 out[size_t(sa)].alias_with(rows_out, row_major, out[size_t(sa)].offset())};
    const Attrs& lin_attrs = step.ops[size_t(linear_op)].attrs;
    if (fused) {
      std::array<Tensor, 3> args{in[size_t(sx)], in[size_t(sw)], in[size_t(sb)]};
      fused(KernelCall{"linear_gelu", args, result, lin_attrs, ctx});
      return;
    }
    std::array<Tensor, 4> args{in[size_t(sx)], in[size_t(sw)], in[size_t(sb)], Tensor()};
    linear(KernelCall{"linear", args, std::span<Tensor>(&result[1], 1), lin_attrs, ctx});
    std::array<Tensor, 1> pre{result[1]};
    gelu(KernelCall{"gelu", pre, std::span<Tensor>(&result[0], 1), step.ops[size_t(gelu_op)].attrs, ctx});
  };
}

// {gelu_and_backward, weight gradient}: on the GPU in 16 bits or fp32, the gelu_and_backward
// kernel with the bias gradient as its third output (the column sum the weight-gradient kernel
// would take, in the same order: the same bits), then the weight gradient without one; elsewhere
// the two kernels as captured.
FusedLaunch bias_grad_launch(const Graph& g, const FusedRegion& r) {
  const Op& a = g.ops[size_t(r.ops.front())];
  const Op& b = g.ops[size_t(r.ops.back())];
  const bool into = b.name == "linear_weight_grad_into";
  // An output on v's buffer (v itself, or a view of it that is read outside).
  auto buffer_slot = [&](int v) {
    const auto it = std::find_if(r.outputs.begin(), r.outputs.end(),
                                 [&](int o) { return g.values[size_t(o)].buffer == g.values[size_t(v)].buffer; });
    BLU_CHECK(it != r.outputs.end(), "epilogue_launch: no output of region ", r.index, " holds value %", v);
    return int(it - r.outputs.begin());
  };
  const int sg = input_slot(r, a.inputs[0]), sx = input_slot(r, a.inputs[1]);
  const int sh = buffer_slot(a.outputs[0]), sgu = buffer_slot(a.outputs[1]);
  // The weight gradient's operands: (gw, g, x[, gb]) in place, or (g, x) -> (gw, gb).
  const int sgw = into ? input_slot(r, b.inputs[0]) : output_slot(r, b.outputs[0]);
  const int sxw = input_slot(r, b.inputs[into ? 2 : 1]);
  const int sgb = into ? input_slot(r, b.inputs[3]) : output_slot(r, b.outputs[1]);
  const Value& gu = g.values[size_t(a.outputs[1])];
  const Value& gb = g.values[size_t(into ? b.inputs[3] : b.outputs[1])];
  const Shape g_shape = g.values[size_t(weight_grad_g(b))].shape, g_strides{g_shape[1], 1};
  const Shape made_shape = gu.shape, made_strides{gu.shape[1], 1};  // the GELU's and gu's (whole buffers)
  const Backend& be = backend(gu.device.type);
  const bool fits = gu.device.type == DeviceType::cuda &&
                    (gu.dtype == DType::bf16 || gu.dtype == DType::f16 || gu.dtype == DType::f32) &&
                    gu.shape[1] % (16 / int64_t(dtype_size(gu.dtype))) == 0 &&
                    (gb.dtype == gu.dtype || gb.dtype == DType::f32) && g.values[size_t(a.inputs[0])].contiguous() &&
                    g.values[size_t(a.inputs[1])].contiguous();
  const Kernel gelu = be.find("gelu_and_backward"), wgrad = be.find("linear_weight_grad_into");
  const Kernel captured = be.find(b.name);
  BLU_CHECK(gelu && wgrad && captured, "epilogue_launch: no gelu_and_backward or weight-gradient kernel for ",
            gu.device);
  const int gelu_op = r.ops.front(), wgrad_op = r.ops.back();
  return [=](const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext& ctx) {
    const Attrs& b_attrs = step.ops[size_t(wgrad_op)].attrs;
    const Tensor gw = into ? in[size_t(sgw)] : out[size_t(sgw)];
    const Tensor bias_grad = into ? in[size_t(sgb)] : out[size_t(sgb)];
    std::array<Tensor, 2> ga{in[size_t(sg)], in[size_t(sx)]};
    // Whole buffers: a view's binding starts where its buffer does.
    const Tensor h_out = out[size_t(sh)].alias_with(made_shape, made_strides, out[size_t(sh)].offset());
    const Tensor gu_out = out[size_t(sgu)].alias_with(made_shape, made_strides, out[size_t(sgu)].offset());
    const Tensor gw_g = gu_out.alias_with(g_shape, g_strides, gu_out.offset());  // the weight gradient's g
    if (fits) {
      std::array<Tensor, 3> made{h_out, gu_out, bias_grad};
      gelu(KernelCall{"gelu_and_backward", ga, made, step.ops[size_t(gelu_op)].attrs, ctx});
      ctx.scratch->reset();
      std::array<Tensor, 4> wa{gw, gw_g, in[size_t(sxw)], Tensor()};
      wgrad(KernelCall{"linear_weight_grad_into", wa, std::span<Tensor>(), b_attrs, ctx});
      return;
    }
    std::array<Tensor, 2> made{h_out, gu_out};
    gelu(KernelCall{"gelu_and_backward", ga, made, step.ops[size_t(gelu_op)].attrs, ctx});
    ctx.scratch->reset();
    if (into) {
      std::array<Tensor, 4> wa{gw, gw_g, in[size_t(sxw)], bias_grad};
      std::array<Tensor, 1> res{gw};
      captured(KernelCall{b.name, wa, res, b_attrs, ctx});
    } else {
      std::array<Tensor, 2> wa{gw_g, in[size_t(sxw)]};
      std::array<Tensor, 2> res{gw, bias_grad};
      captured(KernelCall{b.name, wa, res, b_attrs, ctx});
    }
  };
}

}  // namespace

FusedLaunch epilogue_launch(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(r.kind == RegionKind::gemm_epilogue && r.ops.size() >= 2, "epilogue_launch: region ", r.index,
            " is not a GEMM epilogue region");
  if (g.ops[size_t(r.ops.back())].name == "gelu") return gelu_launch(g, r);
  if (is_weight_grad(g.ops[size_t(r.ops.back())])) return bias_grad_launch(g, r);
  const Op& lin = g.ops[size_t(r.ops.front())];
  const Op& add = g.ops[size_t(r.ops.back())];
  const int pi = product_operand(g, r);
  const int other = add.inputs[size_t(1 - pi)];
  const Fold fold = fold_kind(g, lin, add.inputs[size_t(pi)], other);
  BLU_CHECK(fold != Fold::none, "epilogue_launch: region ", r.index, " has nothing to fold");
  const int sx = input_slot(r, lin.inputs[0]), sw = input_slot(r, lin.inputs[1]);
  const int sb = input_slot(r, fold == Fold::bias ? other : lin.inputs[2]);
  const int sr = fold == Fold::residual ? input_slot(r, other) : -1;
  const Value& y = g.values[size_t(lin.outputs[0])];
  const Shape rows_out = y.shape, row_major{y.shape[1], 1};
  const int64_t out_features = y.shape[1];
  const Kernel kernel = backend(y.device.type).find("linear");
  BLU_CHECK(kernel, "epilogue_launch: no linear kernel for ", y.device);
  const int linear_op = r.ops.front();
  return [=](const Graph& step, std::span<const Tensor> in, std::span<Tensor> out, const ExecContext& ctx) {
    const Tensor& z = out[0];
    std::array<Tensor, 4> args{in[size_t(sx)], in[size_t(sw)], Tensor(), Tensor()};
    if (sb >= 0) {
      const Tensor& b = in[size_t(sb)];
      args[2] = fold == Fold::bias ? b.alias_with(Shape{out_features}, Shape{1}, b.offset()) : b;
    }
    if (sr >= 0) args[3] = in[size_t(sr)].alias_with(rows_out, row_major, in[size_t(sr)].offset());
    std::array<Tensor, 1> result{z.alias_with(rows_out, row_major, z.offset())};
    kernel(KernelCall{"linear", args, result, step.ops[size_t(linear_op)].attrs, ctx});
  };
}

}  // namespace blu::compiler
