// optim/loss_scaler: unscaling divides the gradients exactly (power-of-two scale), an inf/NaN
// gradient skips the step and halves the scale, growth_interval good steps double it, and the
// `agree` hook's verdict (the data-parallel ranks' common decision) overrides the local one.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "blu/blu.h"
#include "blu/core/host_reads.h"
#include "blu/ops/optim.h"
#include "blu/optim/loss_scaler.h"
#include "blu/optim/optimizer.h"

namespace blu::optim {
namespace {

// A parameter whose gradient is `g`.
Tensor param_with_grad(const std::vector<double>& g) {
  Tensor p = zeros({int64_t(g.size())});
  p.set_requires_grad(true);
  p.set_grad(from_vector(g, {int64_t(g.size())}));
  return p;
}

TEST(LossScaler, UnscalesExactlyAndGrowsAfterTheInterval) {
  LossScaler s(8.0, 2);
  Tensor p = param_with_grad({8.0, -4.0, 0.5});
  EXPECT_TRUE(s.unscale_and_check({p}));
  EXPECT_EQ(to_vector(p.grad()), (std::vector<double>{1.0, -0.5, 0.0625}));
  EXPECT_EQ(s.scale(), 8.0);
  EXPECT_TRUE(s.unscale_and_check({param_with_grad({1.0})}));
  EXPECT_EQ(s.scale(), 16.0);  // two good steps in a row
  EXPECT_EQ(s.skipped_steps(), 0);
}

TEST(LossScaler, OverflowSkipsAndHalves) {
  LossScaler s(1024.0, 2);
  EXPECT_FALSE(s.unscale_and_check({param_with_grad({1.0, std::numeric_limits<double>::infinity()})}));
  EXPECT_EQ(s.scale(), 512.0);
  EXPECT_FALSE(s.unscale_and_check({param_with_grad({std::nan("")})}));
  EXPECT_EQ(s.scale(), 256.0);
  EXPECT_EQ(s.skipped_steps(), 2);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(LossScaler, AgreeDecidesForEveryRank) {
  // Finite here, overflow elsewhere: skip like the others.
  LossScaler s(64.0, 1);
  bool asked = false;
  EXPECT_FALSE(s.unscale_and_check({param_with_grad({2.0})}, [&](bool local) {
    asked = true;
    EXPECT_TRUE(local);
    return false;
  }));
  EXPECT_TRUE(asked);
  EXPECT_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.skipped_steps(), 1);
  // Overflow here is never outvoted in practice (the ranks take the max), but the hook has the say.
  EXPECT_TRUE(s.unscale_and_check({param_with_grad({2.0})}, [](bool local) { return local; }));
  EXPECT_EQ(s.scale(), 64.0);  // growth_interval 1
}


// The device side takes the host side's decisions over a sequence of good and overflowing steps
// (the overflow seen through the norm gate's total), unscales to the same bits, and reads nothing
// on the host until asked.
TEST(LossScaler, DeviceSideMatchesHostSide) {
  LossScaler host(64.0, 3), dev(64.0, 3);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<double>> steps = {{8, -4, 0.5}, {1, 2, 3}, {inf, 1, 1}, {0.25, 3, -7},
                                                  {1, 1, 1},    {2, 2, 2}, {1, std::nan(""), 0}, {5, 6, 7}};
  for (const auto& g : steps) {
    Tensor ph = param_with_grad(g), pd = param_with_grad(g);
    const bool finite = host.unscale_and_check({ph});
    const uint64_t reads = host_reads();
    dev.scale_tensor(kCPU);
    dev.unscale({pd.grad()});
    const NormGate gate = grad_norm_gate({pd}, 1.0);
    dev.update(gate.sum_squares);
    EXPECT_EQ(host_reads(), reads) << "the device side read a value on the host";
    if (finite) {
      EXPECT_EQ(to_vector(pd.grad()), to_vector(ph.grad()));
    }
    EXPECT_EQ(dev.scale(), host.scale());
    EXPECT_EQ(dev.good_steps(), host.good_steps());
    EXPECT_EQ(dev.skipped_steps(), host.skipped_steps());
  }
  EXPECT_EQ(dev.skipped_steps(), 2);
}

}  // namespace
}  // namespace blu::optim
