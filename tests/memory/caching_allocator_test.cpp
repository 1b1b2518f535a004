// memory/caching_allocator: the caching logic against a fake memory source and fake stream events
// (no GPU): splitting, merging, best fit, small/large pools, stream binding, record_stream,
// the out-of-memory flush-and-retry path and its message, statistics, snapshots, threads.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "blu/core/error.h"
#include "blu/memory/caching_allocator.h"

namespace blu {
namespace {

constexpr size_t KiB = 1024, MiB = 1024 * 1024;

// Hands out fake addresses (never dereferenced) up to a capacity.
class FakeSource final : public DeviceMemorySource {
 public:
  explicit FakeSource(size_t capacity = size_t(1) << 40) : capacity_(capacity) {}
  void* raw_alloc(size_t bytes) override {
    ++alloc_calls;
    if (used_ + bytes > capacity_) {
      ++refusals;
      return nullptr;
    }
    used_ += bytes;
    const uintptr_t p = next_;
    next_ += (bytes + 4 * MiB - 1) / (4 * MiB) * (4 * MiB) + 4 * MiB;  // gaps: segments never touch
    live_[p] = bytes;
    return reinterpret_cast<void*>(p);
  }
  void raw_free(void* ptr) override {
    auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
    ASSERT_NE(it, live_.end()) << "raw_free of unknown " << ptr;
    used_ -= it->second;
    live_.erase(it);
    ++free_calls;
  }
  size_t used() const { return used_; }
  size_t live() const { return live_.size(); }
  void set_capacity(size_t c) { capacity_ = c; }
  int alloc_calls = 0, free_calls = 0, refusals = 0;

 private:
  size_t capacity_;
  size_t used_ = 0;
  uintptr_t next_ = uintptr_t(1) << 32;
  std::map<uintptr_t, size_t> live_;
};

// Events complete only when the test says so (or when waited on).
class FakeEvents final : public EventSource {
 public:
  struct Ev {
    StreamId stream;
    bool done = false;
  };
  Event record(StreamId s) override {
    auto* e = new Ev{s};
    live.push_back(e);
    ++recorded;
    return e;
  }
  bool query(Event e) override { return static_cast<Ev*>(e)->done; }
  void wait(Event e) override {
    static_cast<Ev*>(e)->done = true;
    ++waits;
  }
  void release(Event e) override {
    live.erase(std::find(live.begin(), live.end(), static_cast<Ev*>(e)));
    delete static_cast<Ev*>(e);
  }
  void complete(StreamId s) {
    for (Ev* e : live)
      if (e->stream == s) e->done = true;
  }
  ~FakeEvents() override {
    for (Ev* e : live) delete e;
  }
  std::vector<Ev*> live;
  int recorded = 0, waits = 0;
};

constexpr StreamId kA = 0x100, kB = 0x200;

struct Fixture : ::testing::Test {
  FakeSource source;
  FakeEvents events;
  std::unique_ptr<CachingAllocator> alloc = std::make_unique<CachingAllocator>(source, events, config());
  // Without the shared 20 MiB segments, so each large request's segment is its own and the
  // tests below can count them (MidSizeRequestsShareTwentyMiBSegments tests the default).
  static CachingAllocatorConfig config() {
    CachingAllocatorConfig c;
    c.name = "fake:0";
    c.mid_request = 0;
    return c;
  }
  uintptr_t addr(void* p) { return reinterpret_cast<uintptr_t>(p); }
  std::string snap() { return snapshot_text(alloc->snapshot()); }
};

using CachingAllocatorTest = Fixture;

TEST_F(CachingAllocatorTest, RoundsTo512) {
  EXPECT_EQ(alloc->round_size(0), 512u);
  EXPECT_EQ(alloc->round_size(1), 512u);
  EXPECT_EQ(alloc->round_size(512), 512u);
  EXPECT_EQ(alloc->round_size(513), 1024u);
  EXPECT_EQ(alloc->round_size(3 * MiB + 1), 3 * MiB + 512);
}

TEST_F(CachingAllocatorTest, SmallRequestsShareOneSegment) {
  void* a = alloc->malloc(100, kA);
  void* b = alloc->malloc(1000, kA);
  void* c = alloc->malloc(MiB, kA);  // the largest small request
  EXPECT_EQ(source.alloc_calls, 1) << snap();
  EXPECT_EQ(source.used(), 2 * MiB);
  // Blocks are carved in address order from the segment.
  EXPECT_EQ(addr(b), addr(a) + 512);
  EXPECT_EQ(addr(c), addr(a) + 512 + 1024);
  const auto s = alloc->stats();
  EXPECT_EQ(s.segments, 1);
  EXPECT_EQ(s.reserved_bytes, int64_t(2 * MiB));
  EXPECT_EQ(s.allocated_bytes, int64_t(512 + 1024 + MiB));
  EXPECT_EQ(s.requested_bytes, int64_t(100 + 1000 + MiB));
  EXPECT_EQ(s.active_blocks, 3);
  alloc->free(a);
  alloc->free(b);
  alloc->free(c);
}

TEST_F(CachingAllocatorTest, LargeRequestsGetTheirOwnRoundedSegment) {
  void* a = alloc->malloc(MiB + 1, kA);  // large: segment of 2 MiB, remainder < 1 MiB stays attached
  EXPECT_EQ(source.used(), 2 * MiB);
  auto segs = alloc->snapshot();
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_FALSE(segs[0].small);
  ASSERT_EQ(segs[0].blocks.size(), 1u) << snap();  // 1 MiB - 512 B left: not worth a split
  EXPECT_EQ(segs[0].blocks[0].size, 2 * MiB);
  void* b = alloc->malloc(5 * MiB, kA);
  EXPECT_EQ(source.used(), 2 * MiB + 6 * MiB);
  segs = alloc->snapshot();
  ASSERT_EQ(segs.size(), 2u);
  // 6 MiB segment, 5 MiB used: the 1 MiB tail is not more than 1 MiB, so no split.
  EXPECT_EQ(segs[1].blocks.size(), 1u) << snap();
  alloc->free(b);
  // Reusing the 6 MiB block for a 3 MiB request leaves 3 MiB: split.
  void* c = alloc->malloc(3 * MiB, kA);
  EXPECT_EQ(c, b);
  segs = alloc->snapshot();
  ASSERT_EQ(segs[1].blocks.size(), 2u) << snap();
  EXPECT_EQ(segs[1].blocks[1].size, 3 * MiB);
  EXPECT_EQ(segs[1].blocks[1].state, BlockState::free);
  EXPECT_EQ(source.alloc_calls, 2);
  alloc->free(a);
  alloc->free(c);
}

TEST(CachingAllocatorMid, MidSizeRequestsShareTwentyMiBSegments) {
  FakeSource source;
  FakeEvents events;
  CachingAllocator alloc(source, events, CachingAllocatorConfig{.name = "fake:0"});
  // One transformer layer's fp32 weights at C=768: 6.75, 2.25, 9 and 9 MiB.
  void* qkv = alloc.malloc(3 * 768 * 768 * 4, kA);
  void* proj = alloc.malloc(768 * 768 * 4, kA);
  EXPECT_EQ(source.alloc_calls, 1) << snapshot_text(alloc.snapshot());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(proj), reinterpret_cast<uintptr_t>(qkv) + 3 * 768 * 768 * 4);
  void* fc = alloc.malloc(4 * 768 * 768 * 4, kA);  // 9 MiB: 11 MiB are left, it fits
  void* fc_proj = alloc.malloc(4 * 768 * 768 * 4, kA);  // 2 MiB left: a second segment
  EXPECT_EQ(source.alloc_calls, 2);
  EXPECT_EQ(source.used(), 40 * MiB);
  // Each its own rounded segment would have taken 8 + 4 + 10 + 10 = 32 MiB for 27 MiB; shared,
  // the 13 MiB left over serve the next mid-size requests.
  auto s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes, int64_t(27 * MiB));
  EXPECT_EQ(s.free_bytes, int64_t(13 * MiB));
  void* more = alloc.malloc(10 * MiB, kA);  // the largest mid-size request fits the 11 MiB block
  EXPECT_EQ(source.alloc_calls, 2);
  // Beyond 10 MiB a request gets a segment of its own, rounded to 2 MiB.
  void* big = alloc.malloc(10 * MiB + 1, kA);
  EXPECT_EQ(source.alloc_calls, 3);
  EXPECT_EQ(source.used(), 40 * MiB + 12 * MiB);
  for (void* p : {qkv, proj, fc, fc_proj, more, big}) alloc.free(p);
  alloc.empty_cache();
  EXPECT_EQ(source.used(), 0u);
}

TEST_F(CachingAllocatorTest, PoolsAreSeparate) {
  void* big = alloc->malloc(4 * MiB, kA);
  alloc->free(big);
  void* small = alloc->malloc(1000, kA);  // does not carve the cached large block
  EXPECT_EQ(source.alloc_calls, 2);
  auto segs = alloc->snapshot();
  ASSERT_EQ(segs.size(), 2u);
  int small_segs = 0;
  for (auto& s : segs) small_segs += s.small;
  EXPECT_EQ(small_segs, 1);
  alloc->free(small);
  void* big2 = alloc->malloc(4 * MiB, kA);  // served by the cached large segment
  EXPECT_EQ(big2, big);
  EXPECT_EQ(source.alloc_calls, 2);
  alloc->free(big2);
}

TEST_F(CachingAllocatorTest, MergesNeighboursInAnyOrder) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<void*> ps;
    for (int i = 0; i < 16; ++i) ps.push_back(alloc->malloc(size_t(512) * (1 + rng() % 64), kA));
    EXPECT_EQ(source.alloc_calls, 1) << "trial " << trial;
    std::shuffle(ps.begin(), ps.end(), rng);
    for (void* p : ps) alloc->free(p);
    auto segs = alloc->snapshot();
    ASSERT_EQ(segs.size(), 1u);
    ASSERT_EQ(segs[0].blocks.size(), 1u) << "trial " << trial << "\n" << snap();
    EXPECT_EQ(segs[0].blocks[0].size, 2 * MiB);
    EXPECT_EQ(segs[0].blocks[0].state, BlockState::free);
  }
  const auto s = alloc->stats();
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.free_bytes, int64_t(2 * MiB));
  EXPECT_EQ(s.fragmentation, 0.0);
}

TEST_F(CachingAllocatorTest, MergeWithPreviousAndNext) {
  void* a = alloc->malloc(512, kA);
  void* b = alloc->malloc(512, kA);
  void* c = alloc->malloc(512, kA);
  alloc->free(a);
  alloc->free(c);  // merges with the tail
  auto segs = alloc->snapshot();
  ASSERT_EQ(segs[0].blocks.size(), 3u) << snap();  // a | b | c+tail
  alloc->free(b);  // merges with both sides
  segs = alloc->snapshot();
  ASSERT_EQ(segs[0].blocks.size(), 1u) << snap();
}

TEST_F(CachingAllocatorTest, BestFit) {
  // Carve holes of 2 KiB, 1 KiB and 4 KiB separated by live blocks.
  void* h2 = alloc->malloc(2 * KiB, kA);
  void* s1 = alloc->malloc(512, kA);
  void* h1 = alloc->malloc(1 * KiB, kA);
  void* s2 = alloc->malloc(512, kA);
  void* h4 = alloc->malloc(4 * KiB, kA);
  void* s3 = alloc->malloc(512, kA);
  alloc->free(h2);
  alloc->free(h1);
  alloc->free(h4);
  EXPECT_EQ(alloc->malloc(1000, kA), h1);  // the 1 KiB hole fits exactly
  void* x = alloc->malloc(1500, kA);       // best fit: the 2 KiB hole, not the 4 KiB one
  EXPECT_EQ(x, h2);
  void* y = alloc->malloc(3 * KiB, kA);
  EXPECT_EQ(y, h4);
  for (void* p : {h1, x, y, s1, s2, s3}) alloc->free(p);
}

TEST_F(CachingAllocatorTest, BlocksAreBoundToTheirStream) {
  void* a = alloc->malloc(1000, kA);
  alloc->free(a);
  void* b = alloc->malloc(1000, kB);
  EXPECT_NE(addr(b), addr(a));
  EXPECT_EQ(source.alloc_calls, 2) << "stream B must get its own segment";
  void* a2 = alloc->malloc(1000, kA);
  EXPECT_EQ(a2, a) << "stream A reuses its own block";
  auto segs = alloc->snapshot();
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_NE(segs[0].stream, segs[1].stream);
  alloc->free(a2);
  alloc->free(b);
}

TEST_F(CachingAllocatorTest, RecordStreamDelaysReuse) {
  void* a = alloc->malloc(4 * MiB, kA);
  alloc->record_stream(a, kB);
  alloc->record_stream(a, kB);  // once is enough
  alloc->record_stream(a, kA);  // its own stream: no event
  alloc->free(a);
  EXPECT_EQ(events.recorded, 1);
  auto s = alloc->stats();
  EXPECT_EQ(s.pending_blocks, 1);
  EXPECT_EQ(s.active_blocks, 0);
  EXPECT_EQ(s.allocated_bytes, int64_t(4 * MiB)) << "a pending block is not reusable";
  EXPECT_EQ(alloc->snapshot()[0].blocks[0].state, BlockState::pending);

  void* b = alloc->malloc(4 * MiB, kA);  // stream B has not passed the event: a new segment
  EXPECT_NE(b, a);
  EXPECT_EQ(source.alloc_calls, 2);
  events.complete(kB);
  void* c = alloc->malloc(4 * MiB, kA);  // now the block is back
  EXPECT_EQ(c, a);
  EXPECT_EQ(source.alloc_calls, 2);
  EXPECT_EQ(alloc->stats().pending_blocks, 0);
  EXPECT_TRUE(events.live.empty()) << "completed events are released";
  alloc->free(b);
  alloc->free(c);
}

// A pointer inside a held block (a compiled step's arena view) marks that block; memory outside
// every segment (a caller's own) is left alone.
TEST_F(CachingAllocatorTest, RecordStreamInsideABlockMarksItAndForeignMemoryIsLeftAlone) {
  void* a = alloc->malloc(4 * MiB, kA);
  int foreign = 0;
  alloc->record_stream(&foreign, kB);
  alloc->record_stream(static_cast<char*>(a) + 4096, kB);
  alloc->free(a);
  EXPECT_EQ(events.recorded, 1) << "the view marked its block";
  EXPECT_EQ(alloc->stats().pending_blocks, 1);
  events.complete(kB);
  void* b = alloc->malloc(4 * MiB, kA);
  EXPECT_EQ(b, a) << "the block is back once stream B passed";
  alloc->free(b);
  EXPECT_THROW(alloc->record_stream(static_cast<char*>(a) + 4096, kB), Error) << "inside a freed block";
}

TEST_F(CachingAllocatorTest, RecordStreamOnTwoStreamsNeedsBoth) {
  constexpr StreamId kC = 0x300;
  void* a = alloc->malloc(1000, kA);
  alloc->record_stream(a, kB);
  alloc->record_stream(a, kC);
  alloc->free(a);
  EXPECT_EQ(events.recorded, 2);
  events.complete(kB);
  void* b = alloc->malloc(1000, kA);
  EXPECT_NE(b, a);  // C still pending: carved next to it
  events.complete(kC);
  void* c = alloc->malloc(1000, kA);
  EXPECT_EQ(c, a);
  alloc->free(b);
  alloc->free(c);
}

TEST_F(CachingAllocatorTest, OomFlushesCacheAndRetries) {
  source.set_capacity(8 * MiB);
  void* a = alloc->malloc(4 * MiB, kA);
  alloc->free(a);                         // cached, 4 MiB reserved
  void* b = alloc->malloc(6 * MiB, kB);  // 4 + 6 > 8: flush the cached segment, retry
  EXPECT_NE(b, nullptr);
  const auto s = alloc->stats();
  EXPECT_EQ(source.refusals, 1);
  EXPECT_EQ(s.cache_flushes, 1);
  EXPECT_EQ(s.raw_frees, 1);
  EXPECT_EQ(s.reserved_bytes, int64_t(6 * MiB));
  EXPECT_EQ(s.num_ooms, 0);
  alloc->free(b);
}

TEST_F(CachingAllocatorTest, OomWaitsForPendingEvents) {
  source.set_capacity(8 * MiB);
  void* a = alloc->malloc(4 * MiB, kA);
  alloc->record_stream(a, kB);
  alloc->free(a);
  void* b = alloc->malloc(6 * MiB, kA);
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(events.waits, 1);
  EXPECT_EQ(alloc->stats().pending_blocks, 0);
  alloc->free(b);
}

TEST_F(CachingAllocatorTest, OomErrorShowsTheNumbers) {
  source.set_capacity(8 * MiB);
  void* a = alloc->malloc(2 * MiB, kA);
  void* b = alloc->malloc(4 * MiB, kA);
  alloc->free(a);  // 2 MiB cached, but 4 + 6 > 8 even after the flush
  try {
    alloc->malloc(6 * MiB, kA);
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("fake:0: out of memory allocating 6.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("6291456 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Allocated: 4.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("reserved: 4.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("largest free block 0 B"), std::string::npos) << msg;
  }
  const auto s = alloc->stats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.cache_flushes, 1);
  EXPECT_EQ(s.reserved_bytes, int64_t(4 * MiB));
  // The allocator still works after an OOM.
  void* c = alloc->malloc(MiB, kA);
  EXPECT_NE(c, nullptr);
  alloc->free(c);
  alloc->free(b);
}

TEST_F(CachingAllocatorTest, OomMessageNamesFragmentation) {
  source.set_capacity(2 * MiB);
  std::vector<void*> ps;
  for (int i = 0; i < 8; ++i) ps.push_back(alloc->malloc(256 * KiB, kA));
  for (int i = 0; i < 8; i += 2) alloc->free(ps[i]);  // 1 MiB free in 256 KiB pieces
  try {
    alloc->malloc(512 * KiB, kA);
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cached free: 1.00 MiB, largest free block 256.00 KiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fragmented"), std::string::npos) << msg;
  }
  const auto s = alloc->stats();
  EXPECT_EQ(s.free_bytes, int64_t(MiB));
  EXPECT_EQ(s.largest_free_block, int64_t(256 * KiB));
  EXPECT_DOUBLE_EQ(s.fragmentation, 0.75);
  for (int i = 1; i < 8; i += 2) alloc->free(ps[i]);
  EXPECT_EQ(alloc->stats().fragmentation, 0.0);
}

TEST_F(CachingAllocatorTest, StatsPeaksAndCounts) {
  void* a = alloc->malloc(3 * MiB, kA);
  void* b = alloc->malloc(1000, kA);
  alloc->free(a);
  auto s = alloc->stats();
  EXPECT_EQ(s.allocs, 2);
  EXPECT_EQ(s.frees, 1);
  EXPECT_EQ(s.raw_allocs, 2);
  EXPECT_EQ(s.requested_bytes, 1000);
  EXPECT_EQ(s.requested_peak, int64_t(3 * MiB + 1000));
  EXPECT_EQ(s.allocated_bytes, 1024);
  EXPECT_EQ(s.allocated_peak, int64_t(4 * MiB + 1024));  // 3 MiB took its whole 4 MiB segment
  EXPECT_EQ(s.reserved_bytes, int64_t(4 * MiB + 2 * MiB));
  EXPECT_EQ(s.reserved_peak, s.reserved_bytes);
  EXPECT_EQ(s.free_bytes, s.reserved_bytes - s.allocated_bytes);
  alloc->reset_peak();
  s = alloc->stats();
  EXPECT_EQ(s.requested_peak, 1000);
  EXPECT_EQ(s.allocated_peak, 1024);
  alloc->empty_cache();  // the large segment goes; the small one holds b
  s = alloc->stats();
  EXPECT_EQ(s.reserved_bytes, int64_t(2 * MiB));
  EXPECT_EQ(s.reserved_peak, int64_t(6 * MiB)) << "peaks stay until reset";
  EXPECT_EQ(s.segments, 1);
  EXPECT_EQ(s.raw_frees, 1);
  alloc->free(b);
  alloc->empty_cache();
  s = alloc->stats();
  EXPECT_EQ(s.reserved_bytes, 0);
  EXPECT_EQ(s.segments, 0);
  EXPECT_EQ(source.live(), 0u);
}

TEST_F(CachingAllocatorTest, WarmLoopMakesNoRawAllocations) {
  auto step = [&] {
    std::vector<void*> ps;
    for (size_t n : {size_t(100), 64 * KiB, 3 * MiB, 40 * MiB, 700 * KiB, size_t(12345)}) ps.push_back(alloc->malloc(n, kA));
    for (size_t i = ps.size(); i-- > 0;) alloc->free(ps[i]);
  };
  step();
  const int64_t raw = alloc->stats().raw_allocs;
  for (int i = 0; i < 50; ++i) step();
  EXPECT_EQ(alloc->stats().raw_allocs, raw);
}

TEST_F(CachingAllocatorTest, SnapshotListsEverySegmentAndBlock) {
  void* a = alloc->malloc(1000, kA);
  void* b = alloc->malloc(3 * MiB, kB);
  const auto segs = alloc->snapshot();
  ASSERT_EQ(segs.size(), 2u);
  for (const SegmentInfo& s : segs) {
    size_t covered = 0;
    for (const BlockInfo& blk : s.blocks) {
      EXPECT_EQ(blk.offset, covered) << "blocks tile the segment";
      covered += blk.size;
    }
    EXPECT_EQ(covered, s.size);
  }
  const SegmentInfo& small = segs[0].small ? segs[0] : segs[1];
  EXPECT_EQ(small.address, addr(a));
  EXPECT_EQ(small.stream, kA);
  ASSERT_EQ(small.blocks.size(), 2u);
  EXPECT_EQ(small.blocks[0].state, BlockState::allocated);
  EXPECT_EQ(small.blocks[0].requested, 1000u);
  EXPECT_EQ(small.blocks[0].size, 1024u);
  EXPECT_EQ(small.blocks[1].state, BlockState::free);

  const std::string text = snapshot_text(segs);
  EXPECT_NE(text.find("small pool"), std::string::npos) << text;
  EXPECT_NE(text.find("+0 1024 B allocated (requested 1000)"), std::string::npos) << text;
  const auto j = nlohmann::json::parse(snapshot_json(segs));
  ASSERT_EQ(j.size(), 2u);
  int large = 0;
  for (const auto& s : j) {
    if (s["pool"] == "large") {
      ++large;
      EXPECT_EQ(s["stream"].get<uint64_t>(), kB);
      EXPECT_EQ(s["blocks"][0]["size"].get<size_t>(), 4 * MiB);  // 3 MiB rounded; tail 1 MiB not split
      EXPECT_EQ(s["blocks"][0]["state"], "allocated");
    }
  }
  EXPECT_EQ(large, 1);
  alloc->free(a);
  alloc->free(b);
}

TEST_F(CachingAllocatorTest, BadFreeIsAnInternalError) {
  void* a = alloc->malloc(10, kA);
  alloc->free(a);
  EXPECT_THROW(alloc->free(a), InternalError);
  EXPECT_THROW(alloc->record_stream(a, kB), Error);
  alloc->free(nullptr);  // a no-op, like free(3)
}

TEST_F(CachingAllocatorTest, DestructorGivesFreeSegmentsBack) {
  void* a = alloc->malloc(5 * MiB, kA);
  void* b = alloc->malloc(100, kA);
  alloc->free(a);
  alloc->free(b);
  alloc.reset();
  EXPECT_EQ(source.live(), 0u);
}

TEST_F(CachingAllocatorTest, ThreadsSmoke) {
  constexpr int kThreads = 8, kIters = 2000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::pair<void*, size_t>> live;
      const StreamId s = t % 2 ? kA : kB;
      for (int i = 0; i < kIters; ++i) {
        if (live.size() < 8 && rng() % 3) {
          const size_t n = rng() % 4 ? 1 + rng() % (64 * KiB) : MiB + rng() % (3 * MiB);
          live.emplace_back(alloc->malloc(n, s), n);
        } else if (!live.empty()) {
          const size_t k = rng() % live.size();
          alloc->free(live[k].first);
          live.erase(live.begin() + long(k));
        }
      }
      for (auto& [p, n] : live) alloc->free(p);
    });
  }
  for (auto& t : ts) t.join();
  const auto s = alloc->stats();
  EXPECT_EQ(s.active_blocks, 0);
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.requested_bytes, 0);
  EXPECT_EQ(s.allocs, s.frees);
  for (const SegmentInfo& seg : alloc->snapshot()) EXPECT_EQ(seg.blocks.size(), 1u) << snap();
  alloc->empty_cache();
  EXPECT_EQ(source.live(), 0u);
}

TEST_F(CachingAllocatorTest, LiveBlocksNeverOverlap) {
  std::mt19937 rng(3);
  std::map<uintptr_t, size_t> live;  // addr → requested
  for (int i = 0; i < 5000; ++i) {
    if (live.size() < 64 && rng() % 2) {
      const size_t n = rng() % 8 ? rng() % (200 * KiB) : rng() % (9 * MiB);
      const StreamId s = rng() % 2 ? kA : kB;
      const uintptr_t p = addr(alloc->malloc(n, s));
      auto it = live.lower_bound(p);
      if (it != live.end()) {
        ASSERT_LE(p + n, it->first) << "overlaps the next live block";
      }
      if (it != live.begin()) {
        --it;
        ASSERT_LE(it->first + it->second, p) << "overlaps the previous live block";
      }
      live[p] = n;
    } else if (!live.empty()) {
      auto it = live.begin();
      std::advance(it, long(rng() % live.size()));
      alloc->free(reinterpret_cast<void*>(it->first));
      live.erase(it);
    }
  }
  for (auto& [p, n] : live) alloc->free(reinterpret_cast<void*>(p));
  EXPECT_EQ(alloc->stats().allocated_bytes, 0);
}

}  // namespace
}  // namespace blu
