#include "blu/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

namespace blu {

namespace {

// The safetensors names of our dtypes, and each one's rank in the reference's `Dtype` enum
// (BOOL < U8 < I8 < ... < F16 < BF16 < I32 < U32 < F32 < F64 < I64 < U64). Only the relative
// order matters: the reference writer sorts tensors by this rank, descending (see sorted()).
struct StDType {
  DType dtype;
  std::string_view name;
  int reference_rank;
};
constexpr std::array<StDType, kNumDTypes> kStDTypes = {{
    {DType::b8, "BOOL", 0},
    {DType::u8, "U8", 1},
    {DType::f16, "F16", 7},
    {DType::bf16, "BF16", 8},
    {DType::i32, "I32", 9},
    {DType::f32, "F32", 11},
    {DType::f64, "F64", 12},
    {DType::i64, "I64", 13},
}};
// Valid safetensors dtypes that DType cannot hold: refused with a message that says so.
constexpr std::array<std::string_view, 11> kUnsupportedStDTypes = {
    "I8", "I16", "U16", "U32", "U64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"};

const StDType& st_dtype(DType t) {
  for (const auto& d : kStDTypes)
    if (d.dtype == t) return d;
  BLU_ASSERT(false, "dtype ", int(t), " has no safetensors name");
}

// Strict UTF-8 (as Rust's str::from_utf8): no overlong forms, no surrogates, nothing past
// U+10FFFF. Returns the offset of the first bad byte, or npos.
size_t first_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xbf;  // allowed range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;  // overlong
      if (c == 0xed) hi = 0x9f;  // surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;  // overlong
      if (c == 0xf4) hi = 0x8f;  // past U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string errno_text() { return std::strerror(errno); }

// numel and byte size of a shape, or nullopt on overflow of u64.
std::optional<uint64_t> checked_nbytes(const std::vector<int64_t>& shape, DType dtype) {
  uint64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, uint64_t(d), &n)) return std::nullopt;
  if (__builtin_mul_overflow(n, uint64_t(dtype_size(dtype)), &n)) return std::nullopt;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

using json = nlohmann::json;

// serde_json (the reference's parser) stops at 128 levels; a valid header needs 3. Bounding the
// depth keeps hostile headers from building deep trees (nlohmann's dump() recurses).
constexpr int kMaxHeaderDepth = 64;

// A value for an error message: scalars as JSON, containers summarised, long text cut.
std::string brief(const json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " elements";
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " keys";
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// Parses the header text, refusing duplicate keys at any depth (nlohmann and serde both keep the
// last one silently; a duplicated tensor name is ambiguous, so we refuse it).
json parse_header_json(std::string_view text, std::string_view source) {
  std::vector<std::set<std::string>> keys_by_depth;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start)
      BLU_CHECK(depth < kMaxHeaderDepth, "safetensors ", source, ": header nests deeper than ", kMaxHeaderDepth,
                " levels (a valid header needs 3)");
    if (event == json::parse_event_t::object_start) {
      keys_by_depth.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys_by_depth.pop_back();
    } else if (event == json::parse_event_t::key) {
      const auto& key = parsed.get_ref<const std::string&>();
      BLU_CHECK(keys_by_depth.back().insert(key).second, "safetensors ", source, ": key '", key,
                "' appears twice in the header (expected unique tensor names and fields)");
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    BLU_CHECK(false, "safetensors ", source, ": header is not valid JSON (", e.what(), ")");
  }
}

uint64_t json_u64(const json& v, std::string_view source, std::string_view tensor, std::string_view what) {
  BLU_CHECK(v.is_number_unsigned(), "safetensors ", source, ": tensor '", tensor, "': ", what,
            " must be a non-negative integer, got ", brief(v));
  return v.get<uint64_t>();
}

TensorEntry parse_entry(const std::string& name, const json& info, std::string_view source) {
  BLU_CHECK(info.is_object(), "safetensors ", source, ": tensor '", name,
            "': expected an object {dtype, shape, data_offsets}, got ", brief(info));
  for (const auto& [key, _] : info.items())
    BLU_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", "safetensors ", source, ": tensor '",
              name, "': unknown field '", key, "' (expected only dtype, shape, data_offsets)");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    BLU_CHECK(info.contains(key), "safetensors ", source, ": tensor '", name, "': missing field '", key, "'");

  TensorEntry e;
  e.name = name;
  const json& dt = info["dtype"];
  BLU_CHECK(dt.is_string(), "safetensors ", source, ": tensor '", name, "': dtype must be a string, got ",
            brief(dt));
  const auto& dt_name = dt.get_ref<const std::string&>();
  const auto dtype = dtype_from_safetensors_name(dt_name);
  if (!dtype) {
    const bool known = std::find(kUnsupportedStDTypes.begin(), kUnsupportedStDTypes.end(), dt_name) !=
                       kUnsupportedStDTypes.end();
    BLU_CHECK(false, "safetensors ", source, ": tensor '", name, "': dtype '", dt_name, "' ",
              known ? "is not supported by BluTrain" : "is not a safetensors dtype",
              " (expected one of F32 F64 BF16 F16 I32 I64 U8 BOOL)");
  }
  e.dtype = *dtype;

  const json& shape = info["shape"];
  BLU_CHECK(shape.is_array(), "safetensors ", source, ": tensor '", name, "': shape must be an array, got ",
            brief(shape));
  for (const json& d : shape) {
    const uint64_t dim = json_u64(d, source, name, "every shape dimension");
    BLU_CHECK(dim <= uint64_t(INT64_MAX), "safetensors ", source, ": tensor '", name, "': shape dimension ", dim,
              " is larger than ", INT64_MAX);
    e.shape.push_back(int64_t(dim));
  }

  const json& off = info["data_offsets"];
  BLU_CHECK(off.is_array() && off.size() == 2, "safetensors ", source, ": tensor '", name,
            "': data_offsets must be [begin, end], got ", brief(off));
  e.begin = json_u64(off[0], source, name, "data_offsets begin");
  e.end = json_u64(off[1], source, name, "data_offsets end");
  BLU_CHECK(e.begin <= e.end, "safetensors ", source, ": tensor '", name, "': data_offsets [", e.begin, ", ",
            e.end, "] end before they begin");

  const auto nbytes = checked_nbytes(e.shape, e.dtype);
  BLU_CHECK(nbytes.has_value(), "safetensors ", source, ": tensor '", name, "': shape ", shape_str(e.shape),
            " x ", dt_name, " overflows 64 bits");
  BLU_CHECK(*nbytes == e.end - e.begin, "safetensors ", source, ": tensor '", name, "': shape ",
            shape_str(e.shape), " x ", dt_name, " needs ", *nbytes, " bytes, data_offsets [", e.begin, ", ", e.end,
            "] give ", e.end - e.begin);
  return e;
}

}  // namespace

std::string_view safetensors_dtype_name(DType t) { return st_dtype(t).name; }

std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
  for (const auto& d : kStDTypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

uint64_t TensorEntry::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);  // validated at parse: cannot overflow
  return n;
}

SafeTensorsHeader parse_safetensors_header(std::span<const std::byte> buffer, std::string_view source) {
  BLU_CHECK(buffer.size() >= 8, "safetensors ", source, ": file is ", buffer.size(),
            " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint64_t(buffer[i]);  // little-endian on any host
  BLU_CHECK(n <= kSafeTensorsMaxHeaderBytes, "safetensors ", source, ": header length ", n,
            " exceeds the limit of ", kSafeTensorsMaxHeaderBytes, " bytes");
  BLU_CHECK(n <= buffer.size() - 8, "safetensors ", source, ": header length ", n, " runs past the end of the file (",
            buffer.size() - 8, " bytes after the length)");

  const std::string_view text(reinterpret_cast<const char*>(buffer.data()) + 8, n);
  const size_t bad = first_invalid_utf8(text);
  BLU_CHECK(bad == std::string_view::npos, "safetensors ", source,
            ": header is not valid UTF-8 (bad byte at header offset ", bad, ")");
  BLU_CHECK(!text.empty(), "safetensors ", source, ": header must start with '{', got an empty header");
  BLU_CHECK(text.front() == '{', "safetensors ", source, ": header must start with '{', got '", text.front(), "'");

  const json root = parse_header_json(text, source);
  BLU_CHECK(root.is_object(), "safetensors ", source, ": header must be a JSON object, got ", root.type_name());

  SafeTensorsHeader h;
  h.data_start = 8 + n;
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      BLU_CHECK(value.is_object(), "safetensors ", source, ": __metadata__ must be an object of strings, got ",
                value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        BLU_CHECK(mv.is_string(), "safetensors ", source, ": __metadata__['", mk, "'] must be a string, got ",
                  brief(mv));
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.entries.push_back(parse_entry(key, value, source));
  }

  // Tensors must tile the data section: sorted by offsets, the first at 0, each starting where
  // the previous ended, the last ending at the end of the buffer.
  std::sort(h.entries.begin(), h.entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const uint64_t data_size = buffer.size() - h.data_start;
  uint64_t expected = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& e : h.entries) {
    BLU_CHECK(e.begin == expected, "safetensors ", source, ": tensor '", e.name, "': data_offsets [", e.begin, ", ",
              e.end, "] should begin at ", expected, prev ? " where tensor '" + prev->name + "' ends" : std::string(),
              e.begin < expected ? " (overlap)" : " (gap)");
    expected = e.end;
    prev = &e;
  }
  BLU_CHECK(expected <= data_size, "safetensors ", source, ": tensor '", prev ? prev->name : "", "' ends at ",
            expected, ", past the end of the data section (", data_size, " bytes)");
  BLU_CHECK(expected == data_size, "safetensors ", source, ": tensors cover ", expected,
            " bytes of the data section but it holds ", data_size, " bytes (", data_size - expected,
            " trailing bytes not covered by any tensor)");
  return h;
}

// ---------------------------------------------------------------------------------------------
// SafeTensorsFile

struct SafeTensorsFile::Storage {
  std::vector<std::byte> owned;
  void* map = nullptr;
  size_t map_len = 0;
  std::span<const std::byte> view() const {
    if (map) return {static_cast<const std::byte*>(map), map_len};
    return owned;
  }
  ~Storage() {
    if (map) munmap(map, map_len);
  }
};

SafeTensorsFile::SafeTensorsFile(std::unique_ptr<Storage> storage, std::string source)
    : storage_(std::move(storage)), source_(std::move(source)) {
  header_ = parse_safetensors_header(storage_->view(), source_);
  for (size_t i = 0; i < header_.entries.size(); ++i) index_.emplace(header_.entries[i].name, i);
}
SafeTensorsFile::SafeTensorsFile(SafeTensorsFile&&) noexcept = default;
SafeTensorsFile& SafeTensorsFile::operator=(SafeTensorsFile&&) noexcept = default;
SafeTensorsFile::~SafeTensorsFile() = default;

SafeTensorsFile SafeTensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  BLU_CHECK(fd >= 0, "safetensors ", path, ": cannot open for reading: ", errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  BLU_CHECK(fstat(fd, &st) == 0, "safetensors ", path, ": cannot stat: ", errno_text());
  BLU_CHECK(S_ISREG(st.st_mode), "safetensors ", path, ": not a regular file");
  const auto size = uint64_t(st.st_size);
  BLU_CHECK(size >= 8, "safetensors ", path, ": file is ", size, " bytes, shorter than the 8-byte header length");
  auto storage = std::make_unique<Storage>();
  // MAP_PRIVATE + PROT_READ: we never write. A file truncated by someone else while mapped
  // raises SIGBUS on access; our own writer replaces files by rename, which is safe.
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  BLU_CHECK(map != MAP_FAILED, "safetensors ", path, ": cannot mmap ", size, " bytes: ", errno_text());
  storage->map = map;
  storage->map_len = size;
  return SafeTensorsFile(std::move(storage), path);
}

SafeTensorsFile SafeTensorsFile::parse(std::vector<std::byte> buffer, std::string source) {
  auto storage = std::make_unique<Storage>();
  storage->owned = std::move(buffer);
  return SafeTensorsFile(std::move(storage), std::move(source));
}

const TensorEntry* SafeTensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.entries[it->second];
}

const TensorEntry& SafeTensorsFile::at(std::string_view name) const {
  const TensorEntry* e = find(name);
  BLU_CHECK(e != nullptr, "safetensors ", source_, ": no tensor named '", name, "' (file holds ",
            header_.entries.size(), " tensors)");
  return *e;
}

std::span<const std::byte> SafeTensorsFile::bytes(const TensorEntry& entry) const {
  const auto all = storage_->view();
  BLU_CHECK(entry.begin <= entry.end && header_.data_start + entry.end <= all.size(), "safetensors ", source_,
            ": entry '", entry.name, "' [", entry.begin, ", ", entry.end, "] is not from this file");
  return all.subspan(header_.data_start + entry.begin, entry.end - entry.begin);
}

// ---------------------------------------------------------------------------------------------
// SafeTensorsWriter

void SafeTensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> data) {
  BLU_CHECK(name != "__metadata__", "safetensors writer: '__metadata__' is reserved and cannot name a tensor");
  const size_t bad = first_invalid_utf8(name);
  BLU_CHECK(bad == std::string::npos, "safetensors writer: tensor name is not valid UTF-8 (bad byte at offset ", bad,
            ")");
  for (const Item& it : items_)
    BLU_CHECK(it.name != name, "safetensors writer: tensor '", name, "' added twice");
  for (int64_t d : shape)
    BLU_CHECK(d >= 0, "safetensors writer: tensor '", name, "': shape ", shape_str(shape),
              " has a negative dimension");
  const auto nbytes = checked_nbytes(shape, dtype);
  BLU_CHECK(nbytes.has_value(), "safetensors writer: tensor '", name, "': shape ", shape_str(shape), " x ", dtype,
            " overflows 64 bits");
  BLU_CHECK(*nbytes == data.size(), "safetensors writer: tensor '", name, "': shape ", shape_str(shape), " x ",
            dtype, " needs ", *nbytes, " bytes, got ", data.size());
  items_.push_back(Item{std::move(name), dtype, std::move(shape), data});
}

void SafeTensorsWriter::set_metadata(std::string key, std::string value) {
  BLU_CHECK(first_invalid_utf8(key) == std::string::npos && first_invalid_utf8(value) == std::string::npos,
            "safetensors writer: metadata '", key, "' is not valid UTF-8");
  metadata_[std::move(key)] = std::move(value);
}

// The reference (safetensors::tensor::prepare) sorts by `right.dtype().cmp(&left.dtype())` then
// by name: descending order of its Dtype enum — declared "in increasing alignment order" but
// compared as the enum, not by size, so I64 comes before F64 and BF16 before F16 — then names
// ascending as bytes. We follow that order exactly so our files match the reference byte for byte.
std::vector<const SafeTensorsWriter::Item*> SafeTensorsWriter::sorted() const {
  std::vector<const Item*> out;
  for (const Item& it : items_) out.push_back(&it);
  std::sort(out.begin(), out.end(), [](const Item* a, const Item* b) {
    const int ra = st_dtype(a->dtype).reference_rank, rb = st_dtype(b->dtype).reference_rank;
    if (ra != rb) return ra > rb;
    return a->name < b->name;  // char_traits<char> compares as unsigned char: byte order
  });
  return out;
}

std::string SafeTensorsWriter::header() const {
  // ordered_json keeps insertion order: "__metadata__" first, then tensors in data order, each
  // with dtype, shape, data_offsets — the reference's field order. dump() is compact, raw UTF-8.
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    auto& m = root["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
  }
  uint64_t offset = 0;
  for (const Item* it : sorted()) {
    nlohmann::ordered_json info = nlohmann::ordered_json::object();
    info["dtype"] = std::string(safetensors_dtype_name(it->dtype));
    info["shape"] = it->shape;
    info["data_offsets"] = {offset, offset + it->data.size()};
    offset += it->data.size();
    root[it->name] = std::move(info);
  }
  std::string text = root.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  BLU_CHECK(text.size() <= kSafeTensorsMaxHeaderBytes, "safetensors writer: header would be ", text.size(),
            " bytes, over the limit of ", kSafeTensorsMaxHeaderBytes);
  return text;
}

namespace {
std::array<std::byte, 8> le_u64(uint64_t n) {
  std::array<std::byte, 8> b{};
  for (int i = 0; i < 8; ++i) b[i] = std::byte((n >> (8 * i)) & 0xff);
  return b;
}
}  // namespace

std::vector<std::byte> SafeTensorsWriter::serialize() const {
  const std::string h = header();
  const auto items = sorted();
  size_t total = 8 + h.size();
  for (const Item* it : items) total += it->data.size();
  std::vector<std::byte> out(total);
  const auto len = le_u64(h.size());
  std::memcpy(out.data(), len.data(), 8);
  std::memcpy(out.data() + 8, h.data(), h.size());
  size_t pos = 8 + h.size();
  for (const Item* it : items) {
    if (!it->data.empty()) std::memcpy(out.data() + pos, it->data.data(), it->data.size());
    pos += it->data.size();
  }
  return out;
}

namespace {
void write_all(int fd, const void* data, size_t n, const std::string& tmp) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (w < 0 && errno == EINTR) continue;
    BLU_CHECK(w > 0, "safetensors writer: write to ", tmp, " failed: ", w < 0 ? errno_text() : "wrote nothing");
    p += w;
    n -= size_t(w);
  }
}
}  // namespace

void SafeTensorsWriter::write(const std::string& path) const {
  const std::string h = header();  // any error in the tensors surfaces before touching the disk
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);

  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = mkstemp(tmp.data());
  BLU_CHECK(fd >= 0, "safetensors writer: cannot create a temp file next to ", path, ": ", errno_text());
  // Until the rename succeeds, any failure closes and removes the temp file; the old file at
  // `path` (if any) is never opened for writing.
  struct TempGuard {
    int fd;
    const std::string& tmp;
    bool done = false;
    ~TempGuard() {
      if (fd >= 0) ::close(fd);
      if (!done) ::unlink(tmp.c_str());
    }
  } guard{fd, tmp};

  // mkstemp creates 0600; keep the mode of the file we replace, else the usual 0644.
  struct stat st {};
  const mode_t mode = ::stat(path.c_str(), &st) == 0 ? (st.st_mode & 07777) : 0644;
  BLU_CHECK(::fchmod(fd, mode) == 0, "safetensors writer: chmod ", tmp, " failed: ", errno_text());

  const auto len = le_u64(h.size());
  write_all(fd, len.data(), len.size(), tmp);
  write_all(fd, h.data(), h.size(), tmp);
  for (const Item* it : sorted()) write_all(fd, it->data.data(), it->data.size(), tmp);
  BLU_CHECK(::fsync(fd) == 0, "safetensors writer: fsync ", tmp, " failed: ", errno_text());
  const int rc = ::close(guard.fd);
  guard.fd = -1;
  BLU_CHECK(rc == 0, "safetensors writer: close ", tmp, " failed: ", errno_text());
  BLU_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "safetensors writer: rename ", tmp, " -> ", path,
            " failed: ", errno_text());
  guard.done = true;

  // Make the rename itself durable.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  BLU_CHECK(dfd >= 0, "safetensors writer: cannot open directory ", dir, " to fsync: ", errno_text());
  const int drc = ::fsync(dfd);
  const int saved = errno;
  ::close(dfd);
  errno = saved;
  BLU_CHECK(drc == 0, "safetensors writer: fsync of directory ", dir, " failed: ", errno_text());
}

}  // namespace blu
