// data/permute: seeded permutations that are the same on every platform and standard library
// (std::shuffle and std::uniform_int_distribution are implementation-defined, so they are not used).
// Depends on the standard library only. Keep: seeded_permutation(n, seed) never changes for a given
// (n, seed); the loader's resume and prepare's validation split rely on it.
#pragma once
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace blu {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Combines a seed with one more value into a new, well-mixed seed.
inline uint64_t mix_seed(uint64_t seed, uint64_t value) { return splitmix64(seed ^ splitmix64(value)); }

// Uniform in [0, n) without modulo bias (rejects the top partial block of 2^64).
inline uint64_t uniform_below(std::mt19937_64& rng, uint64_t n) {
  const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
  for (;;) {
    uint64_t r = rng();
    if (r >= threshold) return r % n;
  }
}

// A permutation of 0..n-1 by Fisher-Yates.
inline std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  std::mt19937_64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    auto j = static_cast<int64_t>(uniform_below(rng, static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

}  // namespace blu
