#include "blu/io/gpt2_weights.h"

#include <cstring>
#include <set>

#include "blu/core/grad_mode.h"
#include "blu/io/safetensors.h"
#include "blu/ops/factory.h"
#include "blu/ops/join.h"
#include "blu/ops/view.h"

namespace blu::io {
namespace {

// The four projections HF stores as Conv1D ([in, out]).
bool is_conv1d_weight(const std::string& name) {
  for (const char* s : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.ends_with(s)) return true;
  return false;
}

bool is_ignored_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias");
}

Tensor read_entry(const SafeTensorsFile& f, const TensorEntry& e) {
  Tensor t = empty(e.shape, e.dtype);
  auto bytes = f.bytes(e);
  if (!bytes.empty()) std::memcpy(t.raw_data(), bytes.data(), bytes.size());  // may be misaligned in the map
  return t;
}

}  // namespace

void import_hf_gpt2(const std::string& path, nn::GPT& model) {
  const nn::GPTConfig& cfg = model.config();
  BLU_CHECK(cfg.bias, "import_hf_gpt2: HF GPT-2 has biases; the model was built with bias = false");
  SafeTensorsFile f = SafeTensorsFile::open(path);
  const std::string prefix = f.find("transformer.wte.weight") ? "transformer." : "";

  NoGradGuard no_grad;
  nn::NamedTensors state;
  std::set<std::string> used;
  for (auto& [name, param] : model.state_dict()) {
    const std::string hf = prefix + name;
    const TensorEntry* e = f.find(hf);
    BLU_CHECK(e, "import_hf_gpt2: ", path, " has no tensor '", hf, "'");
    used.insert(hf);
    const Shape& want = param.shape();
    Shape expect = want;  // in the file's layout
    if (is_conv1d_weight(name)) expect = {want[1], want[0]};
    const bool wte = name == "wte.weight";
    if (wte) expect = {cfg.vocab_size, want[1]};
    const bool padded_wte = wte && e->shape == want;  // a file that keeps the padding is fine too
    BLU_CHECK(e->shape == expect || padded_wte, "import_hf_gpt2: '", hf, "' has shape ", e->shape,
              ", expected ", expect, " (config: ", cfg.to_json().dump(), ")");
    BLU_CHECK(is_floating(e->dtype), "import_hf_gpt2: '", hf, "' has dtype ", e->dtype, ", expected a float");
    Tensor t = read_entry(f, *e);
    if (is_conv1d_weight(name)) t = transpose(t, 0, 1);
    if (wte && !padded_wte && cfg.padded_vocab_size > cfg.vocab_size) {
      t = cat({t, zeros({cfg.padded_vocab_size - cfg.vocab_size, want[1]}, t.dtype())}, 0);
    }
    state.emplace_back(name, t);
  }
  for (const TensorEntry& e : f.entries()) {
    if (used.count(e.name)) continue;
    const std::string name = e.name.starts_with(prefix) ? e.name.substr(prefix.size()) : e.name;
    if (is_ignored_buffer(name)) continue;
    if (name == "lm_head.weight" || e.name == "lm_head.weight") {
      // Tied: must equal wte (HF writes it in some exports).
      const TensorEntry& w = f.at(prefix + "wte.weight");
      BLU_CHECK(e.shape == w.shape && e.dtype == w.dtype &&
                    std::memcmp(f.bytes(e).data(), f.bytes(w).data(), e.nbytes()) == 0,
                "import_hf_gpt2: '", e.name, "' differs from '", w.name,
                "' (BluTrain's GPT ties the output projection to wte)");
      continue;
    }
    BLU_CHECK(false, "import_hf_gpt2: unexpected tensor '", e.name, "' in ", path, " (shape ", e.shape,
              "; config: ", cfg.to_json().dump(), ")");
  }
  model.load_state_dict(state);
}

void export_hf_gpt2(const nn::GPT& model, const std::string& path) {
  const nn::GPTConfig& cfg = model.config();
  std::vector<std::pair<std::string, Tensor>> out;  // kept alive until write() returns
  for (auto& [name, p] : model.state_dict()) {
    BLU_CHECK(p.device().is_cpu(), "export_hf_gpt2: '", name, "' is on ", p.device(), ", expected cpu");
    Tensor t = p.detach();
    if (is_conv1d_weight(name)) t = transpose(t, 0, 1);
    if (name == "wte.weight") t = narrow(t, 0, 0, cfg.vocab_size);
    out.emplace_back(name, contiguous(t));
  }
  SafeTensorsWriter w;
  for (auto& [name, t] : out)
    w.add(name, t.dtype(), t.shape(), {static_cast<const std::byte*>(t.raw_data()), t.nbytes()});
  w.set_metadata("format", "pt");
  w.write(path);
}

}  // namespace blu::io
