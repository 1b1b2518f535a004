// core/exec_context: the Workspace hands out aligned slices that start again after reset(), grows
// through the device allocator while not frozen (earlier slices of the call stay valid until the
// next reset), refuses to grow when frozen with a message naming the bytes asked and held, and
// reports its high-water mark; the current context is per thread and per device, set for a scope
// by ExecContextGuard (a null workspace keeps the current one) and restored after it.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <thread>

#include "blu/core/exec_context.h"
#include "blu/memory/allocator.h"
#include "common/checks.h"

namespace blu {
namespace {

using test::expect_error;

uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

TEST(Workspace, SlicesAreAlignedAndStartAgainAfterReset) {
  Workspace ws(kCPU, 4096);
  EXPECT_GE(ws.capacity(), 4096u);
  void* a = ws.take(10);
  void* b = ws.take(300);
  void* c = ws.take(1);
  EXPECT_EQ(addr(a) % Workspace::kAlignment, 0u);
  EXPECT_EQ(addr(b), addr(a) + 256) << "a 10-byte slice occupies one 256-byte unit";
  EXPECT_EQ(addr(c), addr(b) + 512) << "a 300-byte slice occupies two";
  EXPECT_EQ(ws.used(), 256u + 512u + 256u);
  ws.reset();
  EXPECT_EQ(ws.used(), 0u);
  EXPECT_EQ(ws.take(64), a) << "the next call's slices start at the beginning again";
  EXPECT_EQ(ws.high_water(), 1024u) << "the most one call took";
  float* f = ws.take<float>(3);
  EXPECT_EQ(addr(f), addr(a) + 256);
}

TEST(Workspace, GrowsThroughTheAllocatorAndKeepsTheCallsSlices) {
  Workspace ws(kCPU);
  EXPECT_EQ(ws.capacity(), 0u) << "nothing is allocated before the first slice";
  const int64_t live0 = cpu_allocator().stats().current_bytes;
  char* first = static_cast<char*>(ws.take(1000));
  std::memset(first, 0x5a, 1000);
  const size_t cap1 = ws.capacity();
  EXPECT_GE(cap1, 1000u);
  EXPECT_EQ(cpu_allocator().stats().current_bytes - live0, int64_t(cap1 + Workspace::kAlignment))
      << "the block (and one alignment unit) comes from the CPU allocator";

  // A slice beyond the block: a new, larger block; the first slice stays where it was.
  char* big = static_cast<char*>(ws.take(cap1 + 1));
  EXPECT_GT(ws.capacity(), cap1);
  std::memset(big, 0x11, cap1 + 1);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(first[i], 0x5a) << "an earlier slice of the call was overwritten at " << i;
  EXPECT_EQ(cpu_allocator().stats().current_bytes - live0, int64_t(cap1 + ws.capacity() + 2 * Workspace::kAlignment))
      << "the outgrown block is held until the next reset";
  ws.reset();
  EXPECT_EQ(int64_t(ws.block_bytes()), int64_t(ws.capacity() + Workspace::kAlignment));
  EXPECT_EQ(cpu_allocator().stats().current_bytes - live0, int64_t(ws.block_bytes()))
      << "and released by it";
  EXPECT_GE(ws.capacity(), ws.high_water()) << "the new block holds the whole call that outgrew the old one";
  // The same call again fits without growing.
  const size_t cap2 = ws.capacity();
  (void)ws.take(1000);
  (void)ws.take(cap1 + 1);
  EXPECT_EQ(ws.capacity(), cap2);
}

TEST(Workspace, FrozenRefusesToGrowAndNamesTheBytes) {
  Workspace ws(kCPU);
  ws.reserve(1 << 20);
  const size_t held = ws.capacity();
  ws.freeze();
  EXPECT_TRUE(ws.frozen());
  EXPECT_NE(ws.take(held / 2), nullptr) << "slices within the arena are fine while frozen";
  ws.reset();
  expect_error([&] { (void)ws.take(held + 1); },
               {"frozen", std::to_string(held + 1) + " bytes", "holds " + std::to_string(held)});
  expect_error([&] { ws.reserve(held + 1); }, {"frozen", std::to_string(held + 1), std::to_string(held)});
  EXPECT_EQ(ws.capacity(), held) << "a refused request leaves the arena as it was";
  ws.unfreeze();
  ws.reset();
  EXPECT_NE(ws.take(held + 1), nullptr);
  EXPECT_GT(ws.capacity(), held);
}

TEST(Workspace, HighWaterIsTheLargestCall) {
  Workspace ws(kCPU);
  (void)ws.take(100);
  ws.reset();
  (void)ws.take(3000);
  (void)ws.take(3000);
  ws.reset();
  (void)ws.take(10);
  ws.reset();
  EXPECT_EQ(ws.high_water(), 2u * 3072u);
  ws.reset_high_water();
  EXPECT_EQ(ws.high_water(), 0u);
  // Reserving the high-water mark and freezing holds a repeat of the largest call.
  (void)ws.take(3000);
  (void)ws.take(3000);
  ws.reset();
  ws.reserve(ws.high_water());
  ws.freeze();
  (void)ws.take(3000);
  (void)ws.take(3000);
  ws.unfreeze();
}

TEST(ExecContext, DefaultIsTheThreadsWorkspaceAndNoStream) {
  const ExecContext& ctx = current_context(kCPU);
  EXPECT_EQ(ctx.device, kCPU);
  EXPECT_EQ(ctx.stream, nullptr);
  ASSERT_NE(ctx.scratch, nullptr);
  EXPECT_EQ(ctx.scratch->device(), kCPU);
  EXPECT_EQ(current_context(kCPU).scratch, ctx.scratch) << "one default workspace per thread and device";
  Workspace* other_thread = nullptr;
  std::thread([&] { other_thread = current_context(kCPU).scratch; }).join();
  EXPECT_NE(other_thread, ctx.scratch) << "each thread has its own";
}

TEST(ExecContext, GuardSetsAndRestores) {
  Workspace* const dflt = current_context(kCPU).scratch;
  Workspace mine(kCPU);
  int token = 0;
  {
    ExecContextGuard g(ExecContext{kCPU, &token, &mine});
    EXPECT_EQ(current_context(kCPU).stream, &token);
    EXPECT_EQ(current_context(kCPU).scratch, &mine);
    // Another thread keeps its own context.
    void* seen = &token;
    std::thread([&] { seen = current_context(kCPU).stream; }).join();
    EXPECT_EQ(seen, nullptr);
    {
      int token2 = 0;
      ExecContextGuard inner(ExecContext{kCPU, &token2, nullptr});
      EXPECT_EQ(current_context(kCPU).stream, &token2);
      EXPECT_EQ(current_context(kCPU).scratch, &mine) << "a null workspace keeps the current one";
    }
    EXPECT_EQ(current_context(kCPU).stream, &token);
  }
  EXPECT_EQ(current_context(kCPU).stream, nullptr);
  EXPECT_EQ(current_context(kCPU).scratch, dflt);
}

TEST(ExecContext, WorkspaceMustBeOnTheContextsDevice) {
  Workspace cpu_ws(kCPU);
  expect_error([&] { set_current_context(ExecContext{Device(DeviceType::cuda, 0), nullptr, &cpu_ws}); },
               {"cuda:0", "workspace is on cpu"});
}

}  // namespace
}  // namespace blu
