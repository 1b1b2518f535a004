// optim/optimizer: what every optimizer shares — grouping, zero_grad, and the strict state
// parsing of state_io.h.
#include "blu/optim/optimizer.h"

#include <cmath>
#include <set>

#include "blu/memory/allocator.h"
#include "blu/memory/memory_report.h"
#include "blu/ops/factory.h"
#include "blu/ops/view.h"
#include "blu/optim/state_io.h"

namespace blu::optim {

std::vector<ParamGroup> decay_groups(const nn::NamedTensors& params, double weight_decay) {
  ParamGroup decay{.params = {}, .weight_decay = weight_decay}, no_decay{.params = {}, .weight_decay = 0.0};
  for (const auto& [name, p] : params) (p.dim() >= 2 ? decay : no_decay).params.emplace_back(name, p);
  return {std::move(decay), std::move(no_decay)};
}

void Optimizer::attach_split_masters(std::shared_ptr<const SplitMasters>) {
  BLU_CHECK(false, "split master weights (--master-weights split) are implemented for AdamW's own update ",
            "(--optimizer adamw without --zero or state offload)");
}

void check_state_dtype(DType dtype, const char* who) {
  BLU_CHECK(dtype == DType::f32 || dtype == DType::bf16, who, ": the moments' dtype must be f32 or bf16, got ",
            dtype);
}

void Optimizer::zero_grad() {
  for (auto& g : groups_)
    for (auto& [name, p] : g.params) p.zero_grad();
}

namespace detail {

std::vector<ParamRef> flatten_groups(const std::vector<ParamGroup>& groups, const char* optimizer) {
  std::vector<ParamRef> out;
  std::set<std::string> seen;
  std::set<const TensorImpl*> tensors;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    BLU_CHECK(std::isfinite(groups[gi].weight_decay) && groups[gi].weight_decay >= 0, optimizer, ": group ", gi,
              " has weight_decay ", groups[gi].weight_decay, ", expected a finite value >= 0");
    for (const auto& [name, p] : groups[gi].params) {
      BLU_CHECK(p.defined(), optimizer, ": parameter '", name, "' is an undefined tensor");
      BLU_CHECK(p.dtype() == DType::f32, optimizer, ": parameter '", name, "' is ", p.dtype(),
                "; the optimizer keeps fp32 state and needs f32 (master) parameters — for mixed precision "
                "set the model's compute dtype instead");
      BLU_CHECK(!name.empty() && seen.insert(name).second, optimizer, ": parameter name '", name,
                "' is empty or appears twice (state is keyed by name)");
      BLU_CHECK(tensors.insert(p.impl_ptr().get()).second, optimizer, ": parameter '", name,
                "' is a tensor already given under another name (it would be updated twice)");
      out.push_back({name, p, groups[gi].weight_decay});
    }
  }
  return out;
}

Tensor count_tensor(int64_t v) { return full({}, double(v), DType::i64); }

int64_t read_count(const Tensor& t, const std::string& name) {
  BLU_CHECK(t.defined() && t.numel() == 1 && t.dim() <= 1, "optimizer state '", name,
            "': expected a 0-d count, got ", t.defined() ? t.str() : std::string("an undefined tensor"));
  BLU_CHECK(t.dtype() == DType::i64 || t.dtype() == DType::i32 || t.dtype() == DType::f64, "optimizer state '",
            name, "': expected dtype i64 (or f64), got ", t.dtype());
  const double v = t.item();
  BLU_CHECK(v >= 0 && v == std::floor(v) && v < 9.0e15, "optimizer state '", name,
            "': expected a non-negative whole number, got ", v);
  return int64_t(v);
}

Tensor f32_copy(const Tensor& src, const Tensor& like) {
  Tensor dst = empty(like.shape(), DType::f32, like.device());
  copy_(dst, to_device(src, like.device()));
  return dst;
}

std::vector<Tensor> packed_zeros(const std::vector<Tensor>& likes, const char* label, DType dtype) {
  const int64_t kAlign = 64 / int64_t(dtype_size(dtype));  // elements
  struct Flat {
    Device device;
    int64_t numel = 0;
    Tensor buffer;
  };
  std::vector<Flat> flats;  // one per device, in order of first use
  std::vector<std::pair<size_t, int64_t>> at(likes.size());  // (flat, offset)
  for (size_t i = 0; i < likes.size(); ++i) {
    size_t f = 0;
    while (f < flats.size() && flats[f].device != likes[i].device()) ++f;
    if (f == flats.size()) flats.push_back({likes[i].device()});
    at[i] = {f, flats[f].numel};
    flats[f].numel += (likes[i].numel() + kAlign - 1) / kAlign * kAlign;
  }
  for (Flat& f : flats) {
    // The first update makes the state after the first backward has freed its activations; a
    // caching allocator keeps their segments, which a buffer this large rarely fits, so it would
    // hold them and a new segment at once (the run's reserved peak). They go back first.
    allocator_for(f.device).release_cached();
    f.buffer = zeros({f.numel}, dtype, f.device);
    tag_memory(f.buffer, MemoryCategory::optimizer_state, label);
  }
  std::vector<Tensor> out;
  out.reserve(likes.size());
  for (size_t i = 0; i < likes.size(); ++i)
    out.push_back(view(narrow(flats[at[i].first].buffer, 0, at[i].second, likes[i].numel()), likes[i].shape()));
  return out;
}

std::vector<Tensor> packed_copies(const std::vector<Tensor>& values, const std::vector<Tensor>& likes,
                                  const char* label, DType dtype) {
  BLU_ASSERT(values.size() == likes.size());
  std::vector<Tensor> out = packed_zeros(likes, label, dtype);
  for (size_t i = 0; i < out.size(); ++i) copy_(out[i], to_device(values[i], likes[i].device()));
  return out;
}

ParsedState parse_state(const nn::NamedTensors& state, const std::vector<ParamRef>& params,
                        const std::vector<StateKind>& kinds, const char* optimizer) {
  std::map<std::string, size_t> param_index;
  for (size_t i = 0; i < params.size(); ++i) param_index[params[i].name] = i;
  ParsedState out;
  out.per_param.assign(params.size(), {});
  std::vector<std::vector<const std::pair<std::string, Tensor>*>> found(params.size(),
                                                                       std::vector<const std::pair<std::string, Tensor>*>(kinds.size()));
  bool have_step = false;
  for (const auto& entry : state) {
    const auto& [name, t] = entry;
    if (name == "step") {
      BLU_CHECK(!have_step, optimizer, " state: 'step' appears twice");
      out.step = read_count(t, name);
      have_step = true;
      continue;
    }
    const size_t dot = name.find('.');
    const std::string kind = dot == std::string::npos ? name : name.substr(0, dot);
    size_t k = 0;
    while (k < kinds.size() && kind != kinds[k].kind) ++k;
    std::string known;
    for (auto& sk : kinds) known += std::string(known.empty() ? "" : ", ") + sk.kind + ".<param>";
    BLU_CHECK(k < kinds.size() && dot != std::string::npos, optimizer, " state: unexpected entry '", name,
              "' (expected 'step'", known.empty() ? "" : " and ", known, ")");
    const std::string pname = name.substr(dot + 1);
    auto it = param_index.find(pname);
    BLU_CHECK(it != param_index.end(), optimizer, " state: unexpected entry '", name, "': no parameter named '",
              pname, "' in this optimizer");
    const size_t pi = it->second;
    BLU_CHECK(!found[pi][k], optimizer, " state: '", name, "' appears twice");
    BLU_CHECK(t.defined(), optimizer, " state: '", name, "' is an undefined tensor");
    if (kinds[k].scalar) {
      read_count(t, name);
    } else {
      BLU_CHECK(is_floating(t.dtype()), optimizer, " state: '", name, "' must be a floating tensor, got ", t.dtype());
      BLU_CHECK(t.shape() == params[pi].param.shape(), optimizer, " state: '", name, "' has shape ", t.shape(),
                ", but parameter '", pname, "' has shape ", params[pi].param.shape());
    }
    found[pi][k] = &entry;
  }
  BLU_CHECK(have_step, optimizer, " state: missing 'step'");
  for (size_t pi = 0; pi < params.size(); ++pi) {
    size_t n = 0;
    for (auto* e : found[pi]) n += e != nullptr;
    if (n == 0) continue;  // never updated
    for (size_t k = 0; k < kinds.size(); ++k) {
      BLU_CHECK(found[pi][k], optimizer, " state: missing '", kinds[k].kind, ".", params[pi].name,
                "' (the state has other entries for that parameter)");
      out.per_param[pi].push_back(found[pi][k]->second);
    }
  }
  return out;
}

}  // namespace detail

}  // namespace blu::optim
