#include "blu/ops/dispatch.h"

#include <map>

#include "blu/backend/backend.h"
#include "blu/core/grad_mode.h"
#include "blu/memory/allocator.h"
#include "blu/ops/factory.h"
#include "blu/ops/meta_dispatch.h"

namespace blu {

const Tensor& BackwardContext::input(size_t i) const {
  BLU_ASSERT(i < inputs.size() && inputs[i].defined(), op->name, ": backward reads input ", i,
             " which was not saved (add it to save_inputs)");
  return inputs[i];
}
const Tensor& BackwardContext::output(size_t i) const {
  BLU_ASSERT(i < outputs.size() && outputs[i].defined(), op->name, ": backward reads output ", i,
             " which was not saved (add it to save_outputs)");
  return outputs[i];
}

static thread_local RefCounter t_ref_counter;
void set_ref_counter(RefCounter counter) { t_ref_counter = std::move(counter); }
RefCounts eager_ref_counts(const Tensor& t) {
  if (t_ref_counter) return t_ref_counter(t);
  return {t.impl_ptr().use_count(), t.storage().use_count()};
}

static Tensor donated(bool released_after, const std::vector<Tensor>& saved, size_t i) {
  if (!released_after || i >= saved.size()) return {};
  const Tensor& t = saved[i];
  return t.defined() && t.is_contiguous() && eager_ref_counts(t).storage == 1 ? t : Tensor();
}
Tensor BackwardContext::donated_input(size_t i) const { return donated(saved_released_after, inputs, i); }
Tensor BackwardContext::donated_output(size_t j) const { return donated(saved_released_after, outputs, j); }

Tensor BackwardContext::grad_buffer(size_t i) const {
  if (Tensor dst = grad_destination(i); dst.defined()) return dst;
  const TensorMeta& m = input_metas.at(i);
  return empty(m.shape, grad_dtype(i), m.device);
}

static thread_local bool t_meta = false;
bool meta_dispatch() { return t_meta; }
MetaDispatchGuard::MetaDispatchGuard(bool on) : prev_(t_meta) { t_meta = on; }
MetaDispatchGuard::~MetaDispatchGuard() { t_meta = prev_; }

static GradRecorder g_recorder = nullptr;
void set_grad_recorder(GradRecorder rec) { g_recorder = rec; }

static std::map<int, OpObserver>& observers() {
  static std::map<int, OpObserver> m;
  return m;
}
static int g_next_observer = 0;
void check_pending_grad(std::string_view op, std::span<const Tensor> in, size_t i, const Tensor& x) {
  if (i >= in.size() || !in[i].defined()) return;
  const Tensor& p = in[i];
  BLU_ASSERT(p.shape() == x.shape() && p.dtype() == x.dtype() && p.is_contiguous(), op, ": pending gradient ",
             p.str(), " for input ", x.str());
}

int add_op_observer(OpObserver obs) {
  observers().emplace(g_next_observer, std::move(obs));
  return g_next_observer++;
}
void remove_op_observer(int handle) { observers().erase(handle); }

// The op's kernel for device type `type`: the one cached in the OpDef, else looked up by name in
// the backend's table and cached (a thread racing this one stores the same pointer). A missing
// kernel is not cached: the caller reports it.
static Kernel kernel_for(const OpDef& op, DeviceType type) {
  std::atomic<Kernel>& slot = op.kernel_cache[size_t(type)];
  if (Kernel k = slot.load(std::memory_order_acquire)) return k;
  const Kernel k = backend(type).find(op.name);
  if (k) slot.store(k, std::memory_order_release);
  return k;
}

std::vector<Tensor> dispatch(const OpDef& op, std::vector<Tensor> in, const Attrs& attrs) {
  // 1. Arguments.
  Device device = kCPU;
  bool have_device = false;
  bool any_requires_grad = false;
  for (size_t i = 0; i < in.size(); ++i) {
    if (!in[i].defined()) {
      BLU_CHECK(i < 32 && (op.optional_inputs >> i & 1u), op.name, ": input ", i, " is undefined");
      continue;
    }
    if (!have_device) {
      device = in[i].device();
      have_device = true;
    }
    BLU_CHECK(op.cross_device || in[i].device() == device, op.name, ": inputs are on different devices (input 0 on ", device,
              ", input ", i, " on ", in[i].device(), ")");
    any_requires_grad |= in[i].requires_grad();
  }
  std::vector<TensorMeta> metas = op.infer(in, attrs);
  const bool record = g_recorder && op.backward && any_requires_grad && GradMode::enabled();

  // 2. Outputs and compute.
  std::vector<Tensor> out;
  if (op.view) {
    out = op.view(in, attrs);
  } else {
    out.reserve(metas.size());
    if (op.inplace) {
      BLU_CHECK(!(GradMode::enabled() && in[0].requires_grad()), op.name,
                ": in-place op on a tensor that requires grad (use it under NoGradGuard, or the out-of-place op)");
      out.push_back(in[0]);
    }
    // Outputs live where infer says; the kernel runs on the accelerator when one is involved
    // (a copy between host and device is the device backend's work).
    Device kernel_device = have_device ? device : (metas.empty() ? kCPU : metas[0].device);
    for (const TensorMeta& m : metas)
      if (!m.device.is_cpu()) kernel_device = m.device;
    for (const Tensor& t : in)
      if (t.defined() && !t.device().is_cpu()) kernel_device = t.device();
    for (size_t j = out.size(); j < metas.size(); ++j) {
      const TensorMeta& m = metas[j];
      const Device d = m.device;
      const size_t nbytes = size_t(numel(m.shape)) * dtype_size(m.dtype);
      auto storage = std::make_shared<Storage>(t_meta ? DataPtr(nullptr, nbytes, d, nullptr, nullptr)
                                                      : allocator_for(d).allocate(nbytes));
      out.emplace_back(std::move(storage), m.shape, contiguous_strides(m.shape), 0, m.dtype);
    }
    const Kernel k = kernel_for(op, kernel_device.type);
    BLU_CHECK(k, op.name, ": no kernel for device ", kernel_device);
    if (!t_meta) {  // Note [Meta dispatch]
      const ExecContext& ctx = current_context(kernel_device);  // Note [Execution context]
      ctx.scratch->reset();
      k(KernelCall{op.name, in, out, attrs, ctx});
    }
    if (op.inplace)
      for (size_t i = 0; i < in.size(); ++i)
        if (in[i].defined() && (op.writes ? op.writes(i, attrs) : i == 0)) in[i].storage()->bump_version();
  }

  // 3. Observers.
  for (auto& [h, obs] : observers()) obs(op, in, out, attrs);

  // 4. Autograd.
  if (record) g_recorder(op, in, out, attrs);
  return out;
}

}  // namespace blu
