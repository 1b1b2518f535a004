#include "blu/dist/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

#include "blu/core/error.h"

namespace blu::dist {

const char* schedule_name(PipelineScheduleKind kind) {
  switch (kind) {
    case PipelineScheduleKind::gpipe: return "gpipe";
    case PipelineScheduleKind::one_f_one_b: return "1f1b";
    case PipelineScheduleKind::interleaved: return "interleaved";
  }
  return "?";
}

PipelineScheduleKind parse_schedule_kind(const std::string& name) {
  if (name == "gpipe") return PipelineScheduleKind::gpipe;
  if (name == "1f1b") return PipelineScheduleKind::one_f_one_b;
  if (name == "interleaved") return PipelineScheduleKind::interleaved;
  BLU_CHECK(false, "pipeline: unknown schedule '", name, "' (expected gpipe, 1f1b or interleaved)");
  return {};
}

StageLayout split_blocks(int64_t num_blocks, int stages, int chunks, const std::vector<int64_t>& layers) {
  BLU_CHECK(stages >= 1, "pipeline: expected at least one stage, got ", stages);
  BLU_CHECK(chunks >= 1, "pipeline: expected at least one chunk per stage, got ", chunks);
  const int64_t V = int64_t(stages) * chunks;
  BLU_CHECK(V <= num_blocks, "pipeline: ", stages, " stages × ", chunks, " chunks = ", V,
            " virtual stages but the model has only ", num_blocks, " blocks (every stage needs at least one)");
  StageLayout l;
  l.stages = stages, l.chunks = chunks;
  if (layers.empty()) {
    BLU_CHECK(num_blocks % V == 0, "pipeline: ", num_blocks, " blocks do not split evenly over ", V,
              " virtual stages (", stages, " stages × ", chunks, " chunks); give the counts per stage "
              "(e.g. layers=", num_blocks / V + 1, ",…) for an uneven split");
    l.count.assign(size_t(V), num_blocks / V);
  } else {
    BLU_CHECK(int64_t(layers.size()) == V, "pipeline: ", layers.size(), " layer counts given for ", V,
              " virtual stages (", stages, " stages × ", chunks, " chunks)");
    for (size_t s = 0; s < layers.size(); ++s)
      BLU_CHECK(layers[s] >= 1, "pipeline: stage ", s, " would have no blocks (layer count ", layers[s],
                "); every stage needs at least one");
    const int64_t total = std::accumulate(layers.begin(), layers.end(), int64_t(0));
    BLU_CHECK(total == num_blocks, "pipeline: layer counts sum to ", total, " but the model has ", num_blocks,
              " blocks");
    l.count = layers;
  }
  int64_t at = 0;
  for (int64_t c : l.count) l.first.push_back(at), at += c;
  return l;
}

std::string to_string(const PipelineAction& a) {
  std::string s(1, a.op == PipelineAction::forward ? 'F' : 'B');
  s += std::to_string(a.micro);
  if (a.chunk != 0) s += ".c" + std::to_string(a.chunk);
  return s;
}

int64_t PipelineSchedule::max_in_flight(int rank) const {
  int64_t now = 0, most = 0;
  for (const PipelineAction& a : ranks.at(size_t(rank))) {
    now += a.op == PipelineAction::forward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

int64_t PipelineSchedule::max_in_flight() const {
  int64_t most = 0;
  for (int r = 0; r < stages; ++r) most = std::max(most, max_in_flight(r));
  return most;
}

PipelineSchedule make_schedule(PipelineScheduleKind kind, int stages, int chunks, int64_t micro) {
  BLU_CHECK(stages >= 1, "pipeline: expected at least one stage, got ", stages);
  BLU_CHECK(micro >= 1, "pipeline: expected at least one micro-batch, got ", micro);
  PipelineSchedule s;
  s.name = schedule_name(kind);
  s.stages = stages, s.chunks = chunks, s.micro_batches = micro;
  s.ranks.resize(size_t(stages));
  using A = PipelineAction;
  if (kind == PipelineScheduleKind::gpipe) {
    BLU_CHECK(chunks == 1, "pipeline: gpipe runs one chunk per stage, got ", chunks, " (use interleaved)");
    for (auto& list : s.ranks) {
      for (int64_t m = 0; m < micro; ++m) list.push_back({A::forward, m, 0});
      for (int64_t m = 0; m < micro; ++m) list.push_back({A::backward, m, 0});
    }
    return s;
  }
  if (kind == PipelineScheduleKind::one_f_one_b) {
    BLU_CHECK(chunks == 1, "pipeline: 1f1b runs one chunk per stage, got ", chunks, " (use interleaved)");
    BLU_CHECK(micro >= stages, "pipeline: 1f1b needs at least as many micro-batches as stages (", stages,
              "), got ", micro, " — with fewer, some stage never reaches its steady state");
    for (int r = 0; r < stages; ++r) {
      auto& list = s.ranks[size_t(r)];
      const int64_t warm = std::min<int64_t>(stages - r - 1, micro);
      int64_t f = 0, b = 0;
      for (; f < warm; ++f) list.push_back({A::forward, f, 0});
      for (; f < micro; ++f, ++b) list.push_back({A::forward, f, 0}), list.push_back({A::backward, b, 0});
      for (; b < micro; ++b) list.push_back({A::backward, b, 0});
    }
    return s;
  }
  BLU_CHECK(chunks >= 2, "pipeline: interleaved needs at least 2 chunks per stage, got ", chunks,
            " (with one chunk it is 1f1b)");
  BLU_CHECK(micro >= stages, "pipeline: interleaved needs at least as many micro-batches as stages (", stages,
            "), got ", micro);
  BLU_CHECK(micro % stages == 0, "pipeline: interleaved needs the micro-batch count to be a multiple of the "
            "stage count (as Megatron-LM), got ", micro, " micro-batches for ", stages, " stages");
  const int64_t p = stages, v = chunks, total = micro * v;
  const auto at = [&](int64_t k, bool forward) {
    const int64_t in_group = k % (p * v);
    int chunk = int(in_group / p);
    if (!forward) chunk = int(v - 1 - chunk);
    return A{forward ? A::forward : A::backward, (k / (p * v)) * p + k % p, chunk};
  };
  for (int r = 0; r < stages; ++r) {
    auto& list = s.ranks[size_t(r)];
    const int64_t warm = std::min<int64_t>((p - r - 1) * 2 + (v - 1) * p, total);
    int64_t f = 0, b = 0;
    for (; f < warm; ++f) list.push_back(at(f, true));
    for (; f < total; ++f, ++b) list.push_back(at(f, true)), list.push_back(at(b, false));
    for (; b < total; ++b) list.push_back(at(b, false));
  }
  return s;
}

namespace {

// The simulation shared by the checker and the timeline. A message is (kind, receiving virtual
// stage, micro-batch); kind 0 an activation, 1 a gradient.
struct Sim {
  const PipelineSchedule& s;
  int64_t slots;
  std::vector<size_t> pc;
  std::vector<int64_t> outstanding;                     // unreceived sends per rank
  std::map<std::tuple<int, int, int64_t>, int> mailbox;  // message → sending rank
  std::set<std::tuple<int, int64_t>> forwarded;          // (vs, micro) forwards done
  std::vector<std::vector<int64_t>> time;                // time[r][i]: the step action i ran at

  Sim(const PipelineSchedule& sched, int64_t send_slots) : s(sched), slots(send_slots) {
    pc.assign(size_t(s.stages), 0);
    outstanding.assign(size_t(s.stages), 0);
    time.resize(size_t(s.stages));
  }
  int V() const { return s.stages * s.chunks; }
  int vs_of(int r, const PipelineAction& a) const { return a.chunk * s.stages + r; }

  // What the next action of rank r waits for, or "" when it can run now.
  std::string blocker(int r) const {
    const PipelineAction& a = s.ranks[size_t(r)][pc[size_t(r)]];
    const int vs = vs_of(r, a);
    const bool fwd = a.op == PipelineAction::forward;
    const bool needs_recv = fwd ? vs > 0 : vs < V() - 1;
    const bool sends = fwd ? vs < V() - 1 : vs > 0;
    if (!fwd && !forwarded.count({vs, a.micro})) return "its own forward of micro-batch " + std::to_string(a.micro);
    if (needs_recv && !mailbox.count({fwd ? 0 : 1, vs, a.micro})) {
      const int from = fwd ? vs - 1 : vs + 1;
      return std::string(fwd ? "the activation" : "the gradient") + " of micro-batch " + std::to_string(a.micro) +
             " from rank " + std::to_string(from % s.stages) + " (virtual stage " + std::to_string(from) + ")";
    }
    const int to = fwd ? vs + 1 : vs - 1;
    if (sends && to % s.stages != r && slots > 0 && outstanding[size_t(r)] >= slots)
      return "a free send slot (" + std::to_string(slots) + " sends not yet received)";
    return "";
  }
  void run(int r, int64_t t) {
    const PipelineAction& a = s.ranks[size_t(r)][pc[size_t(r)]];
    const int vs = vs_of(r, a);
    const bool fwd = a.op == PipelineAction::forward;
    if (fwd ? vs > 0 : vs < V() - 1) {
      auto it = mailbox.find({fwd ? 0 : 1, vs, a.micro});
      if (it->second != r) --outstanding[size_t(it->second)];
      mailbox.erase(it);
    }
    if (fwd) forwarded.insert({vs, a.micro});
    time[size_t(r)].push_back(t);
    ++pc[size_t(r)];
  }
  void deliver(int r, const PipelineAction& a) {  // after every rank of the step ran
    const int vs = vs_of(r, a);
    const bool fwd = a.op == PipelineAction::forward;
    if (fwd ? vs == V() - 1 : vs == 0) return;
    const int to = fwd ? vs + 1 : vs - 1;
    mailbox[{fwd ? 0 : 1, to, a.micro}] = r;
    if (to % s.stages != r) ++outstanding[size_t(r)];
  }
  // Runs to the end; returns "" or the deadlock's description.
  std::string simulate() {
    for (int64_t t = 0;; ++t) {
      std::vector<int> ready;
      bool left = false;
      for (int r = 0; r < s.stages; ++r) {
        if (pc[size_t(r)] >= s.ranks[size_t(r)].size()) continue;
        left = true;
        if (blocker(r).empty()) ready.push_back(r);
      }
      if (!left) return "";
      if (ready.empty()) {
        std::ostringstream o;
        o << "pipeline: schedule " << s.name << " would deadlock (after " << t << " steps):";
        for (int r = 0; r < s.stages; ++r) {
          if (pc[size_t(r)] >= s.ranks[size_t(r)].size()) continue;
          o << "\n  rank " << r << " waits at " << to_string(s.ranks[size_t(r)][pc[size_t(r)]]) << " (action "
            << pc[size_t(r)] << ") for " << blocker(r);
        }
        return o.str();
      }
      std::vector<std::pair<int, PipelineAction>> done;
      for (int r : ready) done.push_back({r, s.ranks[size_t(r)][pc[size_t(r)]]}), run(r, t);
      for (const auto& [r, a] : done) deliver(r, a);
    }
  }
};

void check_lists(const PipelineSchedule& s) {
  BLU_CHECK(int(s.ranks.size()) == s.stages, "pipeline: schedule ", s.name, " has ", s.ranks.size(),
            " rank lists for ", s.stages, " stages");
  for (int r = 0; r < s.stages; ++r) {
    const auto& list = s.ranks[size_t(r)];
    BLU_CHECK(int64_t(list.size()) == 2 * s.micro_batches * s.chunks, "pipeline: schedule ", s.name, ", rank ", r,
              ": expected ", 2 * s.micro_batches * s.chunks, " actions (F and B of ", s.micro_batches,
              " micro-batches × ", s.chunks, " chunks), got ", list.size());
    std::vector<int64_t> next_f(size_t(s.chunks), 0), next_b(size_t(s.chunks), 0);
    for (size_t i = 0; i < list.size(); ++i) {
      const PipelineAction& a = list[i];
      BLU_CHECK(a.chunk >= 0 && a.chunk < s.chunks && a.micro >= 0 && a.micro < s.micro_batches, "pipeline: schedule ",
                s.name, ", rank ", r, ", action ", i, " (", to_string(a), ") is out of range (", s.micro_batches,
                " micro-batches, ", s.chunks, " chunks)");
      auto& next = a.op == PipelineAction::forward ? next_f : next_b;
      BLU_CHECK(a.micro == next[size_t(a.chunk)], "pipeline: schedule ", s.name, ", rank ", r, ", action ", i, " (",
                to_string(a), "): expected ", a.op == PipelineAction::forward ? "forward" : "backward",
                " of micro-batch ", next[size_t(a.chunk)], " on chunk ", a.chunk,
                " (forwards and backwards each run in micro-batch order)");
      BLU_CHECK(a.op == PipelineAction::forward || next_f[size_t(a.chunk)] > a.micro, "pipeline: schedule ", s.name,
                ", rank ", r, ", action ", i, " (", to_string(a), ") runs a backward before its forward");
      ++next[size_t(a.chunk)];
    }
  }
}

}  // namespace

void check_schedule(const PipelineSchedule& s, int64_t send_slots) {
  check_lists(s);
  Sim sim(s, send_slots);
  const std::string dead = sim.simulate();
  BLU_CHECK(dead.empty(), dead);
}

std::string timeline(const PipelineSchedule& s) {
  check_lists(s);
  Sim sim(s, 0);
  const std::string dead = sim.simulate();
  BLU_CHECK(dead.empty(), dead);
  int64_t steps = 0;
  size_t width = 2;
  for (int r = 0; r < s.stages; ++r) {
    if (!sim.time[size_t(r)].empty()) steps = std::max(steps, sim.time[size_t(r)].back() + 1);
    for (const auto& a : s.ranks[size_t(r)]) width = std::max(width, to_string(a).size());
  }
  std::ostringstream o;
  for (int r = 0; r < s.stages; ++r) {
    std::vector<std::string> cells(size_t(steps), ".");
    for (size_t i = 0; i < s.ranks[size_t(r)].size(); ++i)
      cells[size_t(sim.time[size_t(r)][i])] = to_string(s.ranks[size_t(r)][i]);
    o << "rank " << r << " |";
    for (const auto& c : cells) o << ' ' << c << std::string(width - c.size(), ' ');
    o << "\n";
  }
  return o.str();
}

}  // namespace blu::dist
