#include "blu/compiler/memory_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <sstream>

namespace blu::compiler {

std::string format_bytes(size_t bytes) {
  char buf[32];
  if (bytes < 1024)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else if (bytes < (size_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.1f KiB", double(bytes) / 1024.0);
  else if (bytes < (size_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(1 << 30));
  return buf;
}

size_t MemoryPlan::arena_bytes() const {
  size_t s = 0;
  for (const Arena& a : arenas) s += a.bytes;
  return s;
}

std::string MemoryPlan::summary() const {
  std::ostringstream os;
  os << "peak " << format_bytes(peak_bytes()) << " (arena " << format_bytes(arena_bytes()) << " for " << arena_buffers
     << " buffers, live peak " << format_bytes(peak_live_bytes) << "; held " << format_bytes(held_bytes)
     << "; step outputs " << format_bytes(output_bytes);
  if (excluded_buffers > 0)
    os << "; " << excluded_buffers << " excluded temporaries outside the arena, at most " << format_bytes(excluded_bytes)
       << " live";
  os << ")";
  return os.str();
}

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

namespace {

// Bytes live at each op of a schedule, from intervals [first, last] (inclusive).
class LiveBytes {
 public:
  explicit LiveBytes(size_t ops) : delta_(ops + 1, 0) {}
  void add(int first, int last, size_t bytes) {
    delta_[size_t(first)] += int64_t(bytes);
    delta_[size_t(last) + 1] -= int64_t(bytes);
  }
  size_t peak() const {
    int64_t cur = 0, most = 0;
    for (int64_t d : delta_) most = std::max(most, cur += d);
    return size_t(most);
  }

 private:
  std::vector<int64_t> delta_;
};

}  // namespace

MemoryPlan plan_memory(const Graph& g, const PlanOptions& o) {
  MemoryPlan plan;
  const size_t nb = g.buffers.size();
  plan.placements.resize(nb);
  plan.frees_after.resize(g.ops.size());
  // Live intervals: every op that defines, reads or writes a value on the buffer.
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const Op& op = g.ops[i];
    auto touch = [&](int v) {
      if (v < 0) return;
      Placement& p = plan.placements[size_t(g.values[size_t(v)].buffer)];
      if (p.first < 0) p.first = int(i);
      p.last = int(i);
    };
    for (int v : op.inputs) touch(v);
    for (int v : op.outputs) touch(v);
  }
  // Buffers an excluded op defines or writes: kept out of the arena.
  std::vector<bool> excluded(nb, false);
  if (!o.exclude.empty())
    for (const Op& op : g.ops) {
      if (std::find(o.exclude.begin(), o.exclude.end(), op.name) == o.exclude.end()) continue;
      for (int v : op.outputs) excluded[size_t(g.values[size_t(v)].buffer)] = true;
      for (int i : op.writes)
        if (op.inputs[size_t(i)] >= 0) excluded[size_t(g.values[size_t(op.inputs[size_t(i)])].buffer)] = true;
    }
  // An excluded temporary that a collective touches stays until the step ends (the collective's
  // wait may come later than its last use in the schedule).
  std::vector<bool> held_to_end(nb, false);
  for (const Op& op : g.ops)
    if (op.kind == OpKind::collective) {
      for (int v : op.inputs)
        if (v >= 0) held_to_end[size_t(g.values[size_t(v)].buffer)] = true;
      for (int v : op.outputs) held_to_end[size_t(g.values[size_t(v)].buffer)] = true;
    }
  LiveBytes excluded_live(g.ops.size());
  plan.releases_after.resize(g.ops.size());
  std::vector<int> temps;
  for (size_t b = 0; b < nb; ++b) {
    const Buffer& buf = g.buffers[b];
    Placement& p = plan.placements[b];
    p.nbytes = buf.nbytes;
    if (buf.kind == BufferKind::temporary) {
      if (p.first < 0) continue;  // never touched (cannot happen for a captured buffer)
      if (excluded[b]) {
        held_to_end[b] ? excluded_live.add(p.first, int(g.ops.size()) - 1, buf.nbytes)
                       : excluded_live.add(p.first, p.last, buf.nbytes);
        if (!held_to_end[b]) plan.releases_after[size_t(p.last)].push_back(int(b));
        ++plan.excluded_buffers;
        continue;
      }
      temps.push_back(int(b));
    } else if (buf.kind == BufferKind::step_output) {
      plan.output_bytes += buf.nbytes;
    } else {
      plan.held_bytes += buf.nbytes;
    }
  }
  // Best fit, largest first.
  std::stable_sort(temps.begin(), temps.end(), [&](int a, int b) {
    return g.buffers[size_t(a)].nbytes > g.buffers[size_t(b)].nbytes;
  });
  std::vector<int> placed;
  for (int b : temps) {
    Placement& p = plan.placements[size_t(b)];
    const Device dev = g.buffers[size_t(b)].device;
    int arena = -1;
    for (size_t a = 0; a < plan.arenas.size(); ++a)
      if (plan.arenas[a].device == dev) arena = int(a);
    if (arena < 0) {
      plan.arenas.push_back({dev, 0});
      arena = int(plan.arenas.size()) - 1;
    }
    p.in_arena = true;
    p.arena = arena;
    const size_t size = align_up(std::max<size_t>(p.nbytes, 1), o.alignment);
    {
      std::vector<std::pair<size_t, size_t>> busy;  // [offset, end) of live neighbours
      for (int q : placed) {
        const Placement& pq = plan.placements[size_t(q)];
        if (pq.arena == arena && pq.first <= p.last && p.first <= pq.last)
          busy.emplace_back(pq.offset, pq.offset + align_up(std::max<size_t>(pq.nbytes, 1), o.alignment));
      }
      std::sort(busy.begin(), busy.end());
      size_t best = SIZE_MAX, best_gap = SIZE_MAX, cursor = 0;
      for (const auto& [lo, hi] : busy) {
        if (lo > cursor && lo - cursor >= size && lo - cursor < best_gap) {
          best = cursor;
          best_gap = lo - cursor;
        }
        cursor = std::max(cursor, hi);
      }
      p.offset = best != SIZE_MAX ? best : cursor;
    }
    plan.arenas[size_t(arena)].bytes = std::max(plan.arenas[size_t(arena)].bytes, p.offset + size);
    placed.push_back(b);
    plan.frees_after[size_t(p.last)].push_back(b);
    ++plan.arena_buffers;
  }
  if (o.debug_overlap) {
    // Break the plan on purpose: the first two float buffers live at the same time share bytes.
    std::vector<bool> is_float(nb, false);
    for (const Value& v : g.values) is_float[size_t(v.buffer)] = is_floating(v.dtype);
    for (size_t x = 0; x < temps.size(); ++x)
      for (size_t y = x + 1; y < temps.size(); ++y) {
        Placement& a = plan.placements[size_t(temps[x])];
        Placement& b = plan.placements[size_t(temps[y])];
        if (is_float[size_t(temps[x])] && is_float[size_t(temps[y])] && a.arena == b.arena && a.first <= b.last &&
            b.first <= a.last && a.offset != b.offset) {
          b.offset = a.offset;
          plan.arenas[size_t(a.arena)].bytes =
              std::max(plan.arenas[size_t(a.arena)].bytes, b.offset + align_up(b.nbytes, o.alignment));
          x = y = temps.size();
        }
      }
  }
  // The lower bound: temporary bytes live at each op.
  LiveBytes arena_live(g.ops.size());
  for (int b : temps) {
    const Placement& p = plan.placements[size_t(b)];
    arena_live.add(p.first, p.last, p.nbytes);
  }
  plan.peak_live_bytes = arena_live.peak();
  plan.excluded_bytes = excluded_live.peak();
  return plan;
}

std::string check_plan(const Graph& g, const MemoryPlan& plan) {
  std::vector<int> temps;
  for (size_t b = 0; b < g.buffers.size(); ++b)
    if (plan.placements[b].in_arena) temps.push_back(int(b));
  for (size_t x = 0; x < temps.size(); ++x)
    for (size_t y = x + 1; y < temps.size(); ++y) {
      const Placement& a = plan.placements[size_t(temps[x])];
      const Placement& b = plan.placements[size_t(temps[y])];
      const bool same_time = a.first <= b.last && b.first <= a.last;
      const bool same_bytes = a.arena == b.arena && a.offset < b.offset + b.nbytes && b.offset < a.offset + a.nbytes;
      if (same_time && same_bytes && a.nbytes && b.nbytes) {
        std::ostringstream os;
        os << "buf" << temps[x] << " [" << a.offset << ", " << a.offset + a.nbytes << ") live ops " << a.first << ".."
           << a.last << " overlaps buf" << temps[y] << " [" << b.offset << ", " << b.offset + b.nbytes << ") live ops "
           << b.first << ".." << b.last;
        return os.str();
      }
    }
  return "";
}

}  // namespace blu::compiler
