// Hardware-aware splits (dist/hetero.h): proportional batch shares, stage balancing under speed and
// memory, and the start-up probe finding a slowdown injected on one rank (2 Gloo ranks).
#include <gtest/gtest.h>

#include "blu/dist/hetero.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist {
namespace {

using blu::test::error_of;

TEST(Hetero, ProportionalSplit) {
  EXPECT_EQ(proportional_split(16, {3, 1}), std::vector<int64_t>({12, 4}));
  EXPECT_EQ(proportional_split(10, {1, 1, 1}), std::vector<int64_t>({4, 3, 3}));  // ties to the lower index
  EXPECT_EQ(proportional_split(5, {100, 1}), std::vector<int64_t>({4, 1}));      // at least one each
  EXPECT_EQ(proportional_split(10, {0.8, 0.2}), std::vector<int64_t>({8, 2}));   // the shares, not one each first
  EXPECT_EQ(proportional_split(7, {0.5, 0.25, 0.25}, 2), std::vector<int64_t>({3, 2, 2}));
  int64_t sum = 0;
  for (int64_t v : proportional_split(1001, {0.3, 0.2, 0.5})) sum += v;
  EXPECT_EQ(sum, 1001);
  EXPECT_NE(error_of([] { proportional_split(2, {1, 1, 1}); }).find("2 units cannot give 3 parts"), std::string::npos);
  EXPECT_NE(error_of([] { proportional_split(4, {1, 0}); }).find("weight 0"), std::string::npos);
}

TEST(Hetero, BalanceStages) {
  // Even speeds: an even split.
  const std::vector<std::pair<int64_t, int64_t>> even = {{0, 5}, {6, 11}};
  EXPECT_EQ(balance_stages(12, {1, 1}, 1.0, 0.0, 0.0), even);
  // Stage 1 twice as fast: it takes twice the blocks.
  const std::vector<std::pair<int64_t, int64_t>> skew = {{0, 3}, {4, 11}};
  EXPECT_EQ(balance_stages(12, {1, 2}, 1.0, 0.0, 0.0), skew);
  // Both stages carry an edge of the same cost: still even.
  const auto edge = balance_stages(12, {1, 1}, 1.0, 4.0, 4.0);
  EXPECT_EQ(edge.front().first, 0);
  EXPECT_EQ(edge.back().second, 11);
  EXPECT_EQ(edge[0].second - edge[0].first + 1, 6);  // both stages carry one edge: still even
  const auto middle = balance_stages(12, {1, 1, 1}, 1.0, 3.0, 3.0);
  EXPECT_GT(middle[1].second - middle[1].first, middle[0].second - middle[0].first);  // the middle carries no edge
  // The head and loss cost 4 blocks, the embedding nothing: the last stage gives up 2 blocks.
  const std::vector<std::pair<int64_t, int64_t>> head = {{0, 7}, {8, 11}};
  EXPECT_EQ(balance_stages(12, {1, 1}, 1.0, 0.0, 4.0), head);
  // A memory limit binds even against speed.
  const std::vector<std::pair<int64_t, int64_t>> capped = {{0, 8}, {9, 11}};
  EXPECT_EQ(balance_stages(12, {1, 10}, 1.0, 0.0, 0.0, {9, 3}), capped);
  EXPECT_NE(error_of([] { balance_stages(12, {1, 1}, 1.0, 0.0, 0.0, {5, 5}); }).find("do not fit 2 stages"),
            std::string::npos);
  EXPECT_NE(error_of([] { balance_stages(1, {1, 1}, 1.0, 0.0, 0.0); }).find("1 blocks cannot fill 2 stages"),
            std::string::npos);
}

TEST(Hetero, ProbeFindsAnInjectedSlowdown) {
  const auto r = test::run_workers("probe_speeds", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

// A rank slowed per row of work trains faster with the probe's split than with the even one, and
// both give one process's losses (worker_test.cpp: hetero_train; docs/distributed.md quotes its line).
TEST(Hetero, ProbedTensorParallelWidthsAreFasterWithTheSameLosses) {
  const auto r = test::run_workers("hetero_tp", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
}

// pipeline(2, balance=time): stages by the ranks' probed speeds under a memory budget
// (worker_test.cpp: hetero_stages; docs/distributed.md quotes its line).
TEST(Hetero, StagesByTimeAreFasterWithTheSameLosses) {
  const auto r = test::run_workers("hetero_stages", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
}

// --parallel auto weighs the replicas by the ranks' probed speeds (worker_test.cpp: hetero_auto).
TEST(Hetero, AutoWeighsUnequalReplicas) {
  const auto r = test::run_workers("hetero_auto", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
}

TEST(Hetero, AwareSplitIsFasterWithTheSameLosses) {
  const auto r = test::run_workers("hetero_train", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::printf("%s", r.out.c_str());
}

}  // namespace
}  // namespace blu::dist
