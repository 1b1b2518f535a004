// Every differentiable op in the OpInfo table against central finite differences, in float64,
// on contiguous and non-contiguous samples.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/opinfo.h"

namespace blu::test {
namespace {

// Element k (logical row-major index) of a CPU f64 tensor, by reference.
double& element(Tensor& t, int64_t k) {
  int64_t off = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    off += (k % t.shape()[d]) * t.strides()[d];
    k /= t.shape()[d];
  }
  return t.data<double>()[off];
}

bool takes_grad(const OpInfo& op, const std::vector<Tensor>& in, size_t i) {
  return in[i].defined() && in[i].dtype() == DType::f64 &&
         std::find(op.no_grad_inputs.begin(), op.no_grad_inputs.end(), int(i)) == op.no_grad_inputs.end();
}

TEST(GradCheck, EveryDifferentiableOp) {
  ASSERT_FALSE(opinfo_registry().empty());
  int checked = 0;
  for (const OpInfo& op : opinfo_registry()) {
    if (!op.differentiable) continue;
    Generator gen(1234);
    for (Sample& s : op.samples(DType::f64, gen)) {
      SCOPED_TRACE(op.name + " / " + s.desc);
      std::vector<Tensor>& in = s.inputs;
      for (size_t i = 0; i < in.size(); ++i)
        if (takes_grad(op, in, i)) in[i].set_requires_grad(true);
      Tensor out = op.fn(in);
      Tensor r = rnd(gen, out.shape(), DType::f64);
      sum(mul(out, r)).backward();
      auto objective = [&] {
        NoGradGuard ng;
        return sum(mul(op.fn(in), r)).item();
      };
      for (size_t i = 0; i < in.size(); ++i) {
        if (!takes_grad(op, in, i)) continue;
        Tensor analytic = in[i].grad();
        ASSERT_TRUE(analytic.defined()) << "no gradient reached input " << i;
        Tensor numeric = zeros(in[i].shape(), DType::f64);
        for (int64_t k = 0; k < in[i].numel(); ++k) {
          double& x = element(in[i], k);
          const double x0 = x;
          x = x0 + op.eps;
          const double fp = objective();
          x = x0 - op.eps;
          const double fm = objective();
          x = x0;
          element(numeric, k) = (fp - fm) / (2 * op.eps);
        }
        const std::string diff = compare(analytic, numeric, op.grad_atol, op.grad_rtol);
        EXPECT_EQ(diff, "") << "input " << i << " analytic vs numeric gradient";
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace blu::test
