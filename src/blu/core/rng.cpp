#include "blu/core/rng.h"

namespace blu {

Generator& default_generator() {
  static Generator g;
  return g;
}

void manual_seed(uint64_t seed) { default_generator().set_state(seed, 0); }

}  // namespace blu
