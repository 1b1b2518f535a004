#include "blu/compiler/remat.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "blu/compiler/memory_plan.h"

namespace blu::compiler {

const std::vector<std::string>& remat_ops() {
  static const std::vector<std::string> ops = {
      "neg",  "exp",  "log",        "sqrt",       "rsqrt",     "tanh",   "sigmoid", "relu",
      "gelu", "silu", "abs",        "sign",       "clamp",     "add",    "sub",     "mul",
      "div",  "pow",  "pow_scalar", "add_scalar", "mul_scalar", "where", "cast",    "clone",
      "swiglu", "layer_norm", "rms_norm", "rotary_embedding", "softmax", "embedding"};
  return ops;
}

std::string RematResult::summary() const {
  size_t bytes = 0;
  std::map<std::string, int> by_op;
  for (const RematChoice& c : choices) {
    bytes += c.bytes;
    ++by_op[c.name];
  }
  std::ostringstream os;
  os << choices.size() << " buffers recomputed (";
  for (const auto& [name, count] : by_op) os << name << " " << count << ", ";
  os << format_bytes(bytes) << "), live peak "
     << format_bytes(peak_before) << " → " << format_bytes(peak_after) << "; recompute writes "
     << format_bytes(written_bytes) << " per step";
  return os.str();
}

namespace {

bool is_view_output(const Op& op, int j) {
  return std::any_of(op.views.begin(), op.views.end(), [&](const auto& p) { return p.first == j; });
}

// A buffer that may be dropped across its largest gap: its producer, where the gap is, and the
// ops after it that touch the buffer.
struct Candidate {
  int buffer = -1, op = -1, last_before = -1, before = -1;
  std::vector<int> later;  // ops from `before` on that touch the buffer
  std::vector<int> inputs;  // the producer's input buffers
  size_t written = 0;       // the bytes the producer writes
};

}  // namespace

RematResult rematerialize(FusedGraph& f, const RematOptions& o) {
  const Graph& g = f.graph;
  const std::vector<std::string>& allowed = o.ops.empty() ? remat_ops() : o.ops;
  const size_t n = g.ops.size(), nb = g.buffers.size();
  auto buf = [&](int v) { return g.values[size_t(v)].buffer; };

  std::vector<std::vector<int>> touches(nb), writers(nb), definers(nb);
  for (size_t i = 0; i < n; ++i) {
    const Op& op = g.ops[i];
    auto touch = [&](int v) {
      if (v < 0) return;
      std::vector<int>& t = touches[size_t(buf(v))];
      if (t.empty() || t.back() != int(i)) t.push_back(int(i));
    };
    for (int v : op.inputs) touch(v);
    for (int v : op.outputs) touch(v);
    for (int w : op.writes)
      if (op.inputs[size_t(w)] >= 0) writers[size_t(buf(op.inputs[size_t(w)]))].push_back(int(i));
    for (size_t j = 0; j < op.outputs.size(); ++j)
      if (op.kind != OpKind::view && !is_view_output(op, int(j))) definers[size_t(buf(op.outputs[j]))].push_back(int(i));
  }
  auto written_between = [&](int b, int lo, int hi) {
    return std::any_of(writers[size_t(b)].begin(), writers[size_t(b)].end(), [&](int w) { return w > lo && w < hi; });
  };
  auto listed = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };

  // The candidates, from the graph alone.
  std::vector<Candidate> cands;
  for (size_t b = 0; b < nb; ++b) {
    if (g.buffers[b].kind != BufferKind::temporary || definers[b].size() != 1 || !writers[b].empty()) continue;
    const int p = definers[b][0];
    const Op& op = g.ops[size_t(p)];
    const std::vector<int>& t = touches[b];
    if (t.size() < 2 || t.front() != p || op.kind != OpKind::kernel || op.rng || !op.writes.empty() ||
        !op.views.empty() || !listed(allowed, op.name) || listed(o.exclude, op.name) || f.source[size_t(p)] < 0)
      continue;
    bool outputs_fresh = true;  // every output on a temporary that only this op defines and none updates
    for (int v : op.outputs)
      outputs_fresh &= g.buffers[size_t(buf(v))].kind == BufferKind::temporary &&
                       definers[size_t(buf(v))].size() == 1 && writers[size_t(buf(v))].empty();
    if (!outputs_fresh) continue;
    size_t gap_at = 0;
    for (size_t k = 1; k < t.size(); ++k)
      if (t[k] - t[k - 1] > t[gap_at + 1] - t[gap_at]) gap_at = k - 1;
    Candidate c;
    c.buffer = int(b);
    c.op = p;
    c.last_before = t[gap_at];
    c.before = t[gap_at + 1];
    if (c.before - c.last_before < 2) continue;
    c.later.assign(t.begin() + std::ptrdiff_t(gap_at + 1), t.end());
    bool ok = true;
    for (int i : c.later) ok &= g.ops[size_t(i)].kind != OpKind::collective;
    for (int v : op.inputs) {
      if (v < 0) continue;
      const int x = buf(v);
      if (x == int(b) || written_between(x, p, c.before)) ok = false;
      if (g.buffers[size_t(x)].kind == BufferKind::temporary && touches[size_t(x)].back() < c.before) ok = false;
      c.inputs.push_back(x);
    }
    for (int v : op.outputs) c.written += g.buffers[size_t(buf(v))].nbytes;
    if (ok) cands.push_back(std::move(c));
  }

  // The live-bytes profile of the temporaries, with the choices so far.
  std::vector<int> split(nb, -1);  // per buffer: the candidate chosen for it
  std::vector<char> pinned(nb, 0), producer_used(n, 0);
  auto profile = [&] {
    std::vector<int64_t> d(n + 1, 0);
    auto add = [&](int a, int z, size_t bytes) {
      d[size_t(a)] += int64_t(bytes);
      d[size_t(z) + 1] -= int64_t(bytes);
    };
    for (size_t b = 0; b < nb; ++b) {
      if (g.buffers[b].kind != BufferKind::temporary || touches[b].empty()) continue;
      const size_t bytes = g.buffers[b].nbytes;
      if (split[b] < 0) {
        add(touches[b].front(), touches[b].back(), bytes);
      } else {
        const Candidate& c = cands[size_t(split[b])];
        add(touches[b].front(), c.last_before, bytes);
        add(c.before, touches[b].back(), bytes);
        add(c.before, c.before, c.written - bytes);  // the producer's other outputs, for an instant
      }
    }
    std::vector<int64_t> live(n, 0);
    int64_t run = 0;
    for (size_t i = 0; i < n; ++i) live[i] = run += d[i];
    return live;
  };

  RematResult r;
  std::vector<int64_t> live = profile();
  auto peak_of = [&](const std::vector<int64_t>& l) {
    return size_t(std::max_element(l.begin(), l.end()) - l.begin());
  };
  r.peak_before = n ? size_t(live[peak_of(live)]) : 0;
  for (;;) {
    if (n == 0) break;
    const size_t at = peak_of(live);
    if (o.target_bytes > 0 && size_t(live[at]) <= o.target_bytes) break;
    int best = -1;
    for (size_t k = 0; k < cands.size(); ++k) {
      const Candidate& c = cands[k];
      if (split[size_t(c.buffer)] >= 0 || pinned[size_t(c.buffer)] || producer_used[size_t(c.op)]) continue;
      if (!(c.last_before < int(at) && int(at) < c.before)) continue;
      bool inputs_free = true;  // no input is a buffer dropped across a gap of its own
      for (int x : c.inputs) inputs_free &= split[size_t(x)] < 0;
      if (!inputs_free) continue;
      if (best < 0 || g.buffers[size_t(c.buffer)].nbytes > g.buffers[size_t(cands[size_t(best)].buffer)].nbytes)
        best = int(k);
    }
    if (best < 0) break;
    const Candidate& c = cands[size_t(best)];
    split[size_t(c.buffer)] = best;
    producer_used[size_t(c.op)] = 1;
    for (int x : c.inputs) pinned[size_t(x)] = 1;
    r.choices.push_back({c.buffer, c.op, c.before, g.buffers[size_t(c.buffer)].nbytes, g.ops[size_t(c.op)].name});
    r.written_bytes += c.written;
    live = profile();
  }
  r.peak_after = n ? size_t(live[peak_of(live)]) : 0;
  if (r.choices.empty()) return r;

  // The rewrite: new values and buffers appended; ops inserted before their `before` op.
  Graph ng;
  ng.buffers = g.buffers;
  ng.values = g.values;
  ng.inputs = g.inputs;
  ng.outputs = g.outputs;
  std::vector<Op> ops = g.ops;
  std::vector<std::vector<Op>> inserts(n);
  std::vector<std::vector<int>> insert_sources(n);
  for (const RematChoice& ch : r.choices) {
    const Candidate& c = cands[size_t(split[size_t(ch.buffer)])];
    const Op& p = g.ops[size_t(c.op)];
    Op again;
    again.kind = OpKind::kernel;
    again.name = p.name;
    again.def = p.def;
    again.attrs = p.attrs;
    again.inputs = p.inputs;
    int fresh = -1;  // the new value standing for the producer's output on the dropped buffer
    for (int v : p.outputs) {
      const Buffer& old = g.buffers[size_t(buf(v))];
      Buffer nbuf;
      nbuf.nbytes = old.nbytes;
      nbuf.device = old.device;
      nbuf.kind = BufferKind::temporary;
      Value nv = g.values[size_t(v)];
      nv.buffer = ng.add_buffer(nbuf);
      const int id = ng.add_value(nv);
      again.outputs.push_back(id);
      if (buf(v) == c.buffer) fresh = id;
    }
    inserts[size_t(c.before)].push_back(std::move(again));
    insert_sources[size_t(c.before)].push_back(f.source[size_t(c.op)]);
    const int nbuf = ng.values[size_t(fresh)].buffer;
    // Every value on the dropped buffer that an op from `before` on touches gets its twin on the new one.
    std::map<int, int> twin;
    for (int v : p.outputs)
      if (buf(v) == c.buffer) twin[v] = fresh;
    auto twin_of = [&](int v, bool defined_here) {
      if (auto it = twin.find(v); it != twin.end()) return it->second;
      Value nv = g.values[size_t(v)];
      nv.buffer = nbuf;
      const int id = ng.add_value(nv);
      twin[v] = id;
      if (!defined_here) {  // a view made before the gap: made again of the new buffer
        Op alias;
        alias.kind = OpKind::view;
        alias.name = "alias";
        alias.inputs = {fresh};
        alias.outputs = {id};
        alias.views = {{0, 0}};
        inserts[size_t(c.before)].push_back(std::move(alias));
        insert_sources[size_t(c.before)].push_back(f.source[size_t(c.op)]);
      }
      return id;
    };
    for (int i : c.later) {
      Op& op = ops[size_t(i)];
      for (int& v : op.outputs)
        if (v >= 0 && buf(v) == c.buffer) v = twin_of(v, true);
      for (int& v : op.inputs)
        if (v >= 0 && buf(v) == c.buffer) v = twin_of(v, false);
    }
  }
  std::vector<int> source;
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < inserts[i].size(); ++k) {
      ng.ops.push_back(std::move(inserts[i][k]));
      source.push_back(insert_sources[i][k]);
    }
    ng.ops.push_back(std::move(ops[i]));
    source.push_back(f.source[i]);
  }
  for (size_t i = 0; i < ng.ops.size(); ++i)
    for (int v : ng.ops[i].outputs) ng.values[size_t(v)].producer = int(i);
  f.remade_by.assign(size_t(f.capture_buffers), -1);
  for (const RematChoice& ch : r.choices)
    if (ch.buffer < f.capture_buffers) f.remade_by[size_t(ch.buffer)] = f.source[size_t(ch.op)];
  f.graph = std::move(ng);
  f.source = std::move(source);
  return r;
}

}  // namespace blu::compiler
