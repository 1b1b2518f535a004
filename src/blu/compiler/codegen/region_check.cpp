// compiler/codegen/region_check: see region_check.h.
#include "blu/compiler/codegen/region_check.h"

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

double check_region(const Graph& g, const FusedRegion& r, const CpuKernel& k, const std::vector<Tensor>& ins) {
  NoGradGuard no_grad;
  const std::vector<Tensor> eager = run_region_eager(g, r, ins);
  const std::vector<Tensor> fused = alloc_region_outputs(g, r);
  k.run(ins, fused, region_scalars(g, r));
  double worst = 0;
  for (size_t j = 0; j < fused.size(); ++j) {
    const Tensor a = contiguous(to_dtype(fused[j], DType::f64)), b = contiguous(to_dtype(eager[j], DType::f64));
    const double* pa = a.data<double>();
    const double* pb = b.data<double>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = std::isnan(pa[i]) && std::isnan(pb[i]) ? 0.0 : std::abs(pa[i] - pb[i]);
      if (!(d <= worst)) worst = d;  // NaN against a number counts as the worst
    }
  }
  if (compile_check_enabled())
    std::fprintf(stderr, "compile check: region %d (%zu ops): max |diff| %.3g\n", r.index, r.ops.size(), worst);
  return worst;
}

}  // namespace blu::compiler
