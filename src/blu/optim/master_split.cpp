#include "blu/optim/master_split.h"

#include <map>

#include "blu/core/grad_mode.h"
#include "blu/core/split_f32.h"
#include "blu/memory/memory_report.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"

namespace blu::optim {

namespace {

constexpr int64_t kAlign = 64;  // bytes: each parameter's low halves start on a 64-byte boundary

}  // namespace

// `master` (f32, CPU, contiguous) split on the CPU into e's compute copy and low halves, the copy
// current for the parameter from then on.
void SplitMasters::store(Entry& e, const Tensor& master) {
  const int64_t n = master.numel();
  Tensor hi = empty(master.shape(), DType::bf16), lo = empty({2 * n}, DType::u8);
  const float* m = master.data<float>();
  auto* h = static_cast<uint16_t*>(hi.raw_data());
  auto* l = static_cast<uint16_t*>(lo.raw_data());
  for (int64_t i = 0; i < n; ++i) split_f32(m[i], h[i], l[i]);
  copy_(e.copy->target(e.param), to_device(hi, e.low.device()));
  copy_(e.low, to_device(lo, e.low.device()));
  e.copy->mark_written(e.param);
}

// The fp32 master of a split parameter (its storage not viewing the host), on the CPU.
Tensor SplitMasters::joined_on_host(const Entry& e) const {
  const Tensor hi = to_device(e.copy->target(e.param), kCPU), lo = to_device(e.low, kCPU);
  Tensor master = empty(e.param.shape(), DType::f32);
  const auto* h = static_cast<const uint16_t*>(hi.raw_data());
  const auto* l = static_cast<const uint16_t*>(lo.raw_data());
  float* m = master.data<float>();
  for (int64_t i = 0; i < master.numel(); ++i) m[i] = join_f32(h[i], l[i]);
  return master;
}

SplitMasters::SplitMasters(const nn::NamedTensors& params, const nn::ComputeCopies& copies,
                           const std::function<bool(const std::string&, const Tensor&)>& accept) {
  NoGradGuard no_grad;
  std::map<const Storage*, int> views;  // parameter handles per storage: only a storage's sole view is split
  for (const auto& [name, p] : params) ++views[p.storage().get()];
  std::vector<std::pair<Entry, int64_t>> chosen;  // with each one's offset into lows_
  int64_t bytes = 0;
  for (const auto& [name, p] : params) {
    std::shared_ptr<nn::ComputeCopy> copy;
    for (const auto& [t, c] : copies)
      if (t.is_same(p)) copy = c;
    const Tensor target = copy ? copy->target(p) : Tensor();
    if (!target.defined() || !copy->current(p) || target.dtype() != DType::bf16 || !target.is_contiguous() ||
        p.dtype() != DType::f32 || !p.is_contiguous() || p.offset() != 0 || views[p.storage().get()] != 1 ||
        int64_t(p.storage()->nbytes()) != p.numel() * int64_t(sizeof(float)) || !accept(name, p))
      continue;
    BLU_CHECK(chosen.empty() || chosen.front().first.param.device() == p.device(),
              "split masters: the parameters must share one device, got ", chosen.front().first.param.device(),
              " and ", p.device(), " ('", name, "')");
    chosen.push_back({Entry{.param = p, .copy = copy}, bytes});
    bytes += (2 * p.numel() + kAlign - 1) / kAlign * kAlign;
  }
  if (chosen.empty()) return;
  const Device device = chosen.front().first.param.device();
  lows_ = empty({bytes}, DType::u8, device);
  tag_memory(lows_, MemoryCategory::parameters, "split master low halves");
  for (auto& [e, offset] : chosen) {
    const Tensor& p = e.param;
    e.low = narrow(lows_, 0, offset, 2 * p.numel());
    store(e, contiguous(to_device(p, kCPU)));
    p.storage()->data = DataPtr(nullptr, 0, device, nullptr, nullptr);  // the fp32 bytes go back
    elements_ += p.numel();
    entries_.push_back(std::move(e));
  }
}

// Split parameters keep their values: each takes over an fp32 master joined on the CPU (it is on
// the CPU from then on, as offload/offload_adamw.h leaves its released parameters).
SplitMasters::~SplitMasters() {
  try {
    if (viewing_) end_view();
    NoGradGuard no_grad;
    for (Entry& e : entries_) {
      Tensor host = joined_on_host(e);
      e.param.storage()->data = std::move(host.storage()->data);
    }
  } catch (...) {  // a destructor does not throw: the parameters then stay without bytes
  }
}

Tensor SplitMasters::low(const Tensor& param) const {
  for (const Entry& e : entries_)
    if (e.param.is_same(param)) return e.low;
  return {};
}

SplitMasters::View::View(SplitMasters* s) : s_(s) {
  if (s_) s_->begin_view();
}
SplitMasters::View::~View() {
  if (s_) s_->end_view();
}

void SplitMasters::begin_view() {
  BLU_CHECK(!viewing_, "split masters: a view of the parameters is already open");
  NoGradGuard no_grad;
  viewing_ = true;
  for (Entry& e : entries_) {
    e.host = joined_on_host(e);
    Storage& st = *e.param.storage();
    st.data = DataPtr(e.host.raw_data(), e.host.nbytes(), kCPU, nullptr, nullptr);
    e.version = st.version();
  }
}

// A master written through the view (a checkpoint load) goes back into its copy and low half; the
// copy is then current again.
void SplitMasters::end_view() {
  NoGradGuard no_grad;
  for (Entry& e : entries_) {
    Storage& st = *e.param.storage();
    const Device device = e.low.device();
    const bool written = st.version() != e.version;
    st.data = DataPtr(nullptr, 0, device, nullptr, nullptr);
    if (written) store(e, e.host);
    e.host = Tensor();
  }
  viewing_ = false;
}

}  // namespace blu::optim
