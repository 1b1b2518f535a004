// blutrain launch: rank variables, prefixed output, stopping everyone when one rank fails, and
// restarting the whole job (--max-restarts).
#include <gtest/gtest.h>

#include <filesystem>

#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

TEST(Launch, SetsRankVariablesAndPrefixesEveryLine) {
  const LaunchResult r = run_command(
      3, {"/bin/sh", "-c", "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK a=$MASTER_ADDR\"; printf 'no newline'; "
                           "echo oops >&2; [ -n \"$MASTER_PORT\" ]"});
  EXPECT_EQ(r.status, 0) << r.err;
  for (int k = 0; k < 3; ++k) {
    const std::string p = "[rank " + std::to_string(k) + "] ";
    EXPECT_NE(r.out.find(p + "r=" + std::to_string(k) + " w=3 l=" + std::to_string(k) + " a=127.0.0.1\n"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(p + "no newline\n"), std::string::npos) << r.out;
    EXPECT_NE(r.err.find(p + "oops\n"), std::string::npos) << r.err;
  }
}

// Every rank gets the same fresh store secret (64 hex digits) and job name; the launcher's own
// values, when set, are passed on instead.
TEST(Launch, HandsEveryRankTheSameStoreSecretAndJob) {
  const LaunchResult r = run_command(2, {"/bin/sh", "-c", "echo \"s=$BLU_STORE_SECRET j=$BLU_JOB_ID\""});
  ASSERT_EQ(r.status, 0) << r.err;
  const size_t a = r.out.find("[rank 0] s="), b = r.out.find("[rank 1] s=");
  ASSERT_NE(a, std::string::npos) << r.out;
  ASSERT_NE(b, std::string::npos) << r.out;
  const std::string line0 = r.out.substr(a + 9, r.out.find('\n', a) - a - 9);
  const std::string line1 = r.out.substr(b + 9, r.out.find('\n', b) - b - 9);
  EXPECT_EQ(line0, line1);
  const std::string secret = line0.substr(2, line0.find(' ') - 2);
  EXPECT_EQ(secret.size(), 64u) << line0;
  EXPECT_EQ(secret.find_first_not_of("0123456789abcdef"), std::string::npos) << line0;
  EXPECT_NE(line0.find(" j=launch-"), std::string::npos) << line0;
  const LaunchResult again = run_command(1, {"/bin/sh", "-c", "echo \"s=$BLU_STORE_SECRET\""});
  EXPECT_EQ(again.out.find(secret), std::string::npos);  // fresh per job
}

// The port the launcher picks stays taken from the moment it is picked: rank 0 inherits the
// listening socket (Note [Launcher's socket]), so nothing else on the machine can bind it
// meanwhile; rank 1 tries and must fail.
TEST(Launch, HoldsThePickedPortForRankZerosStore) {
  const LaunchResult r = run_command(
      2, {"/bin/sh", "-c",
          "f=/tmp/blu-held-$BLU_JOB_ID; "
          "if [ $RANK = 0 ]; then [ -n \"$BLU_STORE_LISTEN_FD\" ] || exit 9; "
          "  for i in $(seq 600); do [ -e $f ] && rm $f && echo held && exit; sleep 0.05; done; exit 10; fi; "
          "trap 'touch $f' EXIT; [ -z \"$BLU_STORE_LISTEN_FD\" ] || exit 9; "
          "/usr/bin/python3 -c 'import os,socket,errno\n"
          "s=socket.socket()\n"
          "try: s.bind((\"127.0.0.1\", int(os.environ[\"MASTER_PORT\"]))); print(\"bound\"); raise SystemExit(8)\n"
          "except OSError as e: print(\"taken\" if e.errno==errno.EADDRINUSE else e); raise SystemExit(0 if e.errno==errno.EADDRINUSE else 7)'"});
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] held\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] taken\n"), std::string::npos) << r.out;
}

TEST(Launch, OneFailingRankStopsTheOthers) {
  // Rank 1 fails at once; the others would sleep for a minute (and ignore nothing).
  const LaunchResult r =
      run_command(3, {"/bin/sh", "-c", "echo started; if [ $RANK = 1 ]; then exit 7; fi; exec sleep 60"});
  EXPECT_EQ(r.status, 7);
  EXPECT_NE(r.err.find("blutrain launch: rank 1 failed (exit status 7); stopping the other ranks"), std::string::npos)
      << r.err;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Launch, RankThatIgnoresSigtermIsKilledAfterTheGracePeriod) {
  const LaunchResult r = run_command(
      2, {"/bin/sh", "-c", "trap '' TERM; if [ $RANK = 0 ]; then sleep 0.5; exit 3; fi; while :; do sleep 0.1; done"});
  EXPECT_EQ(r.status, 3);
  EXPECT_GE(r.seconds, 2.0);  // rank 0's 0.5 s (rank 1 sets its trap meanwhile) + most of the 2 s grace
  EXPECT_LT(r.seconds, 10.0);
}

// Rank 1 fails in the first start (a second in, so that rank 0 has printed) while rank 0 waits; the
// second start (BLU_RESTART_COUNT=1) succeeds, so the job does.
TEST(Launch, RestartsTheWholeJobAfterAFailure) {
  const LaunchResult r = run_command(
      2, {"/bin/sh", "-c", "echo try $BLU_RESTART_COUNT; [ $BLU_RESTART_COUNT = 0 ] || exit 0; "
                           "[ $RANK = 1 ] && { sleep 1; exit 4; }; sleep 30"},
      {}, 2);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("rank 1 failed (exit status 4)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("blutrain launch: restarting all 2 ranks (restart 1 of 2)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restart 2 of 2"), std::string::npos) << r.err;
  for (const char* line : {"[rank 0] try 0\n", "[rank 1] try 0\n", "[rank 0] try 1\n", "[rank 1] try 1\n"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " in\n" << r.out;
  EXPECT_EQ(r.out.find("try 2"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Launch, GivesUpAfterMaxRestarts) {
  // Rank 0 fails at once, rank 1 (exit 4) a second later: every start ends with rank 0's status.
  const LaunchResult r = run_command(
      2, {"/bin/sh", "-c", "echo try $BLU_RESTART_COUNT; [ $RANK = 0 ] || sleep 1; exit $((RANK + 3))"}, {}, 2);
  EXPECT_EQ(r.status, 3) << r.err;
  EXPECT_NE(r.err.find("restart 2 of 2"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restart 3"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("[rank 0] try 2\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("try 3"), std::string::npos) << r.out;
}

TEST(Launch, BlutrainLaunchCommand) {
  // build/tests/test_dist → build/blutrain
  const auto exe = std::filesystem::path(self_exe()).parent_path().parent_path() / "blutrain";
  if (!std::filesystem::exists(exe)) GTEST_SKIP() << exe << " not built";
  const LaunchResult r = run_command(1, {exe.string(), "launch", "-n", "2", "--", "/bin/sh", "-c",
                                         // rank 1 fails a second after both have printed
                                         // (without the pause a loaded machine could stop rank 0
                                         // before its echo ran)
                                         "echo hi $RANK; [ $RANK = 0 ] || { sleep 1; exit 5; }; sleep 30"});
  EXPECT_EQ(r.status, 5);
  EXPECT_NE(r.out.find("[rank 0] [rank 0] hi 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 0] [rank 1] hi 1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("rank 1 failed (exit status 5)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 10.0);
}

}  // namespace
}  // namespace blu::dist::test
