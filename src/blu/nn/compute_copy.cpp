#include "blu/nn/compute_copy.h"

#include "blu/core/grad_mode.h"
#include "blu/memory/memory_report.h"
#include "blu/ops/view.h"

namespace blu::nn {

Tensor ComputeCopy::cast(const Tensor& param, DType dtype) {
  if (!param.defined() || param.dtype() == dtype) return param;
  if (!(copy_.defined() && copy_.dtype() == dtype && current(param))) {
    NoGradGuard no_grad;
    copy_ = to_dtype(param.detach(), dtype);  // a new tensor: graphs holding the old one keep it
    tag_memory(copy_, MemoryCategory::parameters, "16-bit compute copy");
    remember(param);
  }
  return cast_with_copy(param, copy_);
}

void ComputeCopy::cast_into(const Tensor& param, const Tensor& dest) {
  BLU_ASSERT(dest.shape() == param.shape() && dest.device() == param.device() &&
                 (dest.dtype() == DType::bf16 || dest.dtype() == DType::f16),
             "cast_into: ", dest.str(), " cannot hold a compute copy of ", param.str());
  NoGradGuard no_grad;
  blu::copy_(dest, param.detach());
  copy_ = dest;
  remember(param);
}

bool ComputeCopy::current(const Tensor& param) const {
  if (!copy_.defined()) return false;
  const std::shared_ptr<Storage> s = source_.lock();
  return s && s == param.storage() && s->version() == version_ && param.offset() == offset_ &&
         param.shape() == shape_ && param.strides() == strides_ && param.dtype() == dtype_;
}

Tensor ComputeCopy::target(const Tensor& param) const {
  if (!copy_.defined() || (copy_.dtype() != DType::bf16 && copy_.dtype() != DType::f16)) return Tensor();
  if (copy_.shape() != param.shape() || copy_.device() != param.device()) return Tensor();
  return copy_;
}

void ComputeCopy::mark_written(const Tensor& param) {
  BLU_ASSERT(copy_.defined() && copy_.shape() == param.shape(), "mark_written: no copy of ", param.str(),
             " was written");
  remember(param);
}

void ComputeCopy::reset() {
  copy_ = Tensor();
  source_.reset();
}

void ComputeCopy::remember(const Tensor& param) {
  source_ = param.storage();
  version_ = param.storage()->version();
  offset_ = param.offset();
  shape_ = param.shape();
  strides_ = param.strides();
  dtype_ = param.dtype();
}

}  // namespace blu::nn
