// compiler/mlir/fusion: the fusion pass over the step's blu module (translate.cpp) — which ops run
// together as one kernel. The rule and cost model are stated in mlir_api.h (fuse). Library calls
// (blu.library_call), collectives, views, in-place updates and opaque ops are barriers by kind:
// only blu ops without memory effects (pointwise, row_reduce) and blu.adamw_step are candidates,
// and a region is a connected set of them.
#include <algorithm>
#include <map>
#include <set>

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include "blu/compiler/mlir/dialect.h"
#include "blu/compiler/mlir/mlir_api.h"
#include "blu/compiler/mlir/mlir_impl.h"
#include "blu/core/error.h"

namespace blu::compiler::mlir_impl {
namespace {

int64_t value_numel(const Value& v) { return numel(v.shape); }
double value_bytes(const Value& v) { return double(value_numel(v)) * double(dtype_size(v.dtype)); }

// The iteration space of one op: n elements; for a row reduction also its row length.
struct Space {
  int64_t n = 0;
  int64_t row = 0;  // 0: pointwise
};

Space op_space(const Graph& g, const Op& op) {
  if (op_class(op.name) == OpClass::row) {
    const Value& x = g.values.at(size_t(op.inputs.at(op.name == "layer_norm_backward" || op.name == "rms_norm_backward" ? 1 : 0)));
    return {value_numel(x), x.shape.empty() ? 1 : x.shape.back()};
  }
  if (op_class(op.name) == OpClass::adamw) return {value_numel(g.values.at(size_t(op.inputs.at(0)))), 0};
  return {value_numel(g.values.at(size_t(op.outputs.at(0)))), 0};
}

// AdamW joins a region only as one parameter group without the norm gate.
bool fusible_here(const Op& op, const mlir_api::FusionOptions& opt) {
  if (op.kind != OpKind::kernel || (!op.writes.empty() && op_class(op.name) != OpClass::adamw)) return false;
  if (!is_fusible_op(op.name)) return false;
  if (op.attrs.has("class_offset")) return false;  // cross-entropy on a shard of the classes: its kernels
  if (std::find(opt.no_fuse.begin(), opt.no_fuse.end(), op.name) != opt.no_fuse.end()) return false;
  if (op_class(op.name) == OpClass::adamw)  // split masters (ops/optim.h) run their own kernel
    return op.attrs.i("gate") < 0 && op.inputs.size() == size_t(op.attrs.b("copies") ? 5 : 4) &&
           !op.attrs.has("split");
  return true;
}

struct Group {
  std::vector<int> ops;
  std::set<int> members;
  Space space;
  double saved = 0;
};

}  // namespace

std::vector<FusedRegion> fuse_module(mlir::ModuleOp module, const Graph& g, const mlir_api::FusionOptions& opt) {
  // Graph op index of every blu op, and the producer op of every value.
  std::vector<int> producer(g.values.size(), -1);
  for (size_t oi = 0; oi < g.ops.size(); ++oi)
    for (int v : g.ops[oi].outputs) producer[size_t(v)] = int(oi);
  std::vector<int> group_of(g.ops.size(), -1);
  std::vector<Group> groups;

  // Whether op q depends on any member of group gr (through any path), looking back no further
  // than the group's first op.
  auto depends_on = [&](int q, const Group& gr) {
    const int first = gr.ops.front();
    std::vector<int> stack{q};
    std::set<int> seen;
    while (!stack.empty()) {
      const int o = stack.back();
      stack.pop_back();
      if (o < first || !seen.insert(o).second) continue;
      if (gr.members.count(o)) return true;
      for (int v : g.ops[size_t(o)].inputs)
        if (v >= 0 && producer[size_t(v)] >= 0) stack.push_back(producer[size_t(v)]);
    }
    return false;
  };

  // Whether op q joining group gr would hold back a library call or collective: one between the
  // group's last op and q that reads what the group makes would wait for the region, which runs
  // where its last op is (compiler/fused_step.h), and every buffer live across it would live until
  // then. (The head's loss in row pieces: each piece's cross_entropy_backward reads the one loss
  // gradient, so without this one region took every piece's, and every piece's logits lived until
  // the last.)
  auto holds_back_library = [&](int q, const Group& gr) {
    for (int p = gr.ops.back() + 1; p < q; ++p) {
      const Op& o = g.ops[size_t(p)];
      const bool barrier = o.kind == OpKind::collective || (o.kind == OpKind::kernel && op_class(o.name) == OpClass::library);
      if (barrier && depends_on(p, gr)) return true;
    }
    return false;
  };

  module.walk([&](mlir::Operation* mop) {
    if (!llvm::isa<mlir_blu::BluDialect>(mop->getDialect())) return;
    // Candidates by their effects: pure blu ops of the pointwise/row kinds and the AdamW update.
    const bool candidate = llvm::isa<mlir_blu::PointwiseOp, mlir_blu::RowReduceOp, mlir_blu::AdamWStepOp>(mop) ||
                           (mlir::isPure(mop) && !llvm::isa<mlir_blu::ViewOp>(mop));
    if (!candidate) return;
    auto oid_attr = mop->getAttrOfType<mlir::IntegerAttr>("blu.oid");
    if (!oid_attr) return;
    const int oi = int(oid_attr.getInt());
    const Op& op = g.ops.at(size_t(oi));
    if (!fusible_here(op, opt)) return;
    const Space sp = op_space(g, op);
    int best = -1;
    double best_saved = 0;
    for (int v : op.inputs) {
      if (v < 0 || producer[size_t(v)] < 0) continue;
      const int gi = group_of[size_t(producer[size_t(v)])];
      if (gi < 0) continue;
      Group& gr = groups[size_t(gi)];
      // Same iteration space; rows of one length when both have rows.
      if (gr.space.n != sp.n || (gr.space.row && sp.row && gr.space.row != sp.row)) continue;
      // Inside a region every operand made in it covers the whole space (no broadcast of an
      // intermediate: that would need recomputation per element).
      double saved = 0;
      bool ok = true;
      for (int u : op.inputs) {
        if (u < 0 || producer[size_t(u)] < 0 || !gr.members.count(producer[size_t(u)])) continue;
        if (value_numel(g.values[size_t(u)]) != sp.n) ok = false;
        saved += 2 * value_bytes(g.values[size_t(u)]);  // its write and its re-read
      }
      for (int u : op.inputs)
        if (ok && u >= 0 && producer[size_t(u)] >= 0 && !gr.members.count(producer[size_t(u)]) &&
            producer[size_t(u)] > gr.ops.front() && depends_on(producer[size_t(u)], gr))
          ok = false;  // joining would make a cycle through an op outside the region
      if (ok && holds_back_library(oi, gr)) ok = false;
      if (ok && saved > best_saved) {
        best = gi;
        best_saved = saved;
      }
    }
    if (best >= 0 && best_saved >= opt.min_bytes_saved) {
      Group& gr = groups[size_t(best)];
      gr.ops.push_back(oi);
      gr.members.insert(oi);
      gr.saved += best_saved;
      if (sp.row) gr.space.row = sp.row;
      group_of[size_t(oi)] = best;
    } else {
      Group gr;
      gr.ops = {oi};
      gr.members = {oi};
      gr.space = sp;
      group_of[size_t(oi)] = int(groups.size());
      groups.push_back(std::move(gr));
    }
  });

  std::vector<FusedRegion> out;
  for (Group& gr : groups) {
    if (gr.ops.size() < 2) continue;
    FusedRegion r;
    r.index = int(out.size());
    r.shape = gr.space.row ? RegionShape::rows : RegionShape::pointwise;
    r.ops = gr.ops;
    r.bytes_saved = gr.saved;
    compute_region_io(g, r);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace blu::compiler::mlir_impl

namespace blu::compiler::mlir_api {

std::vector<FusedRegion> fuse(const Graph& g, const FusionOptions& opt) {
  mlir::MLIRContext ctx;
  mlir::OwningOpRef<mlir::ModuleOp> m = mlir_impl::build_module(ctx, g);
  return mlir_impl::fuse_module(m.get(), g, opt);
}

}  // namespace blu::compiler::mlir_api
