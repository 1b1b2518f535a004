// A hung rank under `blutrain launch -n 2 -- blutrain train --dp 2 --dist-timeout 5`: rank 1 stops
// answering before training step 3 (BLU_TEST_STALL, trainer.cpp); rank 0's Gloo all-reduce times
// out after 5 s, it dumps its flight recorder and exits; launch stops rank 1 with SIGTERM, which
// dumps its recorder from the dump thread before the grace period's SIGKILL. Every rank's dump
// names its last completed collective, launch prints the summary of both, and `blutrain info
// --flight RUN` prints it again from the files.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "blu/data/shard.h"
#include "blu/io/json_file.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

TEST(FlightRecorderCli, StalledGlooRankEndsTheJobWithADumpOnEveryRank) {
  if (!fs::exists(blutrain())) GTEST_SKIP() << blutrain() << " not built";
  TempDir dir;
  std::vector<uint16_t> t(8192);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 131 + i / 7) % 50000);
  write_shard(dir.path / "d_train_000000.bin", t);
  const fs::path run = dir.path / "run";
  LaunchOptions o;
  o.nproc = 2;
  // The stalled rank's dump thread writes its file after SIGTERM: 1 s before SIGKILL leaves it time
  // on a loaded machine (0.5 s once did not, beside two test runs and a fuzzer).
  o.grace = std::chrono::milliseconds(1000);
  o.command = {blutrain().string(), "train", "--train-pattern", (dir.path / "d_train_*.bin").string(), "--model",
               "tiny", "--dp", "2", "-B", "2", "-T", "32", "--steps", "6", "--schedule", "constant", "--warmup", "0",
               "--dist-timeout", "5", "--dist-work-timeout", "5", "--out", run.string()};
  o.env = {{"OMP_NUM_THREADS", "1"}, {"BLU_TEST_STALL", "1:3"}};
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  LaunchResult r;
  r.status = launch(o, out, err);
  const int64_t end_us = now_us();
  r.out = slurp(out);
  r.err = slurp(err);
  const std::string all = r.out + r.err;
  EXPECT_NE(r.status, 0) << all;

  const fs::path fr = run / "flight_recorder";
  ASSERT_TRUE(fs::exists(fr / "rank_0.json")) << all;
  ASSERT_TRUE(fs::exists(fr / "rank_1.json")) << all;
  const nlohmann::json d0 = io::read_json_file(fr / "rank_0.json"), d1 = io::read_json_file(fr / "rank_1.json");
  EXPECT_EQ(d0["rank"], 0);
  EXPECT_EQ(d1["rank"], 1);
  EXPECT_EQ(d1["reason"], "signal SIGTERM");
  EXPECT_NE(d0["reason"].get<std::string>().find("gloo all_reduce failed on rank 0 of 2 during training step 3 "
                                                 "(timeout 5000 ms"),
            std::string::npos)
      << d0["reason"];

  // Both ranks completed the same collectives up to the end of step 2; rank 0's next one (step 3's
  // first all-reduce) failed, and rank 1 never issued one for step 3.
  const nlohmann::json& last0 = d0["last_completed"]["default_pg"];
  const nlohmann::json& last1 = d1["last_completed"]["default_pg"];
  EXPECT_EQ(last0["seq"], last1["seq"]);
  EXPECT_EQ(last0["phase"], "training step 2");
  EXPECT_EQ(last1["phase"], "training step 2");
  const uint64_t last_seq = last0["seq"].get<uint64_t>();
  // The first operation not completed on rank 0 is the one that timed out; the ones queued behind
  // it failed at once (the group is broken).
  nlohmann::json first_failed;
  for (const auto& e : d0["entries"])
    if (e["state"] != "completed") {
      first_failed = e;
      break;
    }
  ASSERT_FALSE(first_failed.is_null()) << d0.dump(1);
  EXPECT_EQ(first_failed["state"], "failed");
  EXPECT_EQ(first_failed["seq"], last_seq + 1);
  EXPECT_EQ(first_failed["kind"], "all_reduce");
  EXPECT_EQ(first_failed["phase"], "training step 3");
  EXPECT_GE(first_failed["completed_us"].get<int64_t>() - first_failed["started_us"].get<int64_t>(), 4'900'000);
  int64_t stalled_at_us = 0;  // when rank 1 finished its last collective: the stall began then
  for (const auto& e : d1["entries"]) {
    EXPECT_EQ(e["state"], "completed") << e;
    EXPECT_NE(e["phase"], "training step 3") << e;
    if (e["seq"] == last_seq) stalled_at_us = e["completed_us"].get<int64_t>();
  }
  ASSERT_GT(stalled_at_us, 0);
  // The timeout (5 s), the launcher noticing and the grace period (1 s): ~6 s; 15 s allows for a
  // loaded 2-core machine.
  const double ended_after = double(end_us - stalled_at_us) / 1e6;
  std::printf("the job ended %.2f s after rank 1 stalled\n", ended_after);
  EXPECT_GT(ended_after, 4.9);
  EXPECT_LT(ended_after, 15.0);

  // Each rank's line, and launch's summary naming both ranks' last completed collective and the folder.
  EXPECT_NE(r.err.find("[rank 0] flight recorder: rank 0 (gloo all_reduce failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[rank 1] flight recorder: rank 1 (signal SIGTERM)"), std::string::npos) << r.err;
  const std::string last = "last completed default_pg #" + std::to_string(last_seq);
  EXPECT_NE(r.err.find("blutrain launch: flight recorder, each rank's last completed collective:\n  rank 0: " + last),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("  rank 1: " + last), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("oldest not completed: default_pg #" + std::to_string(last_seq + 1) +
                       " all_reduce during training step 3 (failed)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("  dumps: " + fr.string()), std::string::npos) << r.err;

  // `blutrain info --flight RUN` reads the same dumps.
  const LaunchResult info = run_command(1, {blutrain().string(), "info", "--flight", run.string()});
  EXPECT_EQ(info.status, 0) << info.out << info.err;
  EXPECT_NE(info.out.find("[rank 0] rank 0: " + last + " all_reduce during training step 2; oldest not completed"),
            std::string::npos)
      << info.out;
  EXPECT_NE(info.out.find("[rank 0] rank 1: " + last + " all_reduce during training step 2; none in flight"),
            std::string::npos)
      << info.out;
}

}  // namespace
}  // namespace blu::dist::test
