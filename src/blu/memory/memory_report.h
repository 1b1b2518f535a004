// memory/memory_report: what device memory holds, by category, and the out-of-memory message built
// from it. A component that creates a long-lived tensor tags its bytes (tag_memory: parameters,
// gradients, optimizer state, workspaces); everything untagged counts as activations. The device
// allocators (memory/device_pool for cpu:N, the CUDA caching allocator) keep the tags of their live
// blocks and, when a request does not fit, throw an OutOfMemoryError whose message shows memory by
// category, the largest live blocks, and a budget or layout that would fit.
// Depends on core/ (error, tensor). Keep: tagging is a map update per tensor, never per op; a tag
// names bytes, it does not own them (the block's free drops it); the report is built only on failure.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "blu/core/error.h"
#include "blu/core/tensor.h"

namespace blu {

enum class MemoryCategory : uint8_t { activations, parameters, gradients, optimizer_state, workspaces };
inline constexpr int kNumMemoryCategories = 5;
const char* category_name(MemoryCategory c);

// The live allocation's tag: its category and, for the largest-tensor list, a name.
struct MemoryTag {
  MemoryCategory category = MemoryCategory::activations;
  std::string label;
};

// Tags of live blocks, by the block's address. Thread-safe.
class MemoryTags {
 public:
  void set(void* ptr, MemoryTag tag);
  void erase(void* ptr);
  MemoryTag get(void* ptr) const;  // activations, unlabelled, when untagged

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, MemoryTag> tags_;
};

// Tags `t`'s storage with `category` (and `label`) in its device's allocator. A no-op on
// allocators that keep no tags (host memory).
void tag_memory(const Tensor& t, MemoryCategory category, const std::string& label = {});

struct LiveBlock {
  int64_t bytes = 0;
  MemoryTag tag;
};

// What a device held when a request failed.
struct MemoryReport {
  std::string device;         // "cpu:1", "cuda:0"
  int64_t requested = 0;      // the failing request
  int64_t limit = 0;          // the budget or capacity it did not fit (0: unknown)
  int64_t cached = 0;         // reserved but free (the caching allocator's cache)
  std::array<int64_t, kNumMemoryCategories> by_category{};
  std::vector<LiveBlock> largest;  // the largest live blocks, largest first (at most 8)
  int64_t live() const;            // sum of by_category
};
MemoryReport make_memory_report(std::string device, int64_t requested, int64_t limit, int64_t cached,
                                const std::vector<LiveBlock>& live);
// The message: the request and limit, memory by category with the cache, the largest blocks, and
// what would fit — the smallest budget that holds what is live plus the request, and the bytes that
// offloading the optimizer state (and gradients) would free, plus any advice installed below.
std::string explain_oom(const MemoryReport& r);
// Extra advice for explain_oom (the offload planner names the layout that fits); empty: none.
void set_oom_advice(std::function<std::string(const MemoryReport&)> advice);

// Thrown by the device allocators when a request does not fit; a blu::Error like every BLU_CHECK.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& what, MemoryReport report) : Error(what), report_(std::move(report)) {}
  const MemoryReport& report() const { return report_; }

 private:
  MemoryReport report_;
};

}  // namespace blu
