#include "blu/compiler/graph.h"

#include <algorithm>
#include <sstream>

namespace blu::compiler {

const char* buffer_kind_name(BufferKind k) {
  switch (k) {
    case BufferKind::temporary: return "temporary";
    case BufferKind::parameter: return "parameter";
    case BufferKind::gradient: return "gradient";
    case BufferKind::optimizer_state: return "optimizer_state";
    case BufferKind::step_input: return "step_input";
    case BufferKind::rng_state: return "rng_state";
    case BufferKind::constant: return "constant";
    case BufferKind::step_output: return "step_output";
  }
  return "?";
}

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kernel: return "kernel";
    case OpKind::view: return "view";
    case OpKind::collective: return "collective";
    case OpKind::fused: return "fused";
  }
  return "?";
}

bool Value::contiguous() const { return strides == contiguous_strides(shape); }
size_t Value::nbytes() const { return size_t(numel(shape)) * dtype_size(dtype); }

std::vector<int> written_buffers(const Graph& g, const Op& op) {
  std::vector<int> out;
  for (size_t j = 0; j < op.outputs.size(); ++j) {
    const bool view = std::any_of(op.views.begin(), op.views.end(), [&](auto& p) { return p.first == int(j); });
    if (!view) out.push_back(g.values[size_t(op.outputs[j])].buffer);
  }
  for (int i : op.writes)
    if (op.inputs[size_t(i)] >= 0) out.push_back(g.values[size_t(op.inputs[size_t(i)])].buffer);
  return out;
}

int Graph::add_buffer(Buffer b) {
  b.id = int(buffers.size());
  buffers.push_back(std::move(b));
  return buffers.back().id;
}

int Graph::add_value(Value v) {
  v.id = int(values.size());
  values.push_back(std::move(v));
  return values.back().id;
}

std::string Graph::summary() const {
  size_t by_kind[4] = {};
  for (const Op& op : ops) ++by_kind[size_t(op.kind)];
  size_t temp_bytes = 0, held_bytes = 0;
  for (const Buffer& b : buffers) (b.kind == BufferKind::temporary ? temp_bytes : held_bytes) += b.nbytes;
  std::ostringstream os;
  os << ops.size() << " ops (" << by_kind[0] << " kernel, " << by_kind[1] << " view, " << by_kind[2] << " collective, "
     << by_kind[3] << " fused), " << values.size() << " values, " << buffers.size() << " buffers ("
     << temp_bytes << " B temporary, " << held_bytes << " B held across the step)";
  return os.str();
}

static void print_attr(std::ostream& os, const AttrValue& v) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>)
          os << (x ? "true" : "false");
        else if constexpr (std::is_same_v<T, Shape>)
          os << to_string(x);
        else
          os << x;
      },
      v);
}

std::string Graph::dump() const {
  std::ostringstream os;
  os.precision(17);
  for (const Buffer& b : buffers)
    os << "buf" << b.id << ": " << b.nbytes << " B " << b.device << " " << buffer_kind_name(b.kind)
       << (b.name.empty() ? "" : " " + b.name) << "\n";
  for (int id : inputs) {
    const Value& v = values[size_t(id)];
    os << "input %" << id << " : " << to_string(v.shape) << " " << v.dtype << " buf" << v.buffer << "\n";
  }
  for (const Op& op : ops) {
    for (size_t j = 0; j < op.outputs.size(); ++j) os << (j ? ", %" : "%") << op.outputs[j];
    os << (op.outputs.empty() ? "" : " = ") << op_kind_name(op.kind) << " " << op.name << "(";
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      if (i) os << ", ";
      if (op.inputs[i] < 0)
        os << "none";
      else
        os << "%" << op.inputs[i];
    }
    os << ")";
    if (!op.attrs.items().empty()) {
      os << " {";
      bool first = true;
      for (const auto& [k, v] : op.attrs.items()) {
        os << (first ? "" : ", ") << k << "=";
        print_attr(os, v);
        first = false;
      }
      os << "}";
    }
    for (const auto& [j, i] : op.views) os << " view(%" << op.outputs[size_t(j)] << " of input " << i << ")";
    for (int i : op.writes) os << " writes(input " << i << ")";
    if (op.rng) os << " rng";
    for (int id : op.outputs) {
      const Value& v = values[size_t(id)];
      os << " : " << to_string(v.shape) << " " << v.dtype << " buf" << v.buffer;
      if (!v.contiguous()) os << " strides " << to_string(v.strides);
      if (v.offset) os << " +" << v.offset;
    }
    os << "\n";
  }
  os << "outputs";
  for (int id : outputs) os << " %" << id;
  os << "\n";
  return os.str();
}

namespace {
struct Hasher {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  }
  void i(int64_t v) { bytes(&v, sizeof v); }
  void s(std::string_view v) {
    i(int64_t(v.size()));
    bytes(v.data(), v.size());
  }
  void shape(const Shape& v) {
    i(int64_t(v.size()));
    for (int64_t x : v) i(x);
  }
};
}  // namespace

uint64_t Graph::structure_hash() const {
  Hasher h;
  for (const Buffer& b : buffers) {
    h.i(int64_t(b.nbytes));
    h.s(b.device.str());
    h.i(int64_t(b.kind));
  }
  for (const Value& v : values) {
    h.i(v.buffer);
    h.shape(v.shape);
    h.shape(v.strides);
    h.i(v.offset);
    h.i(int64_t(v.dtype));
    h.i(v.producer);
  }
  for (const Op& op : ops) {
    h.i(int64_t(op.kind));
    h.s(op.name);
    for (int x : op.inputs) h.i(x);
    h.i(-7);
    for (int x : op.outputs) h.i(x);
    for (const auto& [j, i] : op.views) h.i(j * 1000 + i);
    for (int x : op.writes) h.i(x);
    // Attribute names and the values of shape, dtype, bool and int attributes shape the
    // computation; float scalars (lr, eps) and the per-step counters step, seed and offset are
    // kernel arguments that may change from step to step.
    for (const auto& [k, v] : op.attrs.items()) {
      h.s(k);
      h.i(int64_t(v.index()));
      if (per_step_argument(k, v)) continue;
      if (const auto* n = std::get_if<int64_t>(&v)) h.i(*n);
      if (const auto* sh = std::get_if<Shape>(&v)) h.shape(*sh);
      if (const auto* dt = std::get_if<DType>(&v)) h.i(int64_t(*dt));
      if (const auto* b = std::get_if<bool>(&v)) h.i(*b);
    }
  }
  for (int x : inputs) h.i(x);
  for (int x : outputs) h.i(x);
  return h.h;
}

}  // namespace blu::compiler
