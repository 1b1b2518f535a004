#include "blu/ops/early_grad.h"

namespace blu {

namespace {
thread_local const EarlyGradFn* t_listener = nullptr;
}  // namespace

EarlyGradScope::EarlyGradScope(const EarlyGradFn* fn) : prev_(t_listener) { t_listener = fn; }
EarlyGradScope::~EarlyGradScope() { t_listener = prev_; }

void input_grad_ready(size_t input, const Tensor& grad) {
  if (t_listener && *t_listener) (*t_listener)(input, grad);
}

}  // namespace blu
