// tests/common/opinfo: the op table the generic op tests run over (in the spirit of PyTorch's
// OpInfo). Each entry names an op, how to call it, sample inputs for a dtype, and the same
// computation as a PyTorch expression. Generic tests then check, for every entry and sample:
//   - gradcheck: analytic gradients against central finite differences in float64;
//   - oracle: forward outputs and input gradients against PyTorch (/usr/bin/python3) in fp32.
// How to add an op: write a file tests/ops/opinfo_<family>.cpp with a BLU_OPINFO(...) block.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "blu/blu.h"

namespace blu::test {

struct Sample {
  std::vector<Tensor> inputs;  // floating inputs get gradients (unless listed in no_grad_inputs)
  std::string desc;
};

struct OpInfo {
  std::string name;
  // The op under test. Must return one tensor (pick/stack multiple outputs in the lambda).
  std::function<Tensor(const std::vector<Tensor>&)> fn;
  // Samples with floating inputs of `dtype`; use `gen` for every random draw.
  std::function<std::vector<Sample>(DType dtype, Generator& gen)> samples;
  // PyTorch expression over x0, x1, ... (torch tensors) and `torch`/`F` (torch.nn.functional).
  std::string torch;
  bool differentiable = true;
  std::vector<int> no_grad_inputs;  // floating inputs that are not differentiated
  double oracle_atol = 1e-5, oracle_rtol = 1e-4;
  double grad_atol = 1e-6, grad_rtol = 1e-4;
  double eps = 1e-6;  // finite-difference step
};

std::vector<OpInfo>& opinfo_registry();
struct OpInfoRegistrar {
  explicit OpInfoRegistrar(std::vector<OpInfo> ops);
};

// Random inputs: normal values, and the same values in a non-contiguous layout.
Tensor rnd(Generator& g, const Shape& shape, DType dtype);
Tensor rnd_positive(Generator& g, const Shape& shape, DType dtype, double lo = 0.5);  // values in (lo, lo+1)
// The same values as t, laid out transposed in memory (a strided view of a fresh buffer).
Tensor noncontig(const Tensor& t);

// Compare tensors elementwise; returns "" when close, else a description of the worst element.
std::string compare(const Tensor& got, const Tensor& want, double atol, double rtol);

}  // namespace blu::test

#define BLU_OPINFO(...) \
  static ::blu::test::OpInfoRegistrar BLU_CONCAT(blu_opinfo_, __COUNTER__)(std::vector<::blu::test::OpInfo>{__VA_ARGS__})
