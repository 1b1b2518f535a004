#include "blu/compiler/memory_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
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
  size_t peak() const { return size_t(peak_at().second); }
  // The first op where the most bytes are live, and those bytes (-1, 0 for no ops).
  std::pair<int, int64_t> peak_at() const {
    int64_t cur = 0, most = 0;
    int at = -1;
    for (size_t i = 0; i + 1 < delta_.size(); ++i)
      if ((cur += delta_[i]) > most) {
        most = cur;
        at = int(i);
      }
    return {at, most};
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
  plan.peak_op = arena_live.peak_at().first;
  plan.excluded_bytes = excluded_live.peak();
  return plan;
}

LiveSite live_site(const Graph& g, const MemoryPlan& plan, int op) {
  LiveSite site;
  site.op = op >= 0 ? op : plan.peak_op;
  const int at = site.op;
  if (at < 0 || size_t(at) >= g.ops.size()) return site;
  const size_t nb = g.buffers.size();
  std::vector<bool> gradient(nb, false);
  for (size_t i = size_t(at); i < g.ops.size(); ++i) {
    const Op& o = g.ops[i];
    // The shapes of the parameters it updates; an input of one of them is a gradient (the update's
    // other inputs — a clipping factor, the step — are not).
    std::vector<const Shape*> updated;
    for (int w : o.writes) {
      const int v = o.inputs[size_t(w)];
      if (v >= 0 && g.buffers[size_t(g.values[size_t(v)].buffer)].kind == BufferKind::parameter)
        updated.push_back(&g.values[size_t(v)].shape);
    }
    if (updated.empty()) continue;
    for (int v : o.inputs)
      if (v >= 0 && std::any_of(updated.begin(), updated.end(),
                                [&](const Shape* s) { return *s == g.values[size_t(v)].shape; }))
        gradient[size_t(g.values[size_t(v)].buffer)] = true;
  }
  std::vector<int> definer(nb, -1);
  for (size_t i = 0; i < g.ops.size(); ++i)
    for (int v : g.ops[i].outputs) {
      const size_t b = size_t(g.values[size_t(v)].buffer);
      if (definer[b] < 0) definer[b] = int(i);
    }
  std::map<std::string, LiveGroup> by_op;
  for (size_t b = 0; b < nb; ++b) {
    const Placement& p = plan.placements[b];
    if (!p.in_arena || p.first > at || p.last < at) continue;
    const std::string name = definer[b] >= 0 ? g.ops[size_t(definer[b])].name : std::string("input");
    LiveGroup& grp = gradient[b] ? site.gradients : by_op.try_emplace(name, LiveGroup{name}).first->second;
    grp.bytes += p.nbytes;
    ++grp.buffers;
    site.bytes += p.nbytes;
  }
  for (auto& [name, grp] : by_op) site.rest.push_back(std::move(grp));
  std::stable_sort(site.rest.begin(), site.rest.end(),
                   [](const LiveGroup& x, const LiveGroup& y) { return x.bytes > y.bytes; });
  return site;
}

std::string LiveSite::describe(const Graph& g) const {
  if (op < 0) return "no temporaries in the arena";
  std::ostringstream os;
  os << format_bytes(bytes) << " at op " << op << " of " << g.ops.size() << " (" << g.ops[size_t(op)].name
     << "): gradients " << format_bytes(gradients.bytes) << " (" << gradients.buffers << " buffers)";
  for (const LiveGroup& grp : rest) os << "; " << grp.name << " " << format_bytes(grp.bytes) << " (" << grp.buffers << ")";
  return os.str();
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
