// memory/memory_report: tags of live device blocks and the out-of-memory explanation (header).
#include "blu/memory/memory_report.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "blu/memory/allocator.h"
#include "blu/memory/caching_allocator.h"

namespace blu {

const char* category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::optimizer_state: return "optimizer state";
    case MemoryCategory::workspaces: return "workspaces";
  }
  return "?";
}

void MemoryTags::set(void* ptr, MemoryTag tag) {
  std::lock_guard lock(mu_);
  tags_[ptr] = std::move(tag);
}
void MemoryTags::erase(void* ptr) {
  std::lock_guard lock(mu_);
  tags_.erase(ptr);
}
MemoryTag MemoryTags::get(void* ptr) const {
  std::lock_guard lock(mu_);
  auto it = tags_.find(ptr);
  return it == tags_.end() ? MemoryTag{} : it->second;
}

void tag_memory(const Tensor& t, MemoryCategory category, const std::string& label) {
  if (!t.defined() || !t.storage()) return;
  allocator_for(t.device()).tag(t.storage()->ptr(), MemoryTag{category, label});
}

int64_t MemoryReport::live() const {
  int64_t s = 0;
  for (int64_t b : by_category) s += b;
  return s;
}

MemoryReport make_memory_report(std::string device, int64_t requested, int64_t limit, int64_t cached,
                                const std::vector<LiveBlock>& live) {
  MemoryReport r;
  r.device = std::move(device);
  r.requested = requested;
  r.limit = limit;
  r.cached = cached;
  for (const LiveBlock& b : live) r.by_category[size_t(b.tag.category)] += b.bytes;
  r.largest = live;
  std::stable_sort(r.largest.begin(), r.largest.end(), [](const LiveBlock& a, const LiveBlock& b) { return a.bytes > b.bytes; });
  if (r.largest.size() > 8) r.largest.resize(8);
  return r;
}

static std::function<std::string(const MemoryReport&)>& oom_advice() {
  static std::function<std::string(const MemoryReport&)> f;
  return f;
}
void set_oom_advice(std::function<std::string(const MemoryReport&)> advice) { oom_advice() = std::move(advice); }

std::string explain_oom(const MemoryReport& r) {
  std::ostringstream os;
  os << r.device << ": out of memory allocating " << format_bytes(r.requested) << " (" << r.requested << " bytes)";
  if (r.limit > 0) os << " with " << format_bytes(r.live() + r.cached) << " in use of a limit of " << format_bytes(r.limit);
  os << ".\n  memory by category:";
  for (int c = 0; c < kNumMemoryCategories; ++c)
    os << "\n    " << category_name(MemoryCategory(c)) << ": " << format_bytes(r.by_category[size_t(c)]);
  os << "\n    cache: " << format_bytes(r.cached);
  if (!r.largest.empty()) {
    os << "\n  largest live tensors:";
    for (const LiveBlock& b : r.largest)
      os << "\n    " << format_bytes(b.bytes) << "  " << category_name(b.tag.category)
         << (b.tag.label.empty() ? "" : "  " + b.tag.label);
  }
  const int64_t need = r.live() + r.requested;
  const double gib = double(int64_t(1) << 30);
  os << "\n  what would fit: a budget of at least " << format_bytes(need) << " (--gpu-memory-budget "
     << std::ceil(double(need) / gib * 100) / 100 << ") holds what is live plus this request";
  const int64_t state = r.by_category[size_t(MemoryCategory::optimizer_state)];
  const int64_t params = r.by_category[size_t(MemoryCategory::parameters)];
  const int64_t grads = r.by_category[size_t(MemoryCategory::gradients)];
  const int64_t short_by = r.limit > 0 ? need + r.cached - r.limit : r.requested;
  if (state > 0)
    os << "; offloading the optimizer state to the host (--offload-state optimizer) frees " << format_bytes(state)
       << (state >= short_by ? ", enough for this request" : ", not enough alone");
  // The fp32 parameters go too under --offload-state master (bf16/fp16: their 16-bit copies and the
  // embeddings stay, so "up to"), their gradients under master+grads.
  if (params > 0 && state < short_by)
    os << "; with the fp32 parameters (--offload-state master, bf16/fp16) up to " << format_bytes(state + params);
  if (grads > 0 && state + params < short_by)
    os << "; with their gradients too (--offload-state master+grads, one rank) up to "
       << format_bytes(state + params + grads);
  if (const auto& f = oom_advice()) {
    const std::string extra = f(r);
    if (!extra.empty()) os << "\n  " << extra;
  }
  return os.str();
}

}  // namespace blu
