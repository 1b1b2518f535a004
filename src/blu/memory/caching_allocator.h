// memory/caching_allocator: the logic of the caching device allocator — stream-bound blocks cut
// from large raw segments, best-fit reuse, splitting and merging, event-guarded reuse across
// streams, free-and-retry on out-of-memory (an OutOfMemoryError showing memory by category,
// memory/memory_report.h), statistics and snapshots. It is plain C++ with no
// CUDA include: the raw memory and the stream events come in through two small interfaces
// (DeviceMemorySource, EventSource), so CI tests it on the CPU with fakes, and
// memory/cuda_allocator plugs in cudaMalloc and cudaEvent (and cudaHostAlloc for pinned memory).
// The algorithm is described in caching_allocator.cpp (Note [Caching allocator]).
// Depends on core/error, memory/memory_report. Keep: the allocator never reads or writes the memory it manages; a
// block goes back to a pool only when every stream that used it has passed its free; every
// public method takes the one mutex.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "blu/memory/memory_report.h"

namespace blu {

// A stream as the allocator sees it: an opaque id (a cudaStream_t cast to an integer on CUDA).
// Work on one stream runs in order; work on different streams may overlap.
using StreamId = uintptr_t;

// Where raw segments come from (cudaMalloc, cudaHostAlloc, a fake in tests).
class DeviceMemorySource {
 public:
  virtual ~DeviceMemorySource() = default;
  // nullptr when the memory is exhausted (any other failure throws).
  virtual void* raw_alloc(size_t bytes) = 0;
  virtual void raw_free(void* ptr) = 0;
};

// Events marking a point in a stream's work (cudaEvent_t on CUDA).
class EventSource {
 public:
  using Event = void*;
  virtual ~EventSource() = default;
  virtual Event record(StreamId stream) = 0;  // an event after all work queued so far on `stream`
  virtual bool query(Event e) = 0;            // has the stream reached it?
  virtual void wait(Event e) = 0;             // block the host until it has
  virtual void release(Event e) = 0;          // the allocator is done with `e`
};

struct CachingAllocatorConfig {
  std::string name = "device";          // for messages: "cuda:0", "pinned"
  size_t round = 512;                   // every block size is a multiple of this
  size_t small_request = size_t(1) << 20;  // requests up to this go to the small pool ...
  size_t small_segment = size_t(2) << 20;  // ... whose segments have this size
  size_t mid_request = size_t(10) << 20;   // larger requests up to this (0: none) share ...
  size_t mid_segment = size_t(20) << 20;   // ... segments of this size
  size_t large_round = size_t(2) << 20;    // other large segments are requests rounded up to this
  size_t large_split_min = size_t(1) << 20;  // a large block splits when more than this is left
};

struct CachingAllocatorStats {
  int64_t requested_bytes = 0, requested_peak = 0;  // bytes callers asked for, held by them
  int64_t allocated_bytes = 0, allocated_peak = 0;  // rounded blocks not reusable (held, or waiting on events)
  int64_t reserved_bytes = 0, reserved_peak = 0;    // segments held from the source
  int64_t active_blocks = 0;                        // blocks held by callers
  int64_t pending_blocks = 0;                       // freed blocks waiting on stream events
  int64_t segments = 0;
  int64_t allocs = 0, frees = 0;          // malloc / free calls
  int64_t raw_allocs = 0, raw_frees = 0;  // calls into the source (flat in a warm training loop)
  int64_t num_ooms = 0;                   // allocations that failed after flushing the cache
  int64_t cache_flushes = 0;              // times cached segments were given back (OOM retry, empty_cache)
  int64_t free_bytes = 0;                 // reserved - allocated: cached, reusable
  int64_t largest_free_block = 0;
  double fragmentation = 0;               // 1 - largest_free_block / free_bytes (0 when nothing is free)
};

enum class BlockState : uint8_t { free, allocated, pending };  // pending: freed, waiting on events

struct BlockInfo {
  size_t offset = 0;     // from the segment's base
  size_t size = 0;       // rounded
  size_t requested = 0;  // what the caller asked for (allocated blocks)
  BlockState state = BlockState::free;
};
struct SegmentInfo {
  uintptr_t address = 0;
  size_t size = 0;
  StreamId stream = 0;
  bool small = false;
  std::vector<BlockInfo> blocks;  // in address order, covering the segment
};
std::string snapshot_text(const std::vector<SegmentInfo>& segments);
std::string snapshot_json(const std::vector<SegmentInfo>& segments);

class CachingAllocator {
 public:
  // `source` and `events` must outlive the allocator.
  CachingAllocator(DeviceMemorySource& source, EventSource& events, CachingAllocatorConfig config = {});
  ~CachingAllocator();  // gives fully free segments back; blocks still held are leaked
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` for use on `stream` (0 bytes gives a minimal block). BLU_CHECK
  // with the numbers when the source is exhausted even after flushing the cache.
  void* malloc(size_t bytes, StreamId stream);
  // Returns the block. Reusable at once by its own stream; after the events of record_stream.
  void free(void* ptr);
  // `ptr` (from malloc, still held) is also used by work queued on `stream`: when freed, it is
  // reused only once `stream` has passed that point. A pointer inside a held block (a view into
  // a compiled step's arena) marks that block; one outside every segment (memory a caller owns) is
  // its owner's to keep: nothing to do. A freed block's is an error.
  void record_stream(void* ptr, StreamId stream);
  // What the block at `ptr` (held) holds, for the out-of-memory report (memory/memory_report.h);
  // dropped when it is freed.
  void tag(void* ptr, MemoryTag tag);
  // Gives every cached segment with no block in use back to the source.
  void empty_cache();

  CachingAllocatorStats stats() const;
  void reset_peak();
  std::vector<SegmentInfo> snapshot() const;
  const CachingAllocatorConfig& config() const { return config_; }
  size_t round_size(size_t bytes) const;  // the block size a request of `bytes` gets

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BlockLess>;

  Pool& pool_for(bool small) { return small ? small_pool_ : large_pool_; }
  void process_events();           // frees blocks whose events all completed
  void wait_all_events();          // blocks until every pending event completed, then frees
  void release_cached_segments();  // segments that are one free block go back to the source
  void free_block(Block* b);       // to the pool, merged with free neighbours
  void try_merge(Block* into, Block* from);
  void* raw_alloc_locked(size_t bytes);
  [[noreturn]] void throw_oom(size_t requested, size_t rounded, size_t segment_bytes);
  void count_alloc(Block* b, size_t requested);
  void fill_free_stats(CachingAllocatorStats& s) const;

  DeviceMemorySource& source_;
  EventSource& events_;
  const CachingAllocatorConfig config_;
  mutable std::mutex mu_;
  Pool small_pool_, large_pool_;
  std::unordered_map<void*, Block*> allocated_;        // held by callers
  std::deque<std::pair<EventSource::Event, Block*>> pending_events_;
  std::map<uintptr_t, Block*> segments_;              // base address → first block
  CachingAllocatorStats stats_;
  MemoryTags tags_;
};

// "1.50 MiB" — for messages.
std::string format_bytes(int64_t bytes);

}  // namespace blu
