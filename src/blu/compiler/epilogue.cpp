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

}  // namespace

std::vector<FusedRegion> epilogue_regions(const Graph& g) {
  std::vector<FusedRegion> out;
  if (op_excluded("linear") || op_excluded("add")) return out;
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

FusedLaunch epilogue_launch(const Graph& g, const FusedRegion& r) {
  BLU_CHECK(r.kind == RegionKind::gemm_epilogue && r.ops.size() >= 2, "epilogue_launch: region ", r.index,
            " is not a GEMM epilogue region");
  const Op& lin = g.ops[size_t(r.ops.front())];
  const Op& add = g.ops[size_t(r.ops.back())];
  const int pi = product_operand(g, r);
  const int other = add.inputs[size_t(1 - pi)];
  const Fold fold = fold_kind(g, lin, add.inputs[size_t(pi)], other);
  BLU_CHECK(fold != Fold::none, "epilogue_launch: region ", r.index, " has nothing to fold");
  auto slot = [&](int v) {
    if (v < 0) return -1;
    const auto it = std::find(r.inputs.begin(), r.inputs.end(), v);
    BLU_CHECK(it != r.inputs.end(), "epilogue_launch: value %", v, " is not an input of region ", r.index);
    return int(it - r.inputs.begin());
  };
  const int sx = slot(lin.inputs[0]), sw = slot(lin.inputs[1]);
  const int sb = fold == Fold::bias ? slot(other) : slot(lin.inputs[2]);
  const int sr = fold == Fold::residual ? slot(other) : -1;
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
