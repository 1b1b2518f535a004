#include "blu/io/checksum.h"

#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "blu/core/error.h"

namespace blu::io {

struct Checksum::State {
  XXH3_state_t* s = nullptr;
  ~State() { XXH3_freeState(s); }
};

Checksum::Checksum() : state_(std::make_unique<State>()) {
  state_->s = XXH3_createState();
  BLU_ASSERT(state_->s != nullptr, "XXH3_createState failed");
  XXH3_64bits_reset(state_->s);
}

Checksum::~Checksum() = default;

void Checksum::update(std::span<const std::byte> bytes) {
  if (!bytes.empty()) XXH3_64bits_update(state_->s, bytes.data(), bytes.size());
}

void Checksum::update(std::string_view text) { update(std::as_bytes(std::span(text.data(), text.size()))); }

std::string Checksum::hex() const {
  char buf[32];
  std::snprintf(buf, sizeof buf, "xxh3-64:%016llx", static_cast<unsigned long long>(XXH3_64bits_digest(state_->s)));
  return buf;
}

FileDigest digest_file(const std::filesystem::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  BLU_CHECK(f != nullptr, "cannot open ", path.string(), " to check its checksum: ", std::strerror(errno));
  Checksum sum;
  FileDigest d;
  std::vector<std::byte> buf(size_t(1) << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    sum.update(std::span(buf.data(), n));
    d.bytes += n;
  }
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  BLU_CHECK(!failed, "cannot read ", path.string(), " to check its checksum: ", std::strerror(err));
  d.checksum = sum.hex();
  return d;
}

}  // namespace blu::io
