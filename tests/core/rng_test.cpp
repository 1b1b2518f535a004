// core/rng: Philox-4x32-10 against Random123's known answers, the element→counter mapping the
// random ops use, reproducibility from (seed, offset), and the distributions' basic properties.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "blu/blu.h"

namespace blu {
namespace {

using Block = std::array<uint32_t, 4>;

// Random123 tests/kat_vectors, philox4x32 with 10 rounds: counter, key → output.
TEST(Philox, Random123KnownAnswers) {
  EXPECT_EQ(Philox::block(Block{0, 0, 0, 0}, {0, 0}), (Block{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Philox::block(Block{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (Block{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(Philox::block(Block{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (Block{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  // The (seed, counter) form the ops use is the same function with the upper counter words zero.
  EXPECT_EQ(Philox::block(uint64_t(0), uint64_t(0)), (Block{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  const uint64_t seed = 0x299f31d0a4093822ull, ctr = 0x85a308d3243f6a88ull;
  EXPECT_EQ(Philox::block(seed, ctr), Philox::block(Block{0x243f6a88, 0x85a308d3, 0, 0}, {0xa4093822, 0x299f31d0}));
}

TEST(Philox, UniformIsInUnitInterval) {
  EXPECT_EQ(Philox::uniform(0), 0.0f);
  EXPECT_LT(Philox::uniform(0xffffffffu), 1.0f);
  EXPECT_EQ(Philox::uniform(0x80000000u), 0.5f);
}

TEST(Rng, RandFollowsTheCounterMapping) {
  // Element i of a draw at `offset` uses block (offset + i/4), lane i%4, key = seed.
  Generator g(1234, 10);
  Tensor t = rand({9}, DType::f32, kCPU, &g);
  EXPECT_EQ(g.offset(), 10u + 3u);  // 9 numbers → 3 blocks
  for (int64_t i = 0; i < 9; ++i)
    EXPECT_EQ(t.data<float>()[i], Philox::uniform(Philox::block(uint64_t(1234), uint64_t(10 + i / 4))[i % 4])) << i;
}

TEST(Rng, ReproducibleFromSeedAndOffset) {
  Generator g(42);
  Tensor a = randn({1000}, DType::f32, kCPU, &g);
  const uint64_t after_a = g.offset();
  Tensor b = randn({7, 3}, DType::f32, kCPU, &g);
  EXPECT_NE(to_vector(a)[0], to_vector(b)[0]);
  Generator g2(42);
  EXPECT_EQ(to_vector(randn({1000}, DType::f32, kCPU, &g2)), to_vector(a));
  Generator g3(42, after_a);  // jump straight to the second draw
  EXPECT_EQ(to_vector(randn({7, 3}, DType::f32, kCPU, &g3)), to_vector(b));
  Generator other(43);
  EXPECT_NE(to_vector(randn({1000}, DType::f32, kCPU, &other)), to_vector(a));
  // The default generator: manual_seed restarts it.
  manual_seed(7);
  const auto x = to_vector(rand({5}));
  manual_seed(7);
  EXPECT_EQ(to_vector(rand({5})), x);
  EXPECT_EQ(default_generator().seed(), 7u);
}

TEST(Rng, RandnMeanAndStd) {
  for (DType dt : {DType::f32, DType::f64}) {
    Generator g(5);
    const auto v = to_vector(randn({100000}, dt, kCPU, &g));
    double s = 0, s2 = 0;
    for (double x : v) {
      s += x;
      s2 += x * x;
    }
    const double mean = s / double(v.size()), sd = std::sqrt(s2 / double(v.size()) - mean * mean);
    EXPECT_NEAR(mean, 0.0, 0.015) << dt;  // standard error 0.003
    EXPECT_NEAR(sd, 1.0, 0.015) << dt;
  }
}

TEST(Rng, RandInHalfOpenUnitInterval) {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    Generator g(11);
    const auto v = to_vector(rand({100000}, dt, kCPU, &g));
    double lo = 1, hi = 0, s = 0;
    for (double x : v) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      s += x;
    }
    EXPECT_GE(lo, 0.0) << dt;
    EXPECT_LT(hi, 1.0) << dt;
    EXPECT_NEAR(s / double(v.size()), 0.5, 0.01) << dt;
  }
}

TEST(Rng, RandintRange) {
  Generator g(3);
  const auto v = to_vector(randint(-3, 4, {20000}, DType::i64, kCPU, &g));
  std::set<double> seen(v.begin(), v.end());
  EXPECT_EQ(seen, (std::set<double>{-3, -2, -1, 0, 1, 2, 3}));
  const auto w = to_vector(randint(5, 6, {100}, DType::i32, kCPU, &g));
  for (double x : w) EXPECT_EQ(x, 5);
  EXPECT_THROW(randint(2, 2, {3}), Error);
}

}  // namespace
}  // namespace blu
