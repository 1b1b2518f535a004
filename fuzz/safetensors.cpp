// Fuzz target: the safetensors reader (io/safetensors) on a buffer — header JSON, offsets, dtypes,
// shapes, metadata — and every tensor's bytes of a buffer that opens.
#include <numeric>
#include <vector>

#include "blu/io/safetensors.h"
#include "fuzz_util.h"

BLU_FUZZ_TARGET({
  std::vector<std::byte> buffer(size);
  if (size) std::memcpy(buffer.data(), data, size);
  const blu::SafeTensorsFile f = blu::SafeTensorsFile::parse(std::move(buffer), "<fuzz>");
  uint64_t sum = 0;
  for (const blu::TensorEntry& e : f.entries()) {
    const auto bytes = f.bytes(e);
    if (bytes.size() != e.nbytes()) std::abort();
    if (!bytes.empty()) sum += uint64_t(bytes.front()) + uint64_t(bytes.back());
    if (f.find(e.name) != &e) std::abort();
  }
  for (const auto& [k, v] : f.metadata()) sum += k.size() + v.size();
  (void)sum;
})
