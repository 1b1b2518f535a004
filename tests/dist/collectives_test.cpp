// Gloo collectives with 2 and 4 processes on loopback, and a vanished peer.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

TEST(GlooCollectives, TwoRanks) {
  const LaunchResult r = run_workers("collectives", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

TEST(GlooCollectives, FourRanks) {
  const LaunchResult r = run_workers("collectives", 4);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

// The fp16 overflow verdict, all-reduced: one rank's inf gradient makes every rank skip.
TEST(GlooCollectives, LossScalerOverflowOnOneRankSkipsOnAll) {
  const LaunchResult r = run_workers("scaler_agree", 3);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

TEST(GlooCollectives, DeadPeerIsAnErrorOnEverySurvivorWithinTheTimeout) {
  const LaunchResult r = run_workers("peer_dies", 3);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] survivor error after"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 2] survivor error after"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15.0);
}

TEST(GlooCollectives, StalledPeerIsATimeoutErrorNotAHang) {
  const LaunchResult r = run_workers("peer_stalls", 2);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] survivor error after"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace blu::dist::test
