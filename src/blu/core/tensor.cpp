#include "blu/core/tensor.h"

namespace blu {

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype) {
  BLU_CHECK(shape.size() == strides.size(), "shape ", shape, " and strides ", strides, " differ in rank");
  BLU_CHECK(offset >= 0, "negative storage offset ", offset);
  int64_t lo = offset, hi = offset;  // element range touched
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    BLU_CHECK(shape[i] >= 0, "negative size in shape ", shape);
    if (shape[i] == 0) empty = true;
    const int64_t span = (shape[i] - 1) * strides[i];
    (span < 0 ? lo : hi) += span;
  }
  if (!empty) {
    const int64_t cap = int64_t(storage->nbytes() / dtype_size(dtype));
    BLU_CHECK(lo >= 0 && hi < cap, "view ", shape, " strides ", strides, " offset ", offset,
              " reaches outside its storage of ", cap, " elements");
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  impl_ = std::move(impl);
}

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim())]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim())]; }

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  return static_cast<char*>(impl().storage->ptr()) + impl().offset * int64_t(itemsize());
}

double Tensor::item() const {
  BLU_CHECK(numel() == 1, "item() needs a tensor with one element, got shape ", shape());
  BLU_CHECK(device().is_cpu(), "item() reads CPU tensors; this one is on ", device(), " (copy it first)");
  count_host_read();
  double v = 0;
  BLU_DISPATCH_ALL(dtype(), "item", v = double(*static_cast<const scalar_t*>(raw_data())));
  return v;
}

Tensor Tensor::alias_with(Shape shape, Shape strides, int64_t offset) const {
  return Tensor(impl().storage, std::move(shape), std::move(strides), offset, dtype());
}

AutogradMeta& Tensor::autograd_meta() {
  auto& a = impl().autograd;
  if (!a) a = std::make_unique<AutogradMeta>();
  return *a;
}

Tensor& Tensor::set_requires_grad(bool r) {
  BLU_CHECK(!r || is_floating(dtype()), "only floating tensors can require gradients; this one is ", dtype());
  BLU_CHECK(is_leaf(), "requires_grad can only be set on a leaf tensor (one not computed by an op); use detach()");
  autograd_meta().requires_grad = r;
  return *this;
}

static const std::shared_ptr<Node> kNoNode;

const std::shared_ptr<Node>& Tensor::grad_fn() const {
  return impl().autograd ? impl().autograd->grad_fn : kNoNode;
}

Tensor Tensor::grad() const {
  const auto& a = impl().autograd;
  return a && a->grad ? *a->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) {
  if (g.defined()) {
    BLU_CHECK(g.shape() == shape() && g.dtype() == dtype() && g.device() == device(), "gradient ", g.str(),
              " does not match tensor ", str());
    autograd_meta().grad = std::make_shared<Tensor>(g);
  } else if (impl().autograd) {
    impl().autograd->grad.reset();
  }
}

void Tensor::set_grad_slot(const Tensor& slot) {
  if (slot.defined()) {
    BLU_CHECK(is_leaf(), "set_grad_slot: only leaves take a gradient slot; got ", str());
    BLU_CHECK(slot.shape() == shape() && slot.dtype() == dtype() && slot.device() == device() && slot.is_contiguous(),
              "set_grad_slot: the slot ", slot.str(), " must be contiguous and match tensor ", str());
    autograd_meta().grad_slot = std::make_shared<Tensor>(slot);
  } else if (impl().autograd) {
    impl().autograd->grad_slot.reset();
  }
}

Tensor Tensor::grad_slot() const {
  const auto& a = impl().autograd;
  return a && a->grad_slot ? *a->grad_slot : Tensor();
}

Tensor Tensor::detach() const {
  const auto& s = impl();
  return Tensor(s.storage, s.shape, s.strides, s.offset, s.dtype);
}

void Tensor::register_grad_hook(std::function<void(Tensor&)> hook) {
  BLU_CHECK(is_leaf() && requires_grad(), "gradient hooks go on leaves that require grad; got ", str());
  autograd_meta().grad_hooks.push_back(std::move(hook));
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return "Tensor" + to_string(shape()) + " " + std::string(dtype_name(dtype())) + " " + device().str();
}

}  // namespace blu
