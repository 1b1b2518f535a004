// The NCCL process group's flight recorder, init watchdog, heartbeat monitor and abort/enqueue
// ordering on one GPU (dist/process_group_nccl.cpp). Each case runs this binary as a one-process
// job under dist::launch (--gtest_filter=NcclFlightWorker.Run, BLU_NCCL_FLIGHT naming the case),
// since two of them end their process on purpose:
//   record      a one-rank communicator's collectives are recorded enqueued → started → completed,
//               with bytes, dtype and peer; an init timeout that passed after the init never fires
//   init_stuck  rank 0 of a two-rank communicator whose rank 1 never starts: ncclCommInitRank is
//               ended after the init timeout with a message naming the rank and the timeout
//   heartbeat   a watchdog that stops making passes (BLU_TEST_NCCL_WATCHDOG_SLEEP_MS) is ended by
//               the heartbeat monitor
//   abort       an operation held behind a blocked stream times out: the group is aborted, the
//               dump names it failed, and the next call is refused instead of enqueued
// Two-GPU fault cases (a rank that dies or stalls mid-collective) need two devices.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/dist/env.h"
#include "blu/dist/flight_recorder.h"
#include "blu/dist/process_group.h"
#include "blu/dist/tcp_store.h"
#include "blu/io/json_file.h"
#include "common/checks.h"
#include "dist/dist_test_util.h"

namespace blu::dist {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string flight_case() {
  const char* v = std::getenv("BLU_NCCL_FLIGHT");
  return v ? v : "";
}

std::unique_ptr<TcpStore> make_store() {
  const DistEnv env = detect_env();
  return std::make_unique<TcpStore>(env.master_addr, env.master_port, env.rank == 0, 20000ms);
}

// The recorder's entries of group `name`, oldest first.
std::vector<FlightEntry> entries_of(const std::string& name) {
  std::vector<FlightEntry> out;
  for (const FlightEntry& e : FlightRecorder::global().snapshot())
    if (e.group == name) out.push_back(e);
  return out;
}

void record_case() {
  auto store = make_store();
  const Device dev(DeviceType::cuda, 0);
  auto pg = make_nccl_group(*store, 0, 1,
                            NcclOptions{.timeout = 60000ms, .device = 0, .prefix = "flight", .init_timeout = 5000ms});
  pg->set_phase("the test");
  Tensor a = to_device(full({1024}, 1.0), dev);  // f32
  Tensor b = to_device(full({8}, 2.0, DType::bf16), dev);
  Tensor g_in = to_device(full({16}, 3.0), dev), g_out = to_device(zeros({16}), dev);
  pg->all_reduce(a)->wait();
  pg->broadcast(b, 0)->wait();
  pg->all_gather(g_out, g_in)->wait();
  pg->reduce_scatter(g_out, g_in)->wait();
  pg->barrier()->wait();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  // The watchdog notes completions within a few milliseconds.
  std::vector<FlightEntry> es;
  for (int i = 0; i < 200; ++i) {
    es = entries_of("flight");
    if (es.size() == 6 && es.back().state == OpState::completed) break;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(es.size(), 6u);
  const char* kinds[] = {"comm_init", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"};
  for (size_t i = 0; i < es.size(); ++i) {
    SCOPED_TRACE(kinds[i]);
    EXPECT_STREQ(es[i].kind, kinds[i]);
    EXPECT_STREQ(es[i].backend, "nccl");
    EXPECT_EQ(es[i].seq, i);
    EXPECT_EQ(es[i].state, OpState::completed);
    EXPECT_GT(es[i].started_us, 0);
    EXPECT_GE(es[i].completed_us, es[i].started_us);
    if (i > 0) {
      EXPECT_STREQ(es[i].phase, "the test");
    }
  }
  EXPECT_EQ(es[1].bytes, 4096);
  EXPECT_STREQ(es[1].dtype, "f32");
  EXPECT_EQ(es[2].bytes, 16);
  EXPECT_STREQ(es[2].dtype, "bf16");
  EXPECT_EQ(es[2].peer, 0);
  EXPECT_EQ(es[3].bytes, 16 * 4);
  // The init timeout (5 s) has long passed its deadline after this; the watchdog must not act on it.
  std::this_thread::sleep_for(5500ms);
  pg->all_reduce(a)->wait();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  for (double v : to_vector(to_device(a, kCPU))) ASSERT_EQ(v, 1.0);  // one rank: the sum is itself
  test::TempDir dir;
  FlightRecorder::global().set_dump_target(dir.str(), 0, 1);
  const std::string path = FlightRecorder::global().dump("the test's dump");
  ASSERT_FALSE(path.empty());
  const std::string summary = summarize_dump(path);
  EXPECT_NE(summary.find("last completed flight #"), std::string::npos) << summary;
}

void init_stuck_case() {
  auto store = make_store();
  // Rank 0 of 2; rank 1 never starts.
  auto pg = make_nccl_group(*store, 0, 2, NcclOptions{.timeout = 60000ms, .device = 0, .init_timeout = 2000ms});
  std::printf("unexpected: the init returned\n");
}

void heartbeat_case() {
  auto store = make_store();
  auto pg = make_nccl_group(*store, 0, 1, NcclOptions{.timeout = 60000ms, .device = 0, .heartbeat_timeout = 1000ms});
  std::this_thread::sleep_for(30s);  // the monitor ends the process long before
  std::printf("unexpected: still running\n");
}

void CUDART_CB block_stream(void*) { std::this_thread::sleep_for(3s); }

void abort_case() {
  auto store = make_store();
  const Device dev(DeviceType::cuda, 0);
  auto pg = make_nccl_group(*store, 0, 1, NcclOptions{.timeout = 60000ms, .device = 0});
  Tensor a = to_device(full({256}, 1.0), dev);
  pg->all_reduce(a)->wait();
  BLU_CUDA_CHECK(cudaDeviceSynchronize());
  // The caller's stream is blocked for 3 s; the collective waits behind it past its 500 ms timeout.
  BLU_CUDA_CHECK(cudaLaunchHostFunc(cuda::current_stream(), block_stream, nullptr));
  pg->set_timeout(500ms);
  pg->set_phase("the blocked step");
  WorkPtr w = pg->all_reduce(a);
  const std::string e = blu::test::error_of([&] {
    for (int i = 0; i < 400 && !w->is_completed(); ++i) std::this_thread::sleep_for(10ms);
    w->wait();
  });
  EXPECT_NE(e.find("all_reduce #2 during the blocked step did not complete within the timeout of 500 ms"),
            std::string::npos)
      << e;
  const std::string refused = blu::test::error_of([&] { pg->all_reduce(a); });
  EXPECT_NE(refused.find("refusing new all_reduce"), std::string::npos) << refused;
  const auto es = entries_of("default_pg");
  ASSERT_EQ(es.size(), 3u);  // init and two all-reduces: the refused call never reached NCCL
  EXPECT_EQ(es[1].state, OpState::completed);
  EXPECT_EQ(es[2].state, OpState::failed);
  const char* dir = std::getenv("BLU_FLIGHT_RECORDER_DIR");
  ASSERT_TRUE(dir);
  const std::string summary = summarize_dump((fs::path(dir) / "rank_0.json").string());
  EXPECT_NE(summary.find("last completed default_pg #1 all_reduce"), std::string::npos) << summary;
  EXPECT_NE(summary.find("oldest not completed: default_pg #2 all_reduce during the blocked step (failed)"),
            std::string::npos)
      << summary;
  std::fflush(nullptr);
  ::_exit(::testing::Test::HasFailure() ? 1 : 0);  // skip the aborted group's teardown
}

TEST(NcclFlightWorker, Run) {
  const std::string c = flight_case();
  if (c.empty()) GTEST_SKIP() << "only runs as a rank of NcclFlight.*";
  if (c == "record") return record_case();
  if (c == "init_stuck") return init_stuck_case();
  if (c == "heartbeat") return heartbeat_case();
  if (c == "abort") return abort_case();
  FAIL() << "unknown case " << c;
}

test::LaunchResult run_case(const std::string& c, const std::string& dump_dir,
                            std::vector<std::pair<std::string, std::string>> env = {}) {
  env.emplace_back("BLU_NCCL_FLIGHT", c);
  env.emplace_back("BLU_FLIGHT_RECORDER_DIR", dump_dir);
  return test::run_command(1, {test::self_exe(), "--gtest_filter=NcclFlightWorker.Run", "--gtest_brief=1"}, env);
}

class NcclFlight : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::device_count() < 1) GTEST_SKIP() << "needs a GPU";
  }
  test::TempDir dir;
};

TEST_F(NcclFlight, OneRankRecordsItsCollectives) {
  const test::LaunchResult r = run_case("record", dir.str());
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

TEST_F(NcclFlight, StuckInitEndsWithTheRankAndTheTimeout) {
  const test::LaunchResult r = run_case("init_stuck", dir.str());
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("nccl: rank 0 of 2: ncclCommInitRank did not complete within the timeout of 2000 ms"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("unexpected"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 20.0);
  const auto j = io::read_json_file(dir.path / "rank_0.json");
  ASSERT_FALSE(j["entries"].empty());
  EXPECT_EQ(j["entries"][0]["kind"], "comm_init");
  EXPECT_EQ(j["entries"][0]["state"], "failed");
}

TEST_F(NcclFlight, StuckWatchdogIsEndedByTheHeartbeat) {
  const test::LaunchResult r = run_case("heartbeat", dir.str(), {{"BLU_TEST_NCCL_WATCHDOG_SLEEP_MS", "60000"}});
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("nccl: rank 0 of 1: the watchdog made no progress for 1000 ms"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("unexpected"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 25.0);
}

TEST_F(NcclFlight, TimedOutOperationAbortsAndLaterCallsAreRefused) {
  const test::LaunchResult r = run_case("abort", dir.str());
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

}  // namespace
}  // namespace blu::dist
