// core/tensor: Tensor, a handle to a strided view (shape, strides, offset, dtype) of a Storage,
// plus the autograd state a tensor carries (requires_grad, grad, the node that made it).
// The core knows no ops and no backends: factories and math live in ops/, the backward engine in
// autograd/. Depends on core/{dtype,shape,device,storage}. Keep: copying a Tensor copies the
// handle (like PyTorch), never the data; views share Storage; strides are in elements.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "blu/core/device.h"
#include "blu/core/dtype.h"
#include "blu/core/error.h"
#include "blu/core/host_reads.h"
#include "blu/core/shape.h"
#include "blu/core/storage.h"

namespace blu {

class Tensor;
struct Node;  // autograd/node.h

// Autograd state of one tensor. Only tensors that take part in autograd have one.
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Tensor> grad;           // accumulated gradient of a leaf (or a retained non-leaf)
  std::shared_ptr<Node> grad_fn;          // the node that produced this tensor; null for leaves
  uint32_t output_nr = 0;                 // which output of grad_fn this tensor is
  std::weak_ptr<Node> grad_accumulator;   // leaves: the node that accumulates into `grad`
  std::vector<std::function<void(Tensor&)>> grad_hooks;  // leaves: run after each accumulation
  std::shared_ptr<Tensor> grad_slot;      // leaves: where a fresh gradient goes (set_grad_slot)
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  std::unique_ptr<AutogradMeta> autograd;
};

class Tensor {
 public:
  Tensor() = default;  // undefined
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}
  // A view of `storage`. BLU_CHECK that the view stays inside the storage.
  Tensor(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return int64_t(impl().shape.size()); }
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return blu::numel(impl().shape); }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  size_t itemsize() const { return dtype_size(impl().dtype); }
  size_t nbytes() const { return size_t(numel()) * itemsize(); }
  Device device() const { return impl().storage->device(); }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }

  // Pointer to the first element (storage + offset). T is checked against dtype().
  void* raw_data() const;
  template <typename T>
  T* data() const {
    BLU_CHECK(dtype_of<T>::value == dtype(), "tensor of dtype ", dtype(), " read as ", dtype_of<T>::value);
    return static_cast<T*>(raw_data());
  }
  // The single element of a 1-element CPU tensor, converted to double. Counts as a host read
  // (core/host_reads.h).
  double item() const;

  // A view with other metadata over the same storage (no autograd link: see ops/view.h).
  Tensor alias_with(Shape shape, Shape strides, int64_t offset) const;

  // --- autograd state (the engine itself is in autograd/) ---
  bool requires_grad() const { return impl().autograd && impl().autograd->requires_grad; }
  // Marks a leaf as needing a gradient. BLU_CHECK: only floating dtypes, only leaves.
  Tensor& set_requires_grad(bool r = true);
  bool is_leaf() const { return !impl().autograd || !impl().autograd->grad_fn; }
  const std::shared_ptr<Node>& grad_fn() const;
  Tensor grad() const;  // undefined when none has been accumulated
  void set_grad(const Tensor& g);
  void zero_grad() { set_grad(Tensor()); }
  // Leaves: preassigned memory for the gradient (DistributedDataParallel's bucket view). When a
  // gradient arrives while grad() is undefined, the engine copies it into the slot and makes the
  // slot the grad, instead of keeping the incoming tensor; later arrivals add into it in place as
  // usual. zero_grad() leaves the slot alone. BLU_CHECK: a contiguous tensor of this leaf's
  // shape, dtype and device; an undefined one removes the slot.
  void set_grad_slot(const Tensor& slot);
  Tensor grad_slot() const;  // undefined when none is set
  // A tensor sharing this data with no autograd history.
  Tensor detach() const;
  // Runs `hook(grad)` each time a gradient has been accumulated into this leaf's grad. A hook may
  // release the gradient (zero_grad()); hooks after it then do not run for that gradient.
  void register_grad_hook(std::function<void(Tensor&)> hook);
  // Reverse-mode gradient of this (scalar unless `grad` is given) w.r.t. the leaves that need it.
  // Defined in autograd/engine.cpp.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;

  AutogradMeta& autograd_meta();  // creates it if missing
  const TensorImpl& impl() const {
    BLU_CHECK(impl_, "use of an undefined tensor");
    return *impl_;
  }
  TensorImpl& impl() {
    BLU_CHECK(impl_, "use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  std::string str() const;  // "Tensor[2, 3] f32 cpu"

 private:
  std::shared_ptr<TensorImpl> impl_;
};

inline std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace blu
