// The "llama" model family in the registry (models/registry.h): builder, presets and Hugging
// Face interop (models/llama/hf.h).
#include "blu/models/llama/hf.h"
#include "blu/models/llama/llama.h"
#include "blu/models/registry.h"

#include <type_traits>

namespace blu::models {
namespace {

template <typename M>
auto& as_llama(M& m, const char* what) {
  auto* l = dynamic_cast<std::conditional_t<std::is_const_v<M>, const Llama, Llama>*>(&m);
  BLU_CHECK(l, what, ": expected a model of family \"llama\", got \"", m.family(), "\"");
  return *l;
}

ModelFamily llama_family() {
  ModelFamily f;
  f.name = "llama";
  f.build = [](const nlohmann::json& config, uint64_t seed) -> std::unique_ptr<CausalLM> {
    return std::make_unique<Llama>(LlamaConfig::from_json(config), seed);
  };
  f.presets = LlamaConfig::preset_names();
  f.preset = [](const std::string& name) { return LlamaConfig::preset(name).to_json(); };
  f.hf_architectures = {"LlamaForCausalLM"};
  f.from_hf_config = llama_config_from_hf;
  f.import_hf = [](CausalLM& model, const std::string& path) {
    import_hf_llama(as_llama(model, "llama import_hf"), path);
  };
  f.export_hf = [](const CausalLM& model, const std::string& dir) {
    export_hf_llama(as_llama(model, "llama export_hf"), dir);
  };
  return f;
}

}  // namespace

BLU_REGISTER_MODEL_FAMILY(llama_family);

}  // namespace blu::models
