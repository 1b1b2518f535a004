// Fuzz target: a data loader's saved state (data/loader's LoaderState JSON, as a checkpoint's
// train_state carries it) restored into a loader over two small shards, then one batch read.
#include <nlohmann/json.hpp>

#include "blu/data/loader.h"
#include "blu/data/shard.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  static blu::DataLoader* loader = [] {
    const auto dir = blu::fuzz::scratch("shards");
    std::vector<uint16_t> tokens(257);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t(i % 50);
    blu::write_shard(dir / "s_000000.bin", tokens, true);
    blu::write_shard(dir / "s_000001.bin", std::span(tokens).first(129), true);
    blu::LoaderOptions o;
    o.prefetch = 0;
    return new blu::DataLoader((dir / "s_*.bin").string(), 2, 8, 0, 1, o);
  }();
  const auto j = nlohmann::json::parse(blu::fuzz::as_text(data, size), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  const blu::LoaderState s = j.get<blu::LoaderState>();
  loader->restore(s);
  const blu::Batch b = loader->next();
  if (b.inputs.size() != 16 || b.targets.size() != 16) std::abort();
})
