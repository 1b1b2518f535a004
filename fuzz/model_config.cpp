// Fuzz target: a Hugging Face config.json (models/registry's resolve_model_config: the family is
// picked from "architectures"/"model_type", then the family's from_hf_config validates and maps
// it), read from a model folder holding the input.
#include "blu/models/registry.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const auto dir = blu::fuzz::scratch("hf");
  blu::fuzz::write_bytes(dir / "config.json", blu::fuzz::as_text(data, size));
  const nlohmann::json cfg = blu::models::resolve_model_config(dir.string());
  (void)blu::models::family_of(cfg);
})
