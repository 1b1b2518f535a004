// The host-read counter (core/host_reads.h): item(), to_vector() and a copy to the CPU of a device
// tensor each count one; ops, views and raw data access count none.
#include <gtest/gtest.h>

#include "blu/blu.h"

namespace blu::test {
namespace {

TEST(HostReads, CountsItemAndToVectorOnce) {
  const Tensor t = full({2, 3}, 1.5);
  uint64_t r0 = host_reads();
  const Tensor s = sum(mul(t, t));
  const Tensor v = narrow(t, 1, 0, 2);
  EXPECT_EQ(*t.data<float>(), 1.5f);
  EXPECT_EQ(host_reads() - r0, 0u);  // ops, views, raw data: no count
  r0 = host_reads();
  EXPECT_EQ(s.item(), 13.5);
  EXPECT_EQ(host_reads() - r0, 1u);
  r0 = host_reads();
  EXPECT_EQ(to_vector(v).size(), 4u);
  EXPECT_EQ(host_reads() - r0, 1u);  // one, though to_vector copies the non-contiguous view first
  r0 = host_reads();
  EXPECT_TRUE(to_device(t, kCPU).is_same(t));  // already there: no copy, no read
  EXPECT_EQ(host_reads() - r0, 0u);
}

}  // namespace
}  // namespace blu::test
