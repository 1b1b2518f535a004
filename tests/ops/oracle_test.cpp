// Every op in the OpInfo table against PyTorch (Debian's python3-torch via /usr/bin/python3) in
// fp32: forward outputs and the gradients of every differentiable input, for the same upstream
// gradient. All cases go to PyTorch in one file and one process.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "blu/io/safetensors.h"
#include "common/opinfo.h"
#include "common/torch_oracle.h"

namespace blu::test {
namespace {

TEST(Oracle, EveryOpMatchesPyTorch) {
  struct Case {
    const OpInfo* op;
    std::string desc;
    std::vector<Tensor> inputs;
    Tensor out;
    std::vector<int> grad_inputs;
  };
  std::vector<Case> cases;
  TorchOracle oracle;
  nlohmann::json manifest = nlohmann::json::array();
  for (const OpInfo& op : opinfo_registry()) {
    Generator gen(99);
    for (Sample& s : op.samples(DType::f32, gen)) {
      Case c{&op, s.desc, s.inputs, {}, {}};
      const std::string id = "c" + std::to_string(cases.size());
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        if (!c.inputs[i].defined()) continue;
        oracle.put(id + "_x" + std::to_string(i), c.inputs[i]);
        if (op.differentiable && c.inputs[i].dtype() == DType::f32 &&
            std::find(op.no_grad_inputs.begin(), op.no_grad_inputs.end(), int(i)) == op.no_grad_inputs.end()) {
          c.inputs[i].set_requires_grad(true);
          c.grad_inputs.push_back(int(i));
        }
      }
      c.out = op.fn(c.inputs);
      if (!c.grad_inputs.empty()) {
        Tensor r = rnd(gen, c.out.shape(), DType::f32);
        oracle.put(id + "_r", r);
        c.out.backward(r);
      }
      manifest.push_back({{"id", id},
                          {"expr", op.torch},
                          {"n_inputs", c.inputs.size()},
                          {"grad_inputs", c.grad_inputs}});
      cases.push_back(std::move(c));
    }
  }
  auto results = oracle.run("ops/torch_ops.py", manifest);
  ASSERT_FALSE(cases.empty());
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(c.op->name + " / " + c.desc);
    const std::string id = "c" + std::to_string(k);
    Tensor want = results.get(id + "_out");
    EXPECT_EQ(compare(c.out.detach(), want, c.op->oracle_atol, c.op->oracle_rtol), "") << "forward";
    for (int i : c.grad_inputs) {
      Tensor g = c.inputs[i].grad();
      ASSERT_TRUE(g.defined()) << "no gradient for input " << i;
      EXPECT_EQ(compare(g, results.get(id + "_g" + std::to_string(i)), c.op->oracle_atol, c.op->oracle_rtol), "")
          << "gradient of input " << i;
    }
  }
}

}  // namespace
}  // namespace blu::test
