// compiler/portable_graph: see portable_graph.h.
#include "blu/compiler/portable_graph.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>

#include "blu/compiler/codegen/region.h"
#include "blu/core/error.h"

namespace blu::compiler {

namespace {

const char* device_type_name(const Device& d) { return d.is_cuda() ? "cuda" : "cpu"; }

}  // namespace

std::string portable_graph_text(const Graph& g) {
  std::ostringstream os;
  // A buffer made before the step that holds no bytes (a parameter given back by split masters,
  // optim/master_split.h: no kernel reads it) is written with the extent its views reach, so that
  // the text stays a well-formed graph (the reader checks every layout against its buffer); the
  // graph in memory keeps 0 bytes for it, which is what it holds.
  std::vector<size_t> extent(g.buffers.size(), 0);
  for (const Value& v : g.values) {
    if (v.buffer < 0 || size_t(v.buffer) >= g.buffers.size() || numel(v.shape) == 0) continue;
    int64_t last = v.offset;
    for (size_t d = 0; d < v.shape.size() && d < v.strides.size(); ++d) last += (v.shape[d] - 1) * v.strides[d];
    extent[size_t(v.buffer)] = std::max(extent[size_t(v.buffer)], size_t(last + 1) * dtype_size(v.dtype));
  }
  for (size_t i = 0; i < g.buffers.size(); ++i) {
    const Buffer& b = g.buffers[i];
    const size_t nbytes = b.nbytes == 0 && b.kind != BufferKind::temporary ? extent[i] : b.nbytes;
    os << "b " << nbytes << " " << device_type_name(b.device) << " " << int(b.kind) << "\n";
  }
  for (const Value& v : g.values)
    os << "v " << v.buffer << " " << to_string(v.shape) << " " << to_string(v.strides) << " " << v.offset << " "
       << dtype_name(v.dtype) << " " << device_type_name(v.device) << " " << v.producer << "\n";
  for (const Op& op : g.ops) {
    os << "o " << int(op.kind) << " " << op.name << " (";
    for (int x : op.inputs) os << " " << x;
    os << " ) (";
    for (int x : op.outputs) os << " " << x;
    os << " ) views";
    for (const auto& [j, i] : op.views) os << " " << j << ":" << i;
    os << " writes";
    for (int x : op.writes) os << " " << x;
    // The attributes structure_hash covers: names, and the values that are compiled in (ints but
    // the per-step counters, shapes, dtypes, bools); float scalars are kernel arguments.
    for (const auto& [k, v] : op.attrs.items()) {
      os << " " << k << "#" << v.index();
      if (const auto* n = std::get_if<int64_t>(&v); n && k != "step" && k != "seed" && k != "offset") os << "=" << *n;
      if (const auto* sh = std::get_if<Shape>(&v)) os << "=" << to_string(*sh);
      if (const auto* dt = std::get_if<DType>(&v)) os << "=" << dtype_name(*dt);
      if (const auto* b = std::get_if<bool>(&v)) os << "=" << int(*b);
    }
    os << "\n";
  }
  os << "inputs";
  for (int x : g.inputs) os << " " << x;
  os << "\noutputs";
  for (int x : g.outputs) os << " " << x;
  os << "\n";
  return os.str();
}

namespace {

// Attribute names in Attrs are string_views; the names of a parsed graph live here.
std::string_view intern(const std::string& s) {
  static std::set<std::string, std::less<>> names;
  return *names.insert(s).first;
}

// One line of the portable text, read field by field; every error names the text, the line, the
// field and what was there.
struct LineReader {
  const std::string& where;
  int line_no;
  std::string_view rest;

  [[noreturn]] void fail(const std::string& what) const {
    BLU_CHECK(false, where, ":", line_no, ": expected ", what, ", got '", std::string(rest.substr(0, 40)), "'");
    std::abort();
  }
  void skip_spaces() {
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  }
  bool done() {
    skip_spaces();
    return rest.empty();
  }
  std::string word(const char* what) {
    skip_spaces();
    size_t n = 0;
    while (n < rest.size() && rest[n] != ' ') ++n;
    if (n == 0) fail(what);
    std::string w(rest.substr(0, n));
    rest.remove_prefix(n);
    return w;
  }
  void expect(std::string_view w) {
    skip_spaces();
    if (rest.substr(0, w.size()) != w) fail(std::string(1, '\'').append(w).append(1, '\''));
    rest.remove_prefix(w.size());
  }
  bool accept(std::string_view w) {
    skip_spaces();
    if (rest.substr(0, w.size()) != w) return false;
    rest.remove_prefix(w.size());
    return true;
  }
  int64_t integer(const char* what) {
    skip_spaces();
    size_t n = 0;
    if (n < rest.size() && rest[n] == '-') ++n;
    while (n < rest.size() && rest[n] >= '0' && rest[n] <= '9') ++n;
    if (n == 0 || (n == 1 && rest[0] == '-')) fail(what);
    int64_t v = 0;
    if (std::from_chars(rest.data(), rest.data() + n, v).ec != std::errc()) fail(std::string(what) + " within 64 bits");
    rest.remove_prefix(n);
    return v;
  }
  // An integer in [lo, hi).
  int64_t in_range(const char* what, int64_t lo, int64_t hi) {
    skip_spaces();
    const std::string_view at = rest;
    const int64_t v = integer(what);
    if (v < lo || v >= hi) {
      rest = at;
      fail(std::string(what) + " in [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
    }
    return v;
  }
  Shape shape(const char* what) {
    skip_spaces();
    if (rest.empty() || rest.front() != '[') fail(what);
    rest.remove_prefix(1);
    Shape out;
    skip_spaces();
    if (!rest.empty() && rest.front() == ']') {
      rest.remove_prefix(1);
      return out;
    }
    for (;;) {
      out.push_back(integer(what));
      if (accept("]")) return out;
      if (!accept(",")) fail(what);
    }
  }
  // "( 1 2 3 )"
  std::vector<int> id_list(const char* what, int64_t lo, int64_t hi) {
    expect("(");
    std::vector<int> out;
    while (!accept(")")) out.push_back(int(in_range(what, lo, hi)));
    return out;
  }
};

Device device_of(LineReader& r) {
  const std::string d = r.word("a device type (cpu or cuda)");
  if (d == "cpu") return Device(DeviceType::cpu, 0);
  if (d == "cuda") return Device(DeviceType::cuda, 0);
  r.rest = d;
  r.fail("a device type (cpu or cuda)");
}

DType dtype_of(LineReader& r) {
  const std::string d = r.word("a dtype");
  try {
    return dtype_from_name(d);
  } catch (const Error&) {
    r.rest = d;
    r.fail("a dtype name");
  }
}

// Bounds on what a text may declare: sizes and offsets below 2^48 bytes, ids within an int.
constexpr int64_t kMaxBytes = int64_t(1) << 48;
constexpr int64_t kMaxIds = std::numeric_limits<int>::max();

// Why a value's layout does not fit its buffer ("" when it does): dims and strides non-negative,
// the elements it spans, from its offset, inside the buffer's bytes.
std::string layout_error(const Value& v, const Buffer& b) {
  int64_t numel = 1, last = v.offset;  // last: the highest element index the view reaches
  for (size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] < 0 || v.strides[d] < 0) return "dims and strides of at least 0";
    if (v.shape[d] > 0 && numel > kMaxBytes / v.shape[d]) return "a shape of fewer than 2^48 elements";
    numel *= v.shape[d];
  }
  if (numel == 0) return "";
  for (size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] > 1 && v.strides[d] > (kMaxBytes - last) / (v.shape[d] - 1)) return "strides that stay within 2^48 elements";
    last += (v.shape[d] - 1) * v.strides[d];
  }
  const int64_t end = (last + 1) * int64_t(dtype_size(v.dtype));
  if (end > int64_t(b.nbytes))
    return "a layout inside its buffer (it reaches byte " + std::to_string(end) + " of a buffer of " +
           std::to_string(b.nbytes) + ")";
  return "";
}

}  // namespace

Graph parse_portable_graph_text(const std::string& text, const std::string& where) {
  Graph g;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  bool saw_inputs = false, saw_outputs = false;
  while (std::getline(in, line)) {
    ++line_no;
    LineReader r{where, line_no, line};
    const std::string tag = r.word("a record (b, v, o, inputs or outputs)");
    if (tag == "b") {
      BLU_CHECK(g.values.empty() && g.ops.empty(), where, ":", line_no, ": a buffer after the values or ops");
      Buffer b;
      b.nbytes = size_t(r.in_range("the buffer's byte count", 0, kMaxBytes));
      b.device = device_of(r);
      const int64_t kind = r.integer("the buffer's kind (0..7)");
      if (kind < 0 || kind > int64_t(BufferKind::step_output)) r.fail("a buffer kind 0..7");
      b.kind = BufferKind(kind);
      g.add_buffer(b);
    } else if (tag == "v") {
      BLU_CHECK(g.ops.empty(), where, ":", line_no, ": a value after the ops");
      Value v;
      v.buffer = int(r.in_range("the value's buffer", 0, int64_t(g.buffers.size())));
      r.skip_spaces();
      const std::string_view layout = r.rest;
      v.shape = r.shape("the value's shape [d, …]");
      v.strides = r.shape("the value's strides [s, …]");
      if (v.strides.size() != v.shape.size()) r.fail("as many strides as dims");
      v.offset = r.in_range("the value's offset", 0, kMaxBytes);
      v.dtype = dtype_of(r);
      v.device = device_of(r);
      v.producer = int(r.in_range("the value's producer op (-1: an input)", -1, kMaxIds));
      const Buffer& b = g.buffers[size_t(v.buffer)];
      if (v.device != b.device) r.fail(std::string("the device of buffer ") + std::to_string(v.buffer) + " (" +
                                       device_type_name(b.device) + ")");
      if (const std::string bad = layout_error(v, b); !bad.empty()) {
        r.rest = layout;
        r.fail(bad);
      }
      g.add_value(v);
    } else if (tag == "o") {
      Op op;
      const int64_t kind = r.integer("the op's kind (0..3)");
      if (kind < 0 || kind > int64_t(OpKind::fused)) r.fail("an op kind 0..3");
      op.kind = OpKind(kind);
      op.name = r.word("the op's name");
      const int oi = int(g.ops.size());
      const std::string_view ins = r.rest;
      op.inputs = r.id_list("an input value id or -1", -1, int64_t(g.values.size()));
      for (int x : op.inputs)
        if (x >= 0 && g.values[size_t(x)].producer >= oi) {
          r.rest = ins;
          r.fail("inputs made by earlier ops (value " + std::to_string(x) + " is made by op " +
                 std::to_string(g.values[size_t(x)].producer) + ", this is op " + std::to_string(oi) + ")");
        }
      op.outputs = r.id_list("an output value id", 0, int64_t(g.values.size()));
      r.expect("views");
      while (!r.done() && r.rest.front() != 'w') {
        const int64_t j = r.in_range("a view's output position", 0, int64_t(op.outputs.size()));
        r.expect(":");
        const int64_t i = r.in_range("a view's input position", 0, int64_t(op.inputs.size()));
        if (op.inputs[size_t(i)] < 0) r.fail("a view of an input that is defined (input " + std::to_string(i) + " is -1)");
        op.views.emplace_back(int(j), int(i));
      }
      r.expect("writes");
      while (!r.done() && (r.rest.front() == '-' || (r.rest.front() >= '0' && r.rest.front() <= '9')))
        op.writes.push_back(int(r.in_range("a written input's position", 0, int64_t(op.inputs.size()))));
      while (!r.done()) {
        // name#index[=value]
        const std::string attr = r.word("an attribute name#type[=value]");
        const size_t hash = attr.find('#');
        if (hash == std::string::npos || hash == 0) {
          r.rest = attr;
          r.fail("an attribute name#type[=value]");
        }
        const std::string key = attr.substr(0, hash);
        const size_t eq = attr.find('=', hash);
        const std::string type = attr.substr(hash + 1, eq == std::string::npos ? std::string::npos : eq - hash - 1);
        const std::string val = eq == std::string::npos ? "" : attr.substr(eq + 1);
        const bool per_step = key == "step" || key == "seed" || key == "offset";
        LineReader vr{where, line_no, val};
        AttrValue v;
        if (type == "0") {
          v = per_step ? int64_t(0) : vr.integer(("an integer value of attribute " + key).c_str());
        } else if (type == "1") {
          v = 0.0;
        } else if (type == "2") {
          v = vr.integer(("0 or 1 for attribute " + key).c_str()) != 0;
        } else if (type == "3") {
          v = dtype_of(vr);
        } else if (type == "4") {
          // The shape was split at its spaces: read on to its ']'.
          std::string whole = val;
          while (whole.find(']') == std::string::npos && !r.done()) whole.append(1, ' ').append(r.word("the rest of a shape"));
          LineReader sr{where, line_no, whole};
          v = sr.shape(("the shape of attribute " + key).c_str());
        } else {
          r.rest = attr;
          r.fail("an attribute type 0..4 (int, float, bool, dtype, shape)");
        }
        op.attrs.set(intern(key), std::move(v));
      }
      op.rng = op.attrs.has("seed") && op.attrs.has("offset");
      for (int x : op.outputs)
        if (g.values[size_t(x)].producer != oi)
          r.fail("outputs whose values name this op (" + std::to_string(oi) + ") as their producer");
      g.ops.push_back(std::move(op));
    } else if (tag == "inputs" || tag == "outputs") {
      std::vector<int>& ids = tag == "inputs" ? g.inputs : g.outputs;
      (tag == "inputs" ? saw_inputs : saw_outputs) = true;
      while (!r.done()) {
        const std::string_view at = r.rest;
        const int x = int(r.in_range("a value id", 0, int64_t(g.values.size())));
        if (tag == "inputs" && g.values[size_t(x)].producer != -1) {
          r.rest = at;
          r.fail("step inputs that no op makes (value " + std::to_string(x) + " is made by op " +
                 std::to_string(g.values[size_t(x)].producer) + ")");
        }
        ids.push_back(x);
      }
    } else {
      r.rest = tag;
      r.fail("a record b, v, o, inputs or outputs");
    }
  }
  BLU_CHECK(saw_inputs && saw_outputs, where, ": the graph ends without its 'inputs' and 'outputs' lines (cut short?)");
  for (const Value& v : g.values) {
    if (v.producer < 0) continue;
    BLU_CHECK(v.producer < int(g.ops.size()), where, ": value ", v.id, " names op ", v.producer,
              " as its producer, but the graph has ", g.ops.size(), " ops");
    const std::vector<int>& outs = g.ops[size_t(v.producer)].outputs;
    BLU_CHECK(std::find(outs.begin(), outs.end(), v.id) != outs.end(), where, ": value ", v.id, " names op ",
              v.producer, " as its producer, but that op does not list it among its outputs");
  }
  return g;
}

std::string exported_graph_text(const Graph& g, const std::string& target) {
  return "blu-fusion-graph 1\ntarget " + target + "\n" + portable_graph_text(g);
}

ExportedGraph parse_exported_graph(const std::string& text, const std::string& where) {
  const size_t l1 = text.find('\n');
  BLU_CHECK(l1 != std::string::npos && text.substr(0, l1) == "blu-fusion-graph 1", where,
            ": expected the header 'blu-fusion-graph 1', got '", text.substr(0, std::min<size_t>(l1, 40)), "'");
  const size_t l2 = text.find('\n', l1 + 1);
  BLU_CHECK(l2 != std::string::npos && text.compare(l1 + 1, 7, "target ") == 0 && l2 > l1 + 8, where,
            ":2: expected 'target <target>', got '", text.substr(l1 + 1, std::min<size_t>(l2 - l1 - 1, 40)), "'");
  ExportedGraph e;
  e.target = text.substr(l1 + 8, l2 - l1 - 8);
  e.graph = parse_portable_graph_text(text.substr(l2 + 1), where + " (after its 2 header lines)");
  return e;
}

std::string fusion_plan_text(const Graph& g, const std::vector<FusedRegion>& regions) {
  std::ostringstream os;
  os << "blu-fusion-plan 1\nstructure " << std::hex << g.structure_hash() << std::dec << "\n";
  for (const FusedRegion& r : regions) {
    os << "region " << (r.shape == RegionShape::rows ? "rows" : "pointwise") << " "
       << std::setprecision(std::numeric_limits<double>::max_digits10) << r.bytes_saved;
    for (int oi : r.ops) os << " " << oi;
    os << "\n";
  }
  return os.str();
}

std::vector<FusedRegion> parse_fusion_plan(const Graph& g, const std::string& text) {
  std::istringstream in(text);
  std::string line;
  BLU_CHECK(std::getline(in, line) && line == "blu-fusion-plan 1", "fusion plan: expected the header 'blu-fusion-plan 1', got '",
            line, "'");
  BLU_CHECK(std::getline(in, line) && line.rfind("structure ", 0) == 0, "fusion plan: expected 'structure <hash>', got '",
            line, "'");
  std::vector<FusedRegion> regions;
  std::vector<int> owner(g.ops.size(), -1);  // the region that holds each op
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream ls(line);
    std::string word, shape;
    FusedRegion r;
    ls >> word >> shape >> r.bytes_saved;
    BLU_CHECK(word == "region" && (shape == "rows" || shape == "pointwise") && !ls.fail(),
              "fusion plan: expected 'region <rows|pointwise> <bytes> <ops>', got '", line, "'");
    r.shape = shape == "rows" ? RegionShape::rows : RegionShape::pointwise;
    r.index = int(regions.size());
    for (int oi; ls >> oi;) {
      BLU_CHECK(oi >= 0 && size_t(oi) < g.ops.size(), "fusion plan: region ", r.index, " names op ", oi,
                ", expected an op index below ", g.ops.size());
      const Op& op = g.ops[size_t(oi)];
      BLU_CHECK(op.kind == OpKind::kernel && is_fusible_op(op.name), "fusion plan: region ", r.index, " names op ", oi,
                " (", op.name, "), expected a fusible kernel op");
      BLU_CHECK(r.ops.empty() || oi > r.ops.back(), "fusion plan: region ", r.index, " names op ", oi, " after op ",
                r.ops.empty() ? 0 : r.ops.back(), ", expected its ops in schedule order, each once");
      BLU_CHECK(owner[size_t(oi)] < 0, "fusion plan: region ", r.index, " names op ", oi, ", which region ",
                owner[size_t(oi)], " holds already");
      owner[size_t(oi)] = r.index;
      r.ops.push_back(oi);
    }
    BLU_CHECK(!r.ops.empty(), "fusion plan: region ", r.index, " has no ops");
    compute_region_io(g, r);
    regions.push_back(std::move(r));
  }
  return regions;
}

}  // namespace blu::compiler
