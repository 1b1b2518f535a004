// compiler/codegen/region_check: see region_check.h.
#include "blu/compiler/codegen/region_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "blu/core/grad_mode.h"
#include "blu/ops/dispatch.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::compiler {

bool compile_check_enabled() {
  const char* e = std::getenv("BLU_COMPILE_CHECK");
  return e && std::string(e) == "1";
}

std::vector<Tensor> run_region_eager(const Graph& g, const FusedRegion& r, const std::vector<Tensor>& ins) {
  std::map<int, Tensor> env;
  for (size_t i = 0; i < r.inputs.size(); ++i) env[r.inputs[i]] = ins.at(i);
  for (int oi : r.ops) {
    const Op& op = g.ops.at(size_t(oi));
    BLU_CHECK(op.def, "compile check: op ", oi, " (", op.name, ") has no OpDef to replay");
    std::vector<Tensor> args;
    for (int v : op.inputs) args.push_back(v < 0 ? Tensor() : env.at(v));
    std::vector<Tensor> outs = dispatch(*op.def, std::move(args), op.attrs);
    for (size_t j = 0; j < op.outputs.size() && j < outs.size(); ++j) env[op.outputs[j]] = outs[j];
  }
  std::vector<Tensor> res;
  for (int v : r.outputs) res.push_back(env.at(v));
  return res;
}

std::vector<Tensor> alloc_region_outputs(const Graph& g, const FusedRegion& r) {
  std::vector<Tensor> outs;
  for (int v : r.outputs) outs.push_back(empty(g.values.at(size_t(v)).shape, g.values.at(size_t(v)).dtype));
  return outs;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  BLU_CHECK(a.shape() == b.shape(), "compile check: comparing ", a.str(), " with ", b.str());
  const Tensor x = contiguous(to_dtype(to_device(a, kCPU), DType::f64));
  const Tensor y = contiguous(to_dtype(to_device(b, kCPU), DType::f64));
  const double* pa = x.data<double>();
  const double* pb = y.data<double>();
  double worst = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    // Equal values (infinities of one sign included) and NaN against NaN differ by nothing.
    const double d = pa[i] == pb[i] || (std::isnan(pa[i]) && std::isnan(pb[i])) ? 0.0 : std::abs(pa[i] - pb[i]);
    if (std::isnan(d)) return d;  // NaN against a number is the worst there is
    worst = std::max(worst, d);
  }
  return worst;
}

double check_region(const Graph& g, const FusedRegion& r, const CpuKernel& k, const std::vector<Tensor>& ins) {
  NoGradGuard no_grad;
  const std::vector<Tensor> eager = run_region_eager(g, r, ins);
  const std::vector<Tensor> fused = alloc_region_outputs(g, r);
  k.run(ins, fused, region_scalars(g, r));
  double worst = 0;
  for (size_t j = 0; j < fused.size(); ++j) worst = worse_diff(worst, max_abs_diff(fused[j], eager[j]));
  if (compile_check_enabled())
    std::fprintf(stderr, "compile check: region %d (%zu ops): max |diff| %.3g\n", r.index, r.ops.size(), worst);
  return worst;
}

}  // namespace blu::compiler
