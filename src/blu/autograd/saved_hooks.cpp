#include "blu/autograd/saved_hooks.h"

#include <vector>

namespace blu {

namespace {

thread_local std::vector<PackHook>* t_hooks = nullptr;

std::vector<PackHook>& hooks() {
  thread_local std::vector<PackHook> h;
  t_hooks = &h;
  return h;
}

}  // namespace

SavedTensorHooks::SavedTensorHooks(PackHook pack) { hooks().push_back(std::move(pack)); }
SavedTensorHooks::~SavedTensorHooks() { hooks().pop_back(); }

bool saved_hooks_active() { return t_hooks && !t_hooks->empty(); }

std::shared_ptr<SavedBox> pack_saved(const Tensor& t, bool fresh) {
  if (!saved_hooks_active()) return nullptr;
  std::vector<PackHook>& h = hooks();
  // Hide hook i and those inside it while it runs: its own ops must not be packed by itself.
  for (size_t i = h.size(); i-- > 0;) {
    std::vector<PackHook> hidden(h.begin() + std::ptrdiff_t(i), h.end());
    h.resize(i);
    std::shared_ptr<SavedBox> box;
    try {
      box = hidden.front()({t, fresh});
    } catch (...) {
      h.insert(h.end(), hidden.begin(), hidden.end());
      throw;
    }
    h.insert(h.end(), hidden.begin(), hidden.end());
    if (box) return box;
  }
  return nullptr;
}

SavedSlot SavedSlot::save(const Tensor& t, bool fresh) {
  SavedSlot s;
  if (!t.defined()) return s;
  s.box = pack_saved(t, fresh);
  if (!s.box) s.tensor = t.detach();
  return s;
}

}  // namespace blu
