// io/safetensors: read and write the safetensors format at the byte level — no Tensor type here,
// only names, dtypes, shapes and byte ranges, so checkpoints and test oracles can use it before
// (and independently of) the tensor library.
//
// Format (see docs/safetensors.md): 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON
// header, then the data section. The header maps each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section) and may
// hold "__metadata__", a string->string map. Data is little-endian, row-major.
//
// Depends on core/error (BLU_CHECK), core/dtype, nlohmann-json and POSIX (mmap, fsync, rename).
//
// What must stay true:
//   - The reader is at least as strict as the Hugging Face reference (Rust `safetensors` crate):
//     every tensor's bytes are inside the data section, tensors tile the data section exactly
//     (no gap, no overlap, nothing left over), sizes match shape x dtype without overflow, and
//     names are unique. Any violation is a blu::Error naming the source, the tensor, and what was
//     expected versus what was found. Nothing is read lazily: a file that opens is fully valid.
//   - The writer's output is byte-identical to what the reference writes for the same tensors
//     (same tensor order, same compact JSON, header space-padded to 8 bytes; the reference emits
//     "__metadata__" keys in hash order, we emit them sorted), so the data section starts 8-byte
//     aligned relative to the start of the file.
//   - SafeTensorsWriter::write is atomic: readers of `path` see either the old file or the
//     complete new one; a failed write leaves the old file untouched and no temp file behind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "blu/core/dtype.h"

namespace blu {

// The header may not be longer than this (the reference's MAX_HEADER_SIZE).
inline constexpr uint64_t kSafeTensorsMaxHeaderBytes = 100'000'000;

// The safetensors spelling of a dtype ("F32", "BF16", "BOOL", ...).
std::string_view safetensors_dtype_name(DType t);
// The DType for a safetensors dtype name; nullopt for names that are valid safetensors dtypes we
// do not support (I8, U16, F8_E4M3, ...) and for names that are not dtypes at all.
std::optional<DType> dtype_from_safetensors_name(std::string_view name);

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data section, [begin, end)
  uint64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// The parsed and validated header of a safetensors buffer.
struct SafeTensorsHeader {
  std::vector<TensorEntry> entries;             // sorted by data offsets (file order)
  std::map<std::string, std::string> metadata;  // "__metadata__", empty when absent
  uint64_t data_start = 0;                      // 8 + N: where the data section starts
};

// Parses and validates the whole of `buffer` (header and the data section's extent). `source` is
// used in error messages (a path, or "<memory>").
SafeTensorsHeader parse_safetensors_header(std::span<const std::byte> buffer, std::string_view source);

// Read side. Owns the bytes: a read-only memory map of a file, or a buffer handed in. Move-only.
class SafeTensorsFile {
 public:
  static SafeTensorsFile open(const std::string& path);
  static SafeTensorsFile parse(std::vector<std::byte> buffer, std::string source = "<memory>");

  SafeTensorsFile(SafeTensorsFile&&) noexcept;
  SafeTensorsFile& operator=(SafeTensorsFile&&) noexcept;
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;
  ~SafeTensorsFile();

  const std::string& source() const { return source_; }
  const std::vector<TensorEntry>& entries() const { return header_.entries; }
  const TensorEntry* find(std::string_view name) const;  // nullptr when absent
  const TensorEntry& at(std::string_view name) const;   // blu::Error when absent
  // The tensor's bytes. Aligned to 8 bytes when the file came from a writer that pads its header
  // (ours and the reference); files from elsewhere may be misaligned, so copy before casting.
  std::span<const std::byte> bytes(const TensorEntry& entry) const;
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

 private:
  struct Storage;
  SafeTensorsFile(std::unique_ptr<Storage> storage, std::string source);
  std::unique_ptr<Storage> storage_;
  std::string source_;
  SafeTensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in header_.entries
};

// Write side. add() checks each tensor as it comes and keeps a view of its bytes: the caller's
// buffers must stay alive until write() / serialize() returns (no copy of a checkpoint is made).
class SafeTensorsWriter {
 public:
  void add(std::string name, DType dtype, std::vector<int64_t> shape, std::span<const std::byte> data);
  void set_metadata(std::string key, std::string value);

  // The header JSON, padded with spaces to a multiple of 8 bytes (without the 8-byte length).
  std::string header() const;
  std::vector<std::byte> serialize() const;
  // Atomic: temp file in the same directory, write, fsync, rename over `path`, fsync directory.
  void write(const std::string& path) const;

 private:
  struct Item {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::span<const std::byte> data;
  };
  std::vector<const Item*> sorted() const;
  std::vector<Item> items_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace blu
