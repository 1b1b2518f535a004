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

}  // namespace

FusedLaunch epilogue_launch(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(r.kind == RegionKind::gemm_epilogue && r.ops.size() >= 2, "epilogue_launch: region ", r.index,
            " is not a GEMM epilogue region");
  if (g.ops[size_t(r.ops.back())].name == "gelu") return gelu_launch(g, r);
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
