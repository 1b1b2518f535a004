#include "blu/dist/annotations.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <sstream>

#include "blu/core/error.h"

namespace blu::dist {

Annotation replicate(int64_t n, Annotation inner, std::map<std::string, std::string> args) {
  Annotation a{.kind = "replicate", .degree = n, .args = std::move(args)};
  if (!inner.empty()) a.children.push_back(std::move(inner));
  return a;
}

Annotation pipeline(int64_t n, std::map<std::string, std::string> args, std::vector<Annotation> stages) {
  return Annotation{.kind = "pipeline", .degree = n, .args = std::move(args), .children = std::move(stages)};
}

Annotation stage(std::string blocks, Annotation inner) {
  Annotation a{.kind = "stage", .blocks = std::move(blocks)};
  if (!inner.empty()) a.children.push_back(std::move(inner));
  return a;
}

Annotation split(int64_t n, std::map<std::string, std::string> args) {
  return Annotation{.kind = "split", .degree = n, .args = std::move(args)};
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::gpipe: return "gpipe";
    case Schedule::one_f_one_b: return "1f1b";
    case Schedule::interleaved: return "interleaved";
  }
  return "?";
}

// --- the text form ---------------------------------------------------------------------------

namespace {

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.'; }

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Annotation parse() {
    skip_space();
    BLU_CHECK(i_ < s_.size(), "--parallel: the annotation is empty (expected e.g. \"replicate(2)\")");
    Annotation a = node();
    skip_space();
    BLU_CHECK(i_ == s_.size(), "--parallel: at column ", i_ + 1, ": unexpected '", s_.substr(i_, 12),
              "' after the annotation's end");
    return a;
  }

 private:
  Annotation node() {
    skip_space();
    Annotation a;
    a.column = i_ + 1;
    a.kind = word("a primitive (replicate, pipeline, stage or split)");
    static const std::set<std::string> kinds = {"replicate", "pipeline", "stage", "split"};
    BLU_CHECK(kinds.count(a.kind), "--parallel: at column ", a.column, ": unknown primitive '", a.kind,
              "' (expected replicate, pipeline, stage or split)");
    expect('(');
    skip_space();
    if (a.kind == "stage") {
      a.blocks = blocks_arg();
    } else {
      const size_t at = i_ + 1;
      const std::string n = word("the degree (an integer)");
      a.degree = integer(n, at, a.kind + "'s degree");
    }
    skip_space();
    while (peek() == ',') {
      ++i_;
      skip_space();
      const size_t at = i_ + 1;
      const std::string key = word("a named argument (key=value)");
      expect('=');
      skip_space();
      BLU_CHECK(!a.args.count(key), "--parallel: at column ", at, ": ", a.kind, " has '", key, "' twice");
      a.args[key] = value();
      skip_space();
    }
    expect(')');
    skip_space();
    if (peek() == '{') {
      ++i_;
      skip_space();
      while (peek() != '}') {
        BLU_CHECK(i_ < s_.size(), "--parallel: the '{' of ", a.kind, " at column ", a.column, " is never closed");
        a.children.push_back(node());
        skip_space();
      }
      ++i_;
    }
    return a;
  }

  // "h.0-h.5", "h.0-5", "model.layers.3": a block path or a range of them.
  std::string blocks_arg() {
    std::string out = word("the stage's blocks (e.g. h.0-h.5)");
    if (peek() == '-') {
      ++i_;
      out += '-' + word("the last block of the range");
    }
    return out;
  }

  std::string value() {
    if (peek() == '[') {  // a list, kept as written without spaces
      std::string out;
      while (i_ < s_.size() && s_[i_] != ']') {
        if (!std::isspace(static_cast<unsigned char>(s_[i_]))) out += s_[i_];
        ++i_;
      }
      BLU_CHECK(i_ < s_.size(), "--parallel: a '[' list is never closed");
      ++i_;
      return out + ']';
    }
    return word("a value");
  }

  std::string word(const char* what) {
    const size_t start = i_;
    while (i_ < s_.size() && is_word_char(s_[i_])) ++i_;
    BLU_CHECK(i_ > start, "--parallel: at column ", start + 1, ": expected ", what, ", got ",
              start < s_.size() ? "'" + s_.substr(start, 1) + "'" : std::string("the end"));
    return s_.substr(start, i_ - start);
  }

  void expect(char c) {
    skip_space();
    BLU_CHECK(peek() == c, "--parallel: at column ", i_ + 1, ": expected '", std::string(1, c), "', got ",
              i_ < s_.size() ? "'" + s_.substr(i_, 1) + "'" : std::string("the end"));
    ++i_;
  }

  static int64_t integer(const std::string& s, size_t column, const std::string& what) {
    const bool digits = !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), ::isdigit);
    BLU_CHECK(digits, "--parallel: at column ", column, ": ", what, " must be a positive integer, got '", s, "'");
    return std::stoll(s);
  }

  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }

  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

Annotation parse_annotation(const std::string& text) { return Parser(text).parse(); }

std::string to_text(const Annotation& a) {
  std::ostringstream os;
  os << a.kind << '(' << (a.kind == "stage" ? a.blocks : std::to_string(a.degree));
  for (const auto& [k, v] : a.args) os << ", " << k << '=' << v;
  os << ')';
  if (!a.children.empty()) {
    os << " {";
    for (const Annotation& c : a.children) os << ' ' << to_text(c);
    os << " }";
  }
  return os.str();
}

// --- resolving ---------------------------------------------------------------------------------

namespace {

std::string where(const Annotation& a) {
  std::ostringstream os;
  os << "--parallel: " << a.kind;
  if (a.kind == "stage") os << '(' << a.blocks << ')';
  else os << '(' << a.degree << ')';
  if (a.column) os << " at column " << a.column;
  return os.str();
}

void check_keys(const Annotation& a, const std::set<std::string>& allowed) {
  for (const auto& [k, v] : a.args) {
    if (allowed.count(k)) continue;
    std::string names;
    for (const std::string& n : allowed) names += (names.empty() ? "" : ", ") + n;
    BLU_CHECK(false, where(a), ": unknown argument '", k, "' (", a.kind, " takes ",
              names.empty() ? std::string("none") : names, ")");
  }
}

std::vector<double> shares(const Annotation& a, const std::string& key, int64_t n) {
  const auto it = a.args.find(key);
  if (it == a.args.end()) return std::vector<double>(size_t(n), 1.0 / double(n));
  const std::string& s = it->second;
  BLU_CHECK(s.size() >= 2 && s.front() == '[' && s.back() == ']', where(a), ": ", key,
            " must be a list like [3,1], got '", s, "'");
  std::vector<double> w;
  std::stringstream in(s.substr(1, s.size() - 2));
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    BLU_CHECK(!item.empty() && end == item.c_str() + item.size() && std::isfinite(v) && v > 0, where(a), ": ", key,
              " holds '", item, "' (expected positive numbers)");
    w.push_back(v);
  }
  BLU_CHECK(int64_t(w.size()) == n, where(a), ": ", key, " has ", w.size(), " entries, expected ", n,
            " (one per rank of the ", a.kind, ")");
  double total = 0;
  for (double v : w) total += v;
  for (double& v : w) v /= total;
  return w;
}

bool flag(const Annotation& a, const std::string& key) {
  const auto it = a.args.find(key);
  if (it == a.args.end()) return false;
  BLU_CHECK(it->second == "true" || it->second == "false", where(a), ": ", key, " must be true or false, got '",
            it->second, "'");
  return it->second == "true";
}

int64_t positive(const Annotation& a, const std::string& key, int64_t fallback) {
  const auto it = a.args.find(key);
  if (it == a.args.end()) return fallback;
  const std::string& s = it->second;
  const bool digits = !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), ::isdigit);
  BLU_CHECK(digits && std::stoll(s) > 0, where(a), ": ", key, " must be a positive integer, got '", s, "'");
  return std::stoll(s);
}

int64_t block_index(const Annotation& a, const std::string& name, const std::vector<std::string>& blocks) {
  const auto it = std::find(blocks.begin(), blocks.end(), name);
  if (it != blocks.end()) return int64_t(it - blocks.begin());
  const std::string range =
      blocks.empty() ? std::string("none") : blocks.front() + " … " + blocks.back() + " (" + std::to_string(blocks.size()) + ")";
  BLU_CHECK(false, where(a), ": the model has no block '", name, "' (its blocks are ", range, ")");
  return -1;
}

// "h.0-h.5" / "h.0-5" / "h.3" → [first, last].
std::pair<int64_t, int64_t> stage_range(const Annotation& a, const std::vector<std::string>& blocks) {
  const std::string& s = a.blocks;
  const size_t dash = s.find('-');
  if (dash == std::string::npos) {
    const int64_t i = block_index(a, s, blocks);
    return {i, i};
  }
  const std::string first = s.substr(0, dash);
  std::string last = s.substr(dash + 1);
  if (!last.empty() && std::all_of(last.begin(), last.end(), ::isdigit)) {  // "h.0-5": the prefix repeats
    const size_t dot = first.rfind('.');
    last = (dot == std::string::npos ? std::string() : first.substr(0, dot + 1)) + last;
  }
  const int64_t i = block_index(a, first, blocks), j = block_index(a, last, blocks);
  BLU_CHECK(i <= j, where(a), ": the range runs backwards (", first, " is block ", i, ", ", last, " is block ", j, ")");
  return {i, j};
}

void resolve_split(const Annotation& a, Layout& out) {
  BLU_CHECK(a.children.empty(), where(a), ": split encloses nothing (it splits the layers of what encloses it)");
  check_keys(a, {"sp", "widths", "row_chunks"});
  BLU_CHECK(a.degree >= 1, where(a), ": the degree must be at least 1");
  out.tp = int(a.degree);
  out.sequence_parallel = flag(a, "sp");
  out.tp_row_chunks = positive(a, "row_chunks", 1);
  // widths=probe: the ranks' speeds are measured at start-up (dist/hetero.h); until then even.
  const auto w = a.args.find("widths");
  out.probe_widths = w != a.args.end() && w->second == "probe";
  out.tp_widths = out.probe_widths ? std::vector<double>(size_t(a.degree), 1.0 / double(a.degree))
                                   : shares(a, "widths", a.degree);
}

void resolve_pipeline(const Annotation& a, const std::vector<std::string>& blocks, Layout& out) {
  check_keys(a, {"schedule", "micro", "chunks", "balance"});
  BLU_CHECK(a.degree >= 1, where(a), ": the degree must be at least 1");
  const int64_t n = a.degree, B = int64_t(blocks.size());
  out.pp = int(n);
  const std::string sched = a.args.count("schedule") ? a.args.at("schedule") : "1f1b";
  if (sched == "gpipe") out.schedule = Schedule::gpipe;
  else if (sched == "1f1b") out.schedule = Schedule::one_f_one_b;
  else if (sched == "interleaved") out.schedule = Schedule::interleaved;
  else BLU_CHECK(false, where(a), ": unknown schedule '", sched, "' (expected gpipe, 1f1b or interleaved)");
  out.micro_batches = positive(a, "micro", n);
  out.chunks = int(positive(a, "chunks", out.schedule == Schedule::interleaved ? 2 : 1));
  BLU_CHECK(out.chunks == 1 || out.schedule == Schedule::interleaved, where(a), ": chunks=", out.chunks,
            " needs schedule=interleaved (", sched, " runs one chunk per rank)");
  BLU_CHECK(out.micro_batches >= n, where(a), ": ", out.micro_batches, " micro-batches for ", n,
            " stages: every stage needs one in flight (micro >= ", n, ")");
  BLU_CHECK(out.schedule != Schedule::interleaved || out.micro_batches % n == 0, where(a),
            ": the interleaved schedule needs micro-batches in multiples of the stage count, got micro=",
            out.micro_batches, " for ", n, " stages");
  const std::string balance = a.args.count("balance") ? a.args.at("balance") : "even";
  BLU_CHECK(balance == "even" || balance == "time", where(a), ": balance must be even or time, got '", balance, "'");
  out.balance_by_time = balance == "time";
  const int64_t virtual_stages = n * out.chunks;
  BLU_CHECK(B >= virtual_stages, where(a), ": ", virtual_stages, " stages", out.chunks > 1 ? " (with chunks)" : "",
            " for a model of ", B, " blocks: a stage would have none");

  int split_degree = -1;
  if (a.children.empty()) {
    BLU_CHECK(out.balance_by_time || B % virtual_stages == 0, where(a), ": ", B, " blocks do not split evenly into ",
              virtual_stages, " stages; name the stages (stage(", blocks.front(), "-…) …) or use balance=time");
    if (!out.balance_by_time) {
      for (int64_t s = 0; s < virtual_stages; ++s)
        out.stage_blocks.push_back({s * (B / virtual_stages), (s + 1) * (B / virtual_stages) - 1});
    }
    return;
  }
  BLU_CHECK(!out.balance_by_time, where(a), ": balance=time picks the stages itself; drop it or the stage(…) list");
  BLU_CHECK(int64_t(a.children.size()) == virtual_stages, where(a), ": ", a.children.size(), " stages given, expected ",
            virtual_stages, out.chunks > 1 ? " (degree × chunks)" : "");
  int64_t next = 0;
  for (const Annotation& st : a.children) {
    BLU_CHECK(st.kind == "stage", where(a), ": encloses ", st.kind, " (a pipeline holds only stage(…) entries)");
    check_keys(st, {});
    const auto [first, last] = stage_range(st, blocks);
    BLU_CHECK(first == next, where(st), ": starts at block ", blocks[size_t(first)], " but the previous stage ended ",
              next == 0 ? std::string("before the first block ") + blocks.front()
                        : std::string("at ") + blocks[size_t(next - 1)],
              " (stages must cover the blocks in order, without gaps or overlaps)");
    out.stage_blocks.push_back({first, last});
    next = last + 1;
    BLU_CHECK(st.children.size() <= 1, where(st), ": a stage encloses at most one split");
    int degree = 1;
    if (!st.children.empty()) {
      const Annotation& sp = st.children[0];
      BLU_CHECK(sp.kind == "split", where(st), ": encloses ", sp.kind, " (a stage holds only a split)");
      resolve_split(sp, out);
      degree = out.tp;
    }
    BLU_CHECK(split_degree < 0 || split_degree == degree, where(st), ": split(", degree,
              ") differs from the other stages' split(", split_degree,
              "); every stage of a pipeline has the same tensor-parallel degree");
    split_degree = degree;
  }
  BLU_CHECK(next == B, where(a), ": the stages end at ", blocks[size_t(next - 1)], "; the model's blocks run to ",
            blocks.back());
  out.tp = split_degree;
}

}  // namespace

Layout resolve_layout(const Annotation& root, const std::vector<std::string>& blocks, int world_size) {
  BLU_CHECK(!root.empty(), "--parallel: the annotation is empty");
  Layout out;
  const Annotation* a = &root;
  if (a->kind == "replicate") {
    check_keys(*a, {"weights", "zero"});
    BLU_CHECK(a->degree >= 1, where(*a), ": the degree must be at least 1");
    BLU_CHECK(a->children.size() <= 1, where(*a), ": encloses ", a->children.size(),
              " primitives (at most one: a pipeline or a split)");
    out.dp = int(a->degree);
    // weights=probe: the ranks' speeds are measured at start-up (dist/hetero.h), by whoever runs the
    // layout; until then the shares are even.
    const auto w = a->args.find("weights");
    out.probe_weights = w != a->args.end() && w->second == "probe";
    out.replica_weights = out.probe_weights ? std::vector<double>(size_t(a->degree), 1.0 / double(a->degree))
                                            : shares(*a, "weights", a->degree);
    const auto z = a->args.find("zero");
    if (z != a->args.end()) {
      BLU_CHECK(z->second == "0" || z->second == "1" || z->second == "2" || z->second == "3", where(*a),
                ": zero must be 0, 1, 2 or 3, got '", z->second, "'");
      out.zero = std::stoi(z->second);
    }
    a = a->children.empty() ? nullptr : &a->children[0];
    BLU_CHECK(!a || a->kind == "pipeline" || a->kind == "split", where(root), ": encloses ", a ? a->kind : "",
              " (replicate holds a pipeline or a split)");
  } else {
    out.replica_weights = {1.0};
  }
  if (a && a->kind == "pipeline") resolve_pipeline(*a, blocks, out);
  else if (a && a->kind == "split") resolve_split(*a, out);
  else if (a) BLU_CHECK(false, where(*a), ": ", a->kind, " cannot stand outside a pipeline (start with replicate, pipeline or split)");
  if (out.tp_widths.empty()) out.tp_widths = {1.0};
  BLU_CHECK(world_size <= 0 || out.world_size() == world_size, "--parallel: ", out.describe(), " needs ",
            out.world_size(), " ranks, the job has ", world_size);
  return out;
}

std::string Layout::describe() const {
  std::ostringstream os;
  os << "dp=" << dp;
  if (zero) os << " (ZeRO-" << zero << ")";
  if (probe_weights) os << " (weights by probe)";
  if (pp > 1 || micro_batches > 0) {
    os << " × pp=" << pp << " (" << schedule_name(schedule);
    if (chunks > 1) os << ", " << chunks << " chunks";
    os << ", " << micro_batches << " micro-batches)";
  }
  os << " × tp=" << tp;
  if (sequence_parallel) os << " (sequence parallel)";
  if (tp_row_chunks > 1) os << " (row chunks " << tp_row_chunks << ")";
  if (probe_widths) {
    os << " (widths by probe)";
  } else if (std::any_of(tp_widths.begin(), tp_widths.end(), [&](double w) { return std::abs(w - 1.0 / tp) > 1e-12; })) {
    os << " (widths";
    for (double w : tp_widths) os << " " << std::round(w * 1000) / 1000;
    os << ")";
  }
  return os.str();
}

}  // namespace blu::dist
