#include "blu/core/exec_context.h"

#include <algorithm>
#include <cstdint>
#include <memory>

#include "blu/core/error.h"

namespace blu {

namespace {
WorkspaceAllocate g_allocate = nullptr;

// Growth rounds up to this, so a first step's many small increases are a few allocations.
constexpr size_t kGrowQuantum = size_t(2) << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

void set_workspace_allocate(WorkspaceAllocate fn) { g_allocate = fn; }

Workspace::Workspace(Device device, size_t bytes) : device_(device) {
  if (bytes > 0) grow(bytes);
}

void Workspace::grow(size_t bytes) {
  BLU_CHECK(!frozen_, "workspace on ", device_, " is frozen (as under graph capture): asked for ", bytes,
            " bytes, holds ", capacity(), " (reserve the high-water mark before freezing)");
  BLU_ASSERT(g_allocate, "workspace: no device allocator installed (memory/ sets it)");
  // One alignment unit more than the arena, so that its start can be aligned whatever the
  // allocator's own alignment.
  const size_t capacity = round_up(bytes, kGrowQuantum);
  DataPtr block = g_allocate(device_, capacity + kAlignment);
  if (block_.get()) retired_.push_back(std::move(block_));
  block_ = std::move(block);
  base_ = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(block_.get()), kAlignment));
  capacity_ = capacity;
}

void* Workspace::take(size_t bytes) {
  const size_t size = round_up(bytes, kAlignment);
  if (used_ + size > capacity()) [[unlikely]] {
    BLU_CHECK(!frozen_, "workspace on ", device_, " is frozen (as under graph capture): a slice of ", bytes,
              " bytes after ", used_, " taken needs ", used_ + size, " bytes, it holds ", capacity(),
              " (reserve the high-water mark before freezing)");
    // The call's earlier slices stay in the old block (kept until reset()); the new block holds the
    // whole call so far, so the next call with the same slices fits without growing.
    grow(used_ + size);
  }
  void* p = base_ + used_;
  used_ += size;
  if (used_ > high_) high_ = used_;
  return p;
}

void Workspace::reserve(size_t bytes) {
  if (bytes > capacity()) grow(bytes);
}

namespace {
constexpr int kMaxDevices = 64;

struct Slot {
  ExecContext ctx;
  bool init = false;
};
thread_local Slot t_slots[1 + kMaxDevices];  // [0]: the CPU; [1 + i]: cuda:i
thread_local std::unique_ptr<Workspace> t_default[1 + kMaxDevices];

Slot& slot_of(Device d) {
  const int i = d.is_cpu() ? 0 : 1 + d.index;
  BLU_ASSERT(d.is_cpu() || (d.index >= 0 && d.index < kMaxDevices), "device index ", d.index);
  Slot& s = t_slots[i];
  if (!s.init) [[unlikely]] {
    t_default[i] = std::make_unique<Workspace>(d);
    s.ctx = ExecContext{d, nullptr, t_default[i].get()};
    s.init = true;
  }
  return s;
}
}  // namespace

const ExecContext& current_context(Device device) { return slot_of(device).ctx; }

void set_current_context(ExecContext ctx) {
  Slot& s = slot_of(ctx.device);
  if (!ctx.scratch) ctx.scratch = s.ctx.scratch;
  BLU_CHECK(ctx.scratch->device() == ctx.device, "execution context for ", ctx.device, ": its workspace is on ",
            ctx.scratch->device());
  s.ctx = ctx;
}

}  // namespace blu
