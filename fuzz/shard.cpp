// Fuzz target: token shards (data/shard) — the header check of read_shard_token_count and the
// mapped reader with a vocabulary bound, on a file holding the input.
#include "blu/data/shard.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  const auto path = blu::fuzz::scratch("shard") / "shard_000000.bin";
  blu::fuzz::write_bytes(path, blu::fuzz::as_text(data, size));
  const int64_t n = blu::read_shard_token_count(path);
  const blu::ShardReader reader(path, 50257);
  if (reader.size() != n) std::abort();
  uint64_t sum = 0;
  for (uint16_t t : reader.tokens()) {
    if (t >= 50257) std::abort();
    sum += t;
  }
  (void)sum;
})
