// optim/state_io (internal to optim/): the parts every optimizer shares — the flat list of
// parameters behind its groups, and strict parsing of named state for load_state().
// Depends on core/, nn/module.h (NamedTensors). Keep: parse_state checks everything and changes
// nothing, so a load that fails leaves the optimizer as it was.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "blu/optim/optimizer.h"

namespace blu::optim::detail {

struct ParamRef {
  std::string name;
  Tensor param;
  double weight_decay;
};
// Every parameter of every group, in order. BLU_CHECK: defined, f32, names and tensors unique.
std::vector<ParamRef> flatten_groups(const std::vector<ParamGroup>& groups, const char* optimizer);
// The parameter's gradient (undefined when it has none), checked to have its shape and dtype.
inline Tensor checked_grad(const ParamRef& p, const char* optimizer) {
  const Tensor g = p.param.grad();
  BLU_CHECK(!g.defined() || (g.dtype() == p.param.dtype() && g.shape() == p.param.shape()), optimizer,
            ": gradient of '", p.name, "' is ", g.str(), ", expected the parameter's shape and dtype (",
            p.param.str(), ")");
  return g;
}

// One kind of per-parameter state: "<kind>.<param name>", shaped like the parameter or 0-d.
struct StateKind {
  const char* kind;
  bool scalar;  // 0-d (a count) rather than the parameter's shape
};
struct ParsedState {
  int64_t step = 0;
  // per parameter (index into the flat list): one tensor per kind, or empty when it has no state
  std::vector<std::vector<Tensor>> per_param;
};
ParsedState parse_state(const nn::NamedTensors& state, const std::vector<ParamRef>& params,
                        const std::vector<StateKind>& kinds, const char* optimizer);

// A 0-d i64 tensor holding v, and its inverse (accepts i64/f64/i32 holding an integral value).
Tensor count_tensor(int64_t v);
int64_t read_count(const Tensor& t, const std::string& name);
// A fresh f32 copy of `src` on `like`'s device, shaped like `like`.
Tensor f32_copy(const Tensor& src, const Tensor& like);

// Note [Optimizer state in one buffer]
// Per-parameter state (AdamW's two moments) lives as long as the run, so it is made as one
// allocation per device and kind, each parameter's tensor a contiguous view starting on a 64-byte
// boundary (the CPU pools' rounding, and past the 16 bytes of the GPU kernels' vector loads).
// Made one by one, a model's moments are as many allocations as it has parameters, each rounded by
// the device allocator and placed in whatever freed block the first step left; one allocation
// holds their bytes and leaves no hole for a later step to fill. The cached free segments of the
// device's allocator are given back before it is made (the first backward's activations, freed by
// then). The allocation is tagged as optimizer state (memory/memory_report.h) with `label`.
// packed_zeros gives zeros of `dtype` shaped like each of `likes`; packed_copies gives copies of
// `values[i]` converted to `dtype` (copy_: to nearest) shaped like `likes[i]` (a loaded checkpoint's
// state), in the same layout.
std::vector<Tensor> packed_zeros(const std::vector<Tensor>& likes, const char* label, DType dtype = DType::f32);
std::vector<Tensor> packed_copies(const std::vector<Tensor>& values, const std::vector<Tensor>& likes,
                                  const char* label, DType dtype = DType::f32);

}  // namespace blu::optim::detail
