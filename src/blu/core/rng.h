// core/rng: Philox-4x32-10, a counter-based generator. A stream is (seed, offset): the numbers
// depend only on them, never on the device or the thread layout, so CPU and GPU kernels that use
// the same element→counter mapping draw the same values.
// Mapping (shared by every backend): element i of a draw at `offset` uses counter block
// (offset + i/4), lane i%4, key = seed. Uniform floats take the top 24 bits (8 for bf16, 11 for
// f16, so that rounding never reaches 1); normals come in
// Box–Muller pairs from lanes (0,1) and (2,3) of one block.
// Depends on nothing. Keep: the mapping above; changing it changes every seeded result.
#pragma once
#include <array>
#include <cstdint>

namespace blu {

struct Philox {
  // The full Philox-4x32-10 bijection: a 128-bit counter (c[0] lowest word) under a 64-bit key.
  static std::array<uint32_t, 4> block(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
    for (int r = 0; r < 10; ++r) {
      const uint64_t p0 = uint64_t(0xD2511F53u) * c[0];
      const uint64_t p1 = uint64_t(0xCD9E8D57u) * c[2];
      c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1], uint32_t(p0)};
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    return c;
  }
  // What the ops use: key = seed, counter = (counter, 0) — the upper 64 counter bits are zero.
  static std::array<uint32_t, 4> block(uint64_t seed, uint64_t counter) {
    return block({uint32_t(counter), uint32_t(counter >> 32), 0, 0}, {uint32_t(seed), uint32_t(seed >> 32)});
  }
  // [0, 1) from the top `bits` (<= 24) random bits: exact in any type with that many digits.
  static float uniform(uint32_t u, int bits = 24) { return float(u >> (32 - bits)) * (1.0f / float(1u << bits)); }
};

// A seeded stream that hands out counter ranges. `draw(n)` reserves the blocks n numbers need.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed, uint64_t offset = 0) : seed_(seed), offset_(offset) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) { seed_ = seed; offset_ = offset; }
  // Returns the offset to draw n numbers from and advances past them.
  uint64_t draw(uint64_t n) {
    const uint64_t at = offset_;
    offset_ += (n + 3) / 4;
    return at;
  }

 private:
  uint64_t seed_;
  uint64_t offset_;
};

// The process-wide default generator (ops use it unless given one). Not thread-safe by design:
// seeding and drawing happen on the thread that issues ops.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace blu
