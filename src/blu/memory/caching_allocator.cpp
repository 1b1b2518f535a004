// Note [Caching allocator]
//
// Asking the driver for memory (cudaMalloc) is slow and synchronises the device, and giving it
// back (cudaFree) synchronises too. A training step makes and drops thousands of tensors, so the
// allocator keeps the memory it got and hands it out again; once the first steps have run, every
// request is served from this cache and the driver is never called.
//
// Segments and blocks. Memory comes from the source in segments. A segment is cut into blocks
// that tile it exactly, linked to their neighbours in address order. Every block is free (in a
// pool), allocated (held by a caller) or pending (freed by its caller but possibly still read by
// another stream, see below).
//
// Sizes. Requests are rounded up to a multiple of 512 bytes (so every block is 512-aligned inside
// a segment). Requests up to 1 MiB are "small" and come from 2 MiB segments shared by many
// blocks; larger requests are "large". A large request up to 10 MiB that finds no free block
// gets a 20 MiB segment, whose rest serves the next ones; a larger one gets a segment of the
// request rounded up to 2 MiB. Without the 20 MiB segments every mid-size tensor would hold up
// to 2 MiB it cannot use (a 2.25 MiB projection weight takes a 4 MiB segment, whose 1.75 MiB
// tail only a request of 1-1.75 MiB could take): GPT-2's parameters, 495.5 MB, held 560 MB of
// segments that way. The two pools are separate, so a long-lived small tensor never pins down a
// big segment.
//
// Streams. A block belongs to the stream it was allocated on and is only handed out again for
// that stream. Work on one stream runs in order, so when the host frees a block while kernels
// using it are still queued, a later kernel on the same stream that gets the block runs after
// them: no synchronisation is needed. Another stream has no such order, hence the binding.
//
// Best fit. Each pool is an ordered set keyed by (stream, size, address). A request takes the
// smallest free block of its stream that is large enough (lower_bound), which leaves the large
// blocks whole for large requests.
//
// Splitting. If the chosen block is bigger than needed, the rest becomes a new free block in the
// same segment, when it is worth keeping: any remainder of 512 bytes or more in the small pool;
// in the large pool only a remainder of more than 1 MiB (smaller tails would mostly fragment).
//
// Merging. A freed block merges with a free neighbour on either side, so freeing every block of a
// segment, in any order, leaves one free block covering it.
//
// Cross-stream use. When a block is also used by another stream (record_stream), freeing it
// records an event on each such stream. The block stays pending until all of them completed;
// every malloc first looks at the pending events and returns the finished blocks to the pools.
//
// Out of memory. When the source refuses a segment, the allocator waits for the pending events,
// gives every cached segment that is wholly free back to the source, and tries once more. If that
// fails too, it throws an error that says how much was asked for, how much is held by callers,
// how much is reserved, and the largest free block (so the reader can tell exhaustion from
// fragmentation). empty_cache() gives the free segments back on request.
//
// Everything is under one mutex; the allocator never touches the memory it manages, which is
// why it runs on the CPU in tests with fake sources, streams and events.
#include "blu/memory/caching_allocator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "blu/core/error.h"

namespace blu {

struct CachingAllocator::Block {
  uintptr_t addr = 0;
  size_t size = 0;
  size_t requested = 0;
  StreamId stream = 0;
  bool small = false;
  BlockState state = BlockState::free;
  Block* prev = nullptr;  // neighbours in the segment
  Block* next = nullptr;
  int pending_events = 0;
  std::vector<StreamId> other_streams;  // from record_stream, while allocated
};

bool CachingAllocator::BlockLess::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (std::abs(v) >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

CachingAllocator::CachingAllocator(DeviceMemorySource& source, EventSource& events, CachingAllocatorConfig config)
    : source_(source), events_(events), config_(std::move(config)) {
  BLU_CHECK(config_.round > 0 && config_.small_segment % config_.round == 0 &&
                config_.small_request <= config_.small_segment && config_.large_round % config_.round == 0 &&
                config_.mid_request <= config_.mid_segment && config_.mid_segment % config_.round == 0,
            "caching allocator: inconsistent sizes (round ", config_.round, ", small segment ", config_.small_segment,
            ", small request ", config_.small_request, ", mid segment ", config_.mid_segment, ", mid request ",
            config_.mid_request, ", large round ", config_.large_round, ")");
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard lock(mu_);
  for (auto& [e, b] : pending_events_) events_.release(e);
  pending_events_.clear();
  release_cached_segments();
  // Blocks still allocated or pending are leaked on purpose: their owners may outlive us.
}

size_t CachingAllocator::round_size(size_t bytes) const {
  const size_t r = config_.round;
  return std::max<size_t>((bytes + r - 1) / r * r, r);
}

void* CachingAllocator::malloc(size_t bytes, StreamId stream) {
  std::lock_guard lock(mu_);
  process_events();
  const size_t size = round_size(bytes);
  const bool small = size <= config_.small_request;
  Pool& pool = pool_for(small);

  Block key;
  key.stream = stream;
  key.size = size;
  Block* b = nullptr;
  auto it = pool.lower_bound(&key);
  if (it != pool.end() && (*it)->stream == stream) {
    b = *it;
    pool.erase(it);
  } else {
    const size_t seg = small                         ? config_.small_segment
                       : size <= config_.mid_request ? config_.mid_segment
                                                     : (size + config_.large_round - 1) / config_.large_round * config_.large_round;
    void* p = raw_alloc_locked(seg);
    if (!p) {
      // Flush the cache and retry once: cached segments of other streams, or split ones whose
      // pieces have all come back, may be exactly what the source needs.
      wait_all_events();
      release_cached_segments();
      p = raw_alloc_locked(seg);
      if (!p) throw_oom(bytes, size, seg);
    }
    b = new Block;
    b->addr = reinterpret_cast<uintptr_t>(p);
    b->size = seg;
    b->stream = stream;
    b->small = small;
    segments_.emplace(b->addr, b);
    stats_.reserved_bytes += int64_t(seg);
    stats_.reserved_peak = std::max(stats_.reserved_peak, stats_.reserved_bytes);
    ++stats_.segments;
  }

  const size_t rest = b->size - size;
  if (small ? rest >= config_.round : rest > config_.large_split_min) {
    Block* r = new Block;
    r->addr = b->addr + size;
    r->size = rest;
    r->stream = stream;
    r->small = small;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    pool.insert(r);
  }
  count_alloc(b, bytes);
  return reinterpret_cast<void*>(b->addr);
}

void CachingAllocator::count_alloc(Block* b, size_t requested) {
  b->state = BlockState::allocated;
  b->requested = requested;
  allocated_.emplace(reinterpret_cast<void*>(b->addr), b);
  ++stats_.allocs;
  ++stats_.active_blocks;
  stats_.requested_bytes += int64_t(requested);
  stats_.requested_peak = std::max(stats_.requested_peak, stats_.requested_bytes);
  stats_.allocated_bytes += int64_t(b->size);
  stats_.allocated_peak = std::max(stats_.allocated_peak, stats_.allocated_bytes);
}

void* CachingAllocator::raw_alloc_locked(size_t bytes) {
  void* p = source_.raw_alloc(bytes);
  if (p) {
    ++stats_.raw_allocs;
    BLU_ASSERT(reinterpret_cast<uintptr_t>(p) % config_.round == 0, config_.name, ": source returned ", p,
               ", not aligned to ", config_.round, " bytes");
  }
  return p;
}

void CachingAllocator::throw_oom(size_t requested, size_t rounded, size_t segment_bytes) {
  ++stats_.num_ooms;
  CachingAllocatorStats s = stats_;
  fill_free_stats(s);
  const std::string head = detail::concat(
      config_.name, ": out of memory allocating ", format_bytes(int64_t(requested)), " (", requested,
      " bytes, rounded to ", rounded, "; a new segment of ", format_bytes(int64_t(segment_bytes)),
      " was refused even after freeing the cache). Allocated: ", format_bytes(s.allocated_bytes), " in blocks (",
      format_bytes(s.requested_bytes), " requested by ", s.active_blocks, " live allocations); reserved: ",
      format_bytes(s.reserved_bytes), " in ", s.segments, " segments; cached free: ", format_bytes(s.free_bytes),
      ", largest free block ", format_bytes(s.largest_free_block), ".",
      s.free_bytes >= int64_t(rounded) ? " The free memory is fragmented: no single block is large enough." : "");
  std::vector<LiveBlock> live;
  live.reserve(allocated_.size());
  for (const auto& [p, b] : allocated_) live.push_back({int64_t(b->requested), tags_.get(p)});
  // The device's capacity is not known here (limit 0): explain_oom names what would fit.
  MemoryReport r = make_memory_report(config_.name, int64_t(requested), 0, s.free_bytes, live);
  const std::string msg = head + "\n" + explain_oom(r);  // before r is moved into the error
  throw OutOfMemoryError(msg, std::move(r));
}

void CachingAllocator::tag(void* ptr, MemoryTag tag) {
  std::lock_guard lock(mu_);
  if (allocated_.count(ptr)) tags_.set(ptr, std::move(tag));
}

void CachingAllocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard lock(mu_);
  auto it = allocated_.find(ptr);
  BLU_ASSERT(it != allocated_.end(), config_.name, ": free of ", ptr, ", which this allocator did not hand out (or freed twice)");
  Block* b = it->second;
  allocated_.erase(it);
  tags_.erase(ptr);
  ++stats_.frees;
  --stats_.active_blocks;
  stats_.requested_bytes -= int64_t(b->requested);
  b->requested = 0;
  if (b->other_streams.empty()) {
    free_block(b);
    return;
  }
  b->state = BlockState::pending;
  ++stats_.pending_blocks;
  for (StreamId s : b->other_streams) {
    pending_events_.emplace_back(events_.record(s), b);
    ++b->pending_events;
  }
  b->other_streams.clear();
}

void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard lock(mu_);
  Block* b = nullptr;
  if (auto it = allocated_.find(ptr); it != allocated_.end()) {
    b = it->second;
  } else {
    // Not a block's start: inside one of our segments it is a view into a block (a compiled
    // step's arena view: the arena's block then waits for the stream too), which must be held;
    // outside them it is memory we did not hand out, its owner's to keep.
    const uintptr_t u = reinterpret_cast<uintptr_t>(ptr);
    auto seg = segments_.upper_bound(u);
    if (seg == segments_.begin()) return;
    for (Block* c = std::prev(seg)->second; c; c = c->next)
      if (u >= c->addr && u < c->addr + c->size) b = c;
    if (!b) return;
    BLU_CHECK(b->state == BlockState::allocated, config_.name, ": record_stream on ", ptr,
              ", which is not a live allocation");
  }
  if (stream == b->stream) return;  // its own stream orders the reuse already
  if (std::find(b->other_streams.begin(), b->other_streams.end(), stream) == b->other_streams.end())
    b->other_streams.push_back(stream);
}

void CachingAllocator::process_events() {
  for (auto it = pending_events_.begin(); it != pending_events_.end();) {
    if (!events_.query(it->first)) {
      ++it;
      continue;
    }
    events_.release(it->first);
    Block* b = it->second;
    it = pending_events_.erase(it);
    if (--b->pending_events == 0) {
      --stats_.pending_blocks;
      free_block(b);
    }
  }
}

void CachingAllocator::wait_all_events() {
  for (auto& [e, b] : pending_events_) events_.wait(e);
  process_events();
  BLU_ASSERT(pending_events_.empty(), config_.name, ": events still pending after waiting on them");
}

void CachingAllocator::free_block(Block* b) {
  b->state = BlockState::free;
  stats_.allocated_bytes -= int64_t(b->size);
  Pool& pool = pool_for(b->small);
  if (b->prev && b->prev->state == BlockState::free) {
    Block* p = b->prev;
    pool.erase(p);
    try_merge(p, b);
    b = p;
  }
  if (b->next && b->next->state == BlockState::free) {
    Block* n = b->next;
    pool.erase(n);
    try_merge(b, n);
  }
  pool.insert(b);
}

// `from` is the free block right after `into`; `into` grows over it and `from` goes.
void CachingAllocator::try_merge(Block* into, Block* from) {
  BLU_ASSERT(into->next == from && into->addr + into->size == from->addr, config_.name, ": merging blocks that are not neighbours");
  into->size += from->size;
  into->next = from->next;
  if (from->next) from->next->prev = into;
  delete from;
}

void CachingAllocator::release_cached_segments() {
  bool any = false;
  for (Pool* pool : {&small_pool_, &large_pool_}) {
    for (auto it = pool->begin(); it != pool->end();) {
      Block* b = *it;
      if (b->prev || b->next) {  // part of a segment still in use
        ++it;
        continue;
      }
      it = pool->erase(it);
      segments_.erase(b->addr);
      source_.raw_free(reinterpret_cast<void*>(b->addr));
      ++stats_.raw_frees;
      --stats_.segments;
      stats_.reserved_bytes -= int64_t(b->size);
      delete b;
      any = true;
    }
  }
  if (any) ++stats_.cache_flushes;
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mu_);
  process_events();
  release_cached_segments();
}

void CachingAllocator::fill_free_stats(CachingAllocatorStats& s) const {
  s.free_bytes = s.reserved_bytes - s.allocated_bytes;
  s.largest_free_block = 0;
  for (const Pool* pool : {&small_pool_, &large_pool_})
    for (const Block* b : *pool) s.largest_free_block = std::max(s.largest_free_block, int64_t(b->size));
  s.fragmentation = s.free_bytes > 0 ? 1.0 - double(s.largest_free_block) / double(s.free_bytes) : 0.0;
}

CachingAllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mu_);
  CachingAllocatorStats s = stats_;
  fill_free_stats(s);
  return s;
}

void CachingAllocator::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.requested_peak = stats_.requested_bytes;
  stats_.allocated_peak = stats_.allocated_bytes;
  stats_.reserved_peak = stats_.reserved_bytes;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [addr, head] : segments_) {
    SegmentInfo seg;
    seg.address = addr;
    seg.stream = head->stream;
    seg.small = head->small;
    for (const Block* b = head; b; b = b->next) {
      seg.blocks.push_back(BlockInfo{b->addr - addr, b->size, b->requested, b->state});
      seg.size += b->size;
    }
    out.push_back(std::move(seg));
  }
  return out;
}

static const char* state_name(BlockState s) {
  switch (s) {
    case BlockState::free: return "free";
    case BlockState::allocated: return "allocated";
    case BlockState::pending: return "pending";
  }
  return "?";
}

std::string snapshot_text(const std::vector<SegmentInfo>& segments) {
  std::ostringstream os;
  for (const SegmentInfo& s : segments) {
    os << "segment 0x" << std::hex << s.address << std::dec << " " << format_bytes(int64_t(s.size)) << " ("
       << (s.small ? "small" : "large") << " pool, stream 0x" << std::hex << s.stream << std::dec << ")\n";
    for (const BlockInfo& b : s.blocks) {
      os << "  +" << b.offset << " " << b.size << " B " << state_name(b.state);
      if (b.state == BlockState::allocated) os << " (requested " << b.requested << ")";
      os << "\n";
    }
  }
  return os.str();
}

std::string snapshot_json(const std::vector<SegmentInfo>& segments) {
  nlohmann::json j = nlohmann::json::array();
  for (const SegmentInfo& s : segments) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const BlockInfo& b : s.blocks)
      blocks.push_back({{"offset", b.offset}, {"size", b.size}, {"requested", b.requested}, {"state", state_name(b.state)}});
    j.push_back({{"address", s.address},
                 {"size", s.size},
                 {"stream", s.stream},
                 {"pool", s.small ? "small" : "large"},
                 {"blocks", std::move(blocks)}});
  }
  return j.dump();
}

}  // namespace blu
