// The flight recorder's ring buffer (dist/flight_recorder.h) in one process: wrap-around keeps the
// newest `capacity` operations in order and ignores updates of overwritten ones, the dump names
// each group's last completed operation, concurrent recording and dumping never tear an entry,
// and the dump thread writes the file a signal handler asked for.
#include "blu/dist/flight_recorder.h"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "blu/io/json_file.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

FlightOp op(std::string_view group, std::string_view kind, uint64_t seq, std::string_view phase = "") {
  return FlightOp{.group = group, .backend = "gloo", .kind = kind, .seq = seq, .bytes = int64_t(seq) * 4, .phase = phase};
}

TEST(FlightRecorder, WrapAroundKeepsTheNewestInOrder) {
  FlightRecorder fr(8);
  std::vector<uint64_t> ids;
  for (uint64_t s = 1; s <= 20; ++s) ids.push_back(fr.record(op("g", "all_reduce", s)));
  EXPECT_EQ(fr.recorded(), 20u);
  const auto entries = fr.snapshot();
  ASSERT_EQ(entries.size(), 8u);
  for (size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ(entries[i].seq, 13 + i) << i;  // seq 13..20, oldest first
    EXPECT_EQ(entries[i].bytes, int64_t(13 + i) * 4);
    EXPECT_EQ(entries[i].state, OpState::enqueued);
    EXPECT_GT(entries[i].enqueued_us, 0);
  }
  // seq 3 was overwritten by seq 11 (same slot): its update must not touch seq 11's entry... which
  // itself was overwritten by seq 19. Updating 3 leaves 19 enqueued; updating 19 completes it.
  fr.update(ids[2], OpState::completed);
  EXPECT_EQ(fr.snapshot()[6].state, OpState::enqueued);
  fr.update(ids[18], OpState::started);
  fr.update(ids[18], OpState::completed);
  const FlightEntry e = fr.snapshot()[6];
  EXPECT_EQ(e.seq, 19u);
  EXPECT_EQ(e.state, OpState::completed);
  EXPECT_GE(e.completed_us, e.started_us);
  EXPECT_GE(e.started_us, e.enqueued_us);
}

TEST(FlightRecorder, JsonNamesEachGroupsLastCompleted) {
  FlightRecorder fr(16);
  const uint64_t a1 = fr.record(op("default_pg", "all_reduce", 1, "training step 1"));
  const uint64_t a2 = fr.record(op("default_pg", "broadcast", 2, "training step 2"));
  const uint64_t a3 = fr.record(op("default_pg", "all_reduce", 3, "training step 3"));
  const uint64_t b1 = fr.record(op("tp", "all_gather", 1));
  fr.record(op("tp", "all_gather", 2));
  for (uint64_t id : {a1, a2, b1}) fr.update(id, OpState::completed);
  fr.update(a3, OpState::failed);
  const nlohmann::json j = fr.to_json(1, 2, "a test");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["rank"], 1);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["reason"], "a test");
  EXPECT_EQ(j["recorded"], 5);
  ASSERT_EQ(j["entries"].size(), 5u);
  EXPECT_EQ(j["entries"][2]["state"], "failed");
  EXPECT_EQ(j["entries"][2]["kind"], "all_reduce");
  EXPECT_EQ(j["entries"][2]["dtype"], "f32");
  EXPECT_EQ(j["entries"][2]["bytes"], 12);
  EXPECT_EQ(j["last_completed"]["default_pg"]["seq"], 2);
  EXPECT_EQ(j["last_completed"]["default_pg"]["kind"], "broadcast");
  EXPECT_EQ(j["last_completed"]["default_pg"]["phase"], "training step 2");
  EXPECT_EQ(j["last_completed"]["tp"]["seq"], 1);
}

// Writers on several threads while another dumps: every entry a dump sees is whole (its fields
// were written together), ids grow, and nothing is lost from the count.
TEST(FlightRecorder, ConcurrentRecordAndDumpNeverTear) {
  // Few slots, so that writers keep reusing the slots the dumper is copying.
  constexpr size_t kSlots = 8;
  FlightRecorder fr(kSlots);
  constexpr int kThreads = 4, kOps = 300000;
  std::atomic<bool> done{false};
  std::atomic<int> dumps{0};
  std::string torn;
  std::thread dumper([&] {
    while (!done.load()) {
      const auto entries = fr.snapshot();
      for (size_t i = 0; i < entries.size(); ++i) {
        const FlightEntry& e = entries[i];
        // kind "t<k>", group "g<k>", phase "<seq>", bytes 4·seq: all from one record() call.
        const std::string k = e.kind + 1, g = e.group + 1;
        if (k != g || std::to_string(e.seq) != e.phase || e.bytes != int64_t(e.seq) * 4 ||
            (i > 0 && entries[i - 1].id >= e.id))
          torn = "entry id " + std::to_string(e.id) + ": kind " + e.kind + ", group " + e.group + ", phase " +
                 e.phase + ", seq " + std::to_string(e.seq) + ", bytes " + std::to_string(e.bytes);
      }
      (void)fr.to_json(0, 1, "concurrent");
      ++dumps;
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t)
    writers.emplace_back([&fr, t] {
      const std::string kind = "t" + std::to_string(t), group = "g" + std::to_string(t);
      for (uint64_t s = 1; s <= kOps; ++s) {
        const std::string phase = std::to_string(s);
        const uint64_t id = fr.record(op(group, kind, s, phase));
        fr.update(id, OpState::started);
        fr.update(id, OpState::completed);
      }
    });
  for (auto& w : writers) w.join();
  done = true;
  dumper.join();
  EXPECT_TRUE(torn.empty()) << torn;
  EXPECT_GT(dumps.load(), 0);
  EXPECT_EQ(fr.recorded(), uint64_t(kThreads) * kOps);
  const nlohmann::json j = fr.to_json(0, 1, "end");
  EXPECT_EQ(j["entries"].size(), kSlots);
  // The newest entry is some thread's last operation; it completed, so it is its group's last.
  const nlohmann::json& newest = j["entries"].back();
  EXPECT_EQ(newest["seq"], kOps);
  EXPECT_EQ(newest["state"], "completed");
  EXPECT_EQ(j["last_completed"][newest["group"].get<std::string>()]["seq"], kOps);
}

TEST(FlightRecorder, DumpsToTheTargetAndOnASignalRequest) {
  TempDir dir;
  const fs::path target = dir.path / "run" / "flight_recorder";
  {
    FlightRecorder fr(16);
    EXPECT_EQ(fr.dump("nothing recorded"), "");  // no target yet (and no BLU_FLIGHT_RECORDER_DIR)
    fr.set_dump_target(target.string(), 3, 4);
    EXPECT_EQ(fr.dump("nothing recorded"), "");  // a target, but nothing to say
    EXPECT_FALSE(fr.dumped());
    const uint64_t a = fr.record(op("default_pg", "all_reduce", 1, "training step 1"));
    fr.update(a, OpState::completed);
    fr.record(op("default_pg", "barrier", 2, "training step 2"));
    const std::string path = fr.dump("a collective timed out");
    EXPECT_EQ(path, (target / "rank_3.json").string());
    EXPECT_TRUE(fr.dumped());
    const nlohmann::json j = io::read_json_file(path);
    EXPECT_EQ(j["rank"], 3);
    EXPECT_EQ(j["reason"], "a collective timed out");
    EXPECT_EQ(summarize_dump(path),
              "last completed default_pg #1 all_reduce during training step 1; oldest not completed: "
              "default_pg #2 barrier during training step 2 (enqueued)");

    // What a SIGTERM handler does: the dump thread writes the file with the signal as the reason.
    fr.request_dump_from_signal(SIGTERM);
    bool seen = false;
    for (int i = 0; i < 200 && !seen; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      seen = io::read_json_file(path)["reason"] == "signal SIGTERM";
    }
    EXPECT_TRUE(seen) << "the dump thread did not rewrite " << path;
  }  // the destructor stops the dump thread
  const std::string e = blu::test::error_of([&] { summarize_dump((dir.path / "run" / "x.json").string()); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
  io::write_json_file(dir.path / "other.json", {{"version", 1}});
  const std::string e2 = blu::test::error_of([&] { summarize_dump((dir.path / "other.json").string()); });
  EXPECT_NE(e2.find("expected a flight-recorder dump"), std::string::npos) << e2;
}

}  // namespace
}  // namespace blu::dist
