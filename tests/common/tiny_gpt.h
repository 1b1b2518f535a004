// The GPT-2 shape the unit tests use: 2 layers, 3 heads of 16, block 16, a vocabulary of 101 padded
// to 128 (so the padded columns are exercised) — small enough for float64 oracles and gradchecks.
#pragma once
#include "blu/models/gpt2/gpt2.h"

namespace blu::test {

inline models::GPTConfig tiny_gpt() {
  models::GPTConfig c;
  c.block_size = 16, c.vocab_size = 101, c.padded_vocab_size = 128;
  c.n_layer = 2, c.n_head = 3, c.n_embd = 48;
  return c;
}

}  // namespace blu::test
