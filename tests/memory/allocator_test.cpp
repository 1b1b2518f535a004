// memory/allocator: the CPU allocator's statistics follow tensors as they are made and freed, its
// pointers are 64-byte aligned, and reset_peak restarts the high-water mark.
#include <gtest/gtest.h>

#include <cstdint>

#include "blu/blu.h"

namespace blu {
namespace {

TEST(CpuAllocator, StatsFollowTensors) {
  CpuAllocator& a = cpu_allocator();
  const AllocatorStats s0 = a.stats();
  {
    Tensor t = empty({100}, DType::f32);  // 400 bytes
    const AllocatorStats s1 = a.stats();
    EXPECT_EQ(s1.current_bytes - s0.current_bytes, 400);
    EXPECT_EQ(s1.allocs - s0.allocs, 1);
    EXPECT_EQ(s1.frees - s0.frees, 0);
    EXPECT_GE(s1.peak_bytes, s1.current_bytes);
    EXPECT_EQ(s1.reserved_bytes, s1.current_bytes);
    {
      Tensor v = view(t, {10, 10});  // a view allocates nothing
      Tensor u = empty({3}, DType::f64);
      const AllocatorStats s2 = a.stats();
      EXPECT_EQ(s2.current_bytes - s0.current_bytes, 424);
      EXPECT_EQ(s2.allocs - s0.allocs, 2);
    }
    const AllocatorStats s3 = a.stats();
    EXPECT_EQ(s3.current_bytes - s0.current_bytes, 400);  // u freed, t alive through its view's end
    EXPECT_EQ(s3.frees - s0.frees, 1);
    Tensor keep = narrow(t, 0, 0, 1);
    t = Tensor();  // the storage lives on through `keep`
    EXPECT_EQ(a.stats().current_bytes - s0.current_bytes, 400);
  }
  const AllocatorStats s4 = a.stats();
  EXPECT_EQ(s4.current_bytes, s0.current_bytes);
  EXPECT_EQ(s4.allocs - s0.allocs, 2);
  EXPECT_EQ(s4.frees - s0.frees, 2);
}

TEST(CpuAllocator, PeakAndReset) {
  CpuAllocator& a = cpu_allocator();
  a.reset_peak();
  const int64_t base = a.stats().current_bytes;
  EXPECT_EQ(a.stats().peak_bytes, base);
  {
    Tensor big = empty({1 << 16}, DType::f64);  // 512 KiB
    EXPECT_EQ(a.stats().peak_bytes, base + (int64_t(1) << 19));
  }
  EXPECT_EQ(a.stats().current_bytes, base);
  EXPECT_EQ(a.stats().peak_bytes, base + (int64_t(1) << 19));  // the mark stays after the free
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes, base);
}

TEST(CpuAllocator, Alignment) {
  for (size_t n : {size_t(0), size_t(1), size_t(3), size_t(63), size_t(64), size_t(65), size_t(1000)}) {
    DataPtr p = cpu_allocator().allocate(n);
    ASSERT_NE(p.get(), nullptr) << n;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % CpuAllocator::kAlignment, 0u) << n;
    EXPECT_EQ(p.nbytes(), n);
    EXPECT_TRUE(p.device().is_cpu());
  }
  Tensor t = empty({7}, DType::bf16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
  EXPECT_TRUE(allocator_for(kCPU).device().is_cpu());
}

TEST(CpuAllocator, DataPtrMovesOwnership) {
  CpuAllocator& a = cpu_allocator();
  const AllocatorStats s0 = a.stats();
  {
    DataPtr p = a.allocate(128);
    DataPtr q = std::move(p);
    EXPECT_EQ(p.get(), nullptr);
    EXPECT_NE(q.get(), nullptr);
  }
  EXPECT_EQ(a.stats().frees - s0.frees, 1);  // freed once, by the last owner
  EXPECT_EQ(a.stats().current_bytes, s0.current_bytes);
}

}  // namespace
}  // namespace blu
