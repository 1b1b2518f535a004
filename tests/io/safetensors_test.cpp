// Tests for io/safetensors: round trips, the reference writer's exact bytes, every hostile input
// the reader must refuse, atomic writes, and exchange with PyTorch through tests/common/st_py.py
// (the PyOracle tests; skipped when /usr/bin/python3 has no torch).
#include "blu/io/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>

namespace fs = std::filesystem;
using namespace blu;

namespace {

template <typename T>
std::span<const std::byte> as_bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

std::vector<std::byte> to_bytes(std::string_view s) {
  std::vector<std::byte> out(s.size());
  if (!s.empty()) std::memcpy(out.data(), s.data(), s.size());  // memcpy from null is undefined, even of 0 bytes
  return out;
}

// A buffer: 8-byte length N (header.size() unless given), the header, then `data_bytes` bytes.
std::vector<std::byte> make_buffer(std::string_view header, size_t data_bytes = 0,
                                   std::optional<uint64_t> n = std::nullopt) {
  const uint64_t len = n.value_or(header.size());
  std::vector<std::byte> out;
  for (int i = 0; i < 8; ++i) out.push_back(std::byte((len >> (8 * i)) & 0xff));
  const auto h = to_bytes(header);
  out.insert(out.end(), h.begin(), h.end());
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(std::byte(i & 0xff));
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_file(const fs::path& p, std::string_view s) {
  std::ofstream f(p, std::ios::binary);
  f.write(s.data(), std::streamsize(s.size()));
}

// Parsing `buffer` must throw blu::Error whose message contains every one of `parts`.
void expect_refused(const std::vector<std::byte>& buffer, std::initializer_list<std::string_view> parts) {
  try {
    SafeTensorsFile::parse(buffer, "mem.safetensors");
    ADD_FAILURE() << "accepted a buffer that should be refused";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("mem.safetensors"), std::string::npos) << "message does not name the source: " << msg;
    for (auto p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "blu_st_XXXXXX").string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  fs::path operator/(std::string_view name) const { return path_ / name; }
  size_t count() const { return size_t(std::distance(fs::directory_iterator(path_), fs::directory_iterator())); }

 private:
  fs::path path_;
};

// The fixed tensor set shared with tests/io/safetensors_reference.py (fixture()): keep in step.
struct Fixture {
  std::vector<float> f32, empty, scalar;
  std::vector<double> f64;
  std::vector<bf16> bf;
  std::vector<f16> half;
  std::vector<int32_t> i32;
  std::vector<int64_t> i64;
  std::vector<uint8_t> u8, b8;
  Fixture() {
    for (int i = 0; i < 6; ++i) f32.push_back(float(i * 0.5 - 1.25));
    for (int i = 0; i < 3; ++i) f64.push_back((i + 1) / 7.0);
    for (int i = 0; i < 4; ++i) bf.push_back(bf16(float((i + 1) / 3.0)));
    for (int i = 0; i < 4; ++i) half.push_back(f16(float((i - 1.7) * 3.1)));
    for (int i = 0; i < 5; ++i) i32.push_back(i * i - 7);
    i64 = {-(int64_t(1) << 40), (int64_t(1) << 62) + 5};
    for (int i = 0; i < 6; ++i) u8.push_back(uint8_t((i * 50) % 256));
    b8 = {1, 0, 1};
    scalar = {42.5f};
  }
  void add_to(SafeTensorsWriter& w) const {
    w.add("w.f32", DType::f32, {2, 3}, as_bytes_of(f32));
    w.add("w.f64", DType::f64, {3}, as_bytes_of(f64));
    w.add("w.bf16", DType::bf16, {4}, as_bytes_of(bf));
    w.add("w.f16", DType::f16, {2, 2}, as_bytes_of(half));
    w.add("i.i32", DType::i32, {5}, as_bytes_of(i32));
    w.add("i.i64", DType::i64, {2}, as_bytes_of(i64));
    w.add("u.u8", DType::u8, {6}, as_bytes_of(u8));
    w.add("b.bool", DType::b8, {3}, as_bytes_of(b8));
    w.add("e.empty", DType::f32, {0, 4}, as_bytes_of(empty));
    w.add("s.scalar", DType::f32, {}, as_bytes_of(scalar));
    w.set_metadata("format", "pt");
    w.set_metadata("note", "blu \xc3\xbcn\xc3\xaf" "code");
  }
  // Checks that `f` holds exactly this set, bit for bit.
  void expect_in(const SafeTensorsFile& f) const {
    ASSERT_EQ(f.entries().size(), 10u);
    auto check = [&](std::string_view name, DType dt, std::vector<int64_t> shape, std::span<const std::byte> want) {
      const TensorEntry* e = f.find(name);
      ASSERT_NE(e, nullptr) << name;
      EXPECT_EQ(e->dtype, dt) << name;
      EXPECT_EQ(e->shape, shape) << name;
      const auto got = f.bytes(*e);
      ASSERT_EQ(got.size(), want.size()) << name;
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << name;
    };
    check("w.f32", DType::f32, {2, 3}, as_bytes_of(f32));
    check("w.f64", DType::f64, {3}, as_bytes_of(f64));
    check("w.bf16", DType::bf16, {4}, as_bytes_of(bf));
    check("w.f16", DType::f16, {2, 2}, as_bytes_of(half));
    check("i.i32", DType::i32, {5}, as_bytes_of(i32));
    check("i.i64", DType::i64, {2}, as_bytes_of(i64));
    check("u.u8", DType::u8, {6}, as_bytes_of(u8));
    check("b.bool", DType::b8, {3}, as_bytes_of(b8));
    check("e.empty", DType::f32, {0, 4}, as_bytes_of(empty));
    check("s.scalar", DType::f32, {}, as_bytes_of(scalar));
    EXPECT_EQ(f.metadata().size(), 2u);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("note"), "blu \xc3\xbcn\xc3\xaf" "code");
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips and the reference layout

TEST(SafeTensors, RoundTripInMemory) {
  Fixture fx;
  SafeTensorsWriter w;
  fx.add_to(w);
  const auto buf = w.serialize();
  fx.expect_in(SafeTensorsFile::parse(buf));
}

TEST(SafeTensors, RoundTripThroughFile) {
  TempDir dir;
  Fixture fx;
  SafeTensorsWriter w;
  fx.add_to(w);
  w.write((dir / "a.safetensors").string());
  const auto f = SafeTensorsFile::open((dir / "a.safetensors").string());
  fx.expect_in(f);
  EXPECT_EQ(f.source(), (dir / "a.safetensors").string());
  // The map is page-aligned, the data section 8-aligned, and tensors come in non-increasing
  // element size: every tensor is aligned for its dtype.
  for (const auto& e : f.entries())
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.bytes(e).data()) % dtype_size(e.dtype), 0u) << e.name;
  EXPECT_EQ(dir.count(), 1u) << "temp file left behind";
  EXPECT_EQ(f.find("nope"), nullptr);
  EXPECT_THROW(f.at("nope"), Error);
}

TEST(SafeTensors, DocExample) {  // docs/safetensors.md: keep in step
  TempDir dir;
  const std::string path = (dir / "ckpt.safetensors").string();
  std::vector<float> w(6);
  blu::SafeTensorsWriter out;
  out.add("layer0.w", blu::DType::f32, {2, 3}, std::as_bytes(std::span(w)));
  out.set_metadata("step", "100");
  out.write(path);

  auto f = blu::SafeTensorsFile::open(path);
  const blu::TensorEntry& e = f.at("layer0.w");
  std::span<const std::byte> bytes = f.bytes(e);
  EXPECT_EQ(bytes.size(), 24u);
  EXPECT_EQ(e.numel(), 6u);
  EXPECT_EQ(f.entries().size(), 1u);
  EXPECT_EQ(f.metadata().at("step"), "100");
}

TEST(SafeTensors, EntriesInFileOrderAndSortedLikeReference) {
  // The reference sorts by its Dtype enum descending (I64 > F64 > F32 > I32 > BF16 > F16 > U8 >
  // BOOL), then by name.
  Fixture fx;
  SafeTensorsWriter w;
  fx.add_to(w);
  const auto f = SafeTensorsFile::parse(w.serialize());
  std::vector<std::string> names;
  uint64_t pos = 0;
  for (const auto& e : f.entries()) {
    names.push_back(e.name);
    EXPECT_EQ(e.begin, pos);
    pos = e.end;
  }
  const std::vector<std::string> want = {"i.i64", "w.f64", "e.empty", "s.scalar", "w.f32",
                                         "i.i32", "w.bf16", "w.f16",   "u.u8",     "b.bool"};
  EXPECT_EQ(names, want);
}

TEST(SafeTensors, MatchesReferenceBytes) {
  // Expected outputs from the reference crate's own unit tests (test_serialization,
  // test_serialization_forced_alignement, test_empty).
  std::vector<float> v = {0, 1, 2, 3, 4, 5};
  {
    SafeTensorsWriter w;
    w.add("attn.0", DType::f32, {1, 2, 3}, as_bytes_of(v));
    const std::string h = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    ASSERT_EQ(h.size(), 64u);  // already a multiple of 8: no padding
    EXPECT_EQ(w.header(), h);
    auto want = make_buffer(h);
    const auto d = as_bytes_of(v);
    want.insert(want.end(), d.begin(), d.end());
    EXPECT_EQ(w.serialize(), want);
  }
  {
    SafeTensorsWriter w;
    w.add("attn0", DType::f32, {1, 1, 2, 3}, as_bytes_of(v));
    EXPECT_EQ(w.header(), R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})"
                          "       ");  // 65 + 7 = 72
  }
  {
    SafeTensorsWriter w;
    EXPECT_EQ(w.serialize(), make_buffer("{}      "));
    w.set_metadata("framework", "pt");
    EXPECT_EQ(w.header(), R"({"__metadata__":{"framework":"pt"}})"
                          "     ");  // 35 + 5 = 40
  }
}

TEST(SafeTensors, AcceptsPaddingAndAnyTensorOrderInHeader) {
  // Header entries in any order, offsets in order, header padded with spaces.
  const std::string h = R"({"b":{"data_offsets":[4,6],"shape":[1],"dtype":"BF16"},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}   )";
  const auto f = SafeTensorsFile::parse(make_buffer(h, 6));
  ASSERT_EQ(f.entries().size(), 2u);
  EXPECT_EQ(f.entries()[0].name, "a");
  EXPECT_EQ(f.entries()[1].name, "b");
  EXPECT_EQ(f.entries()[1].dtype, DType::bf16);
  EXPECT_EQ(f.bytes(f.entries()[1])[0], std::byte(4));
}

// ---------------------------------------------------------------------------------------------
// Hostile input

TEST(SafeTensorsHostile, TooShort) {
  expect_refused({}, {"0 bytes", "shorter than the 8-byte"});
  expect_refused(std::vector<std::byte>(7), {"7 bytes"});
}

TEST(SafeTensorsHostile, HugeHeaderLength) {
  expect_refused(make_buffer("{}", 0, 100'000'001), {"header length 100000001", "limit of 100000000"});
  expect_refused(make_buffer("{}", 0, UINT64_MAX), {"header length 18446744073709551615", "limit"});
}

TEST(SafeTensorsHostile, HeaderLengthPastEndOfFile) {
  expect_refused(make_buffer("{}      ", 0, 9), {"header length 9", "past the end", "8 bytes after"});
}

TEST(SafeTensorsHostile, NonUtf8Header) {
  expect_refused(make_buffer("{\"a\xff\":1}"), {"not valid UTF-8", "offset 3"});
  expect_refused(make_buffer("{\"\xc0\xaf\":1}"), {"not valid UTF-8"});          // overlong '/'
  expect_refused(make_buffer("{\"\xed\xa0\x80\":1}"), {"not valid UTF-8"});      // surrogate
  expect_refused(make_buffer("{\"\xe2\x82\":{}}"), {"not valid UTF-8"});         // truncated
}

TEST(SafeTensorsHostile, BadJson) {
  expect_refused(make_buffer(R"({"a":)"), {"not valid JSON"});
  expect_refused(make_buffer(R"({} x)"), {"not valid JSON"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})", 4), {"not valid JSON"});
  expect_refused(make_buffer(R"( {})"), {"must start with '{'", "got ' '"});
  expect_refused(make_buffer(R"([])"), {"must start with '{'"});
  expect_refused(make_buffer(""), {"must start with '{'", "empty header"});
}

TEST(SafeTensorsHostile, OverlappingOffsets) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                             8),
                 {"tensor 'b'", "[4, 8]", "should begin at 8", "'a' ends", "overlap"});
}

TEST(SafeTensorsHostile, Gap) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                             12),
                 {"tensor 'b'", "should begin at 4", "gap"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                 {"tensor 'a'", "should begin at 0", "gap"});
}

TEST(SafeTensorsHostile, OutOfRange) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                 {"tensor 'a'", "ends at 16", "past the end of the data section (8 bytes)"});
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[5,4]}})", 8),
                 {"tensor 'a'", "[5, 4]", "end before they begin"});
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551616]}})"),
                 {"tensor 'a'", "non-negative integer"});
}

TEST(SafeTensorsHostile, ShapeTimesDtypeMismatch) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20),
                 {"tensor 'a'", "[2, 3] x F32", "needs 24 bytes", "give 20"});
  // Overflow: 2^62 * 8 elements.
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,0]}})"),
                 {"tensor 'a'", "overflows 64 bits"});
  // numel overflows to exactly 0 mod 2^64 must not pass as an empty tensor.
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})"),
                 {"tensor 'a'", "overflows"});
}

TEST(SafeTensorsHostile, BadShapes) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})"),
                 {"tensor 'a'", "non-negative integer", "got -1"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", 4),
                 {"tensor 'a'", "non-negative integer", "got 1.0"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", 4),
                 {"tensor 'a'", "shape must be an array"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]}})"),
                 {"tensor 'a'", "larger than"});
  expect_refused(make_buffer(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
                 {"tensor 'a'", "data_offsets must be [begin, end]"});
}

TEST(SafeTensorsHostile, UnknownAndUnsupportedDtype) {
  expect_refused(make_buffer(R"({"a":{"dtype":"F7","shape":[1],"data_offsets":[0,4]}})", 4),
                 {"tensor 'a'", "dtype 'F7'", "not a safetensors dtype", "expected one of"});
  expect_refused(make_buffer(R"({"q":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})", 1),
                 {"tensor 'q'", "dtype 'I8'", "not supported by BluTrain"});
  expect_refused(make_buffer(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4),
                 {"tensor 'a'", "dtype 'f32'"});  // names are case-sensitive
  expect_refused(make_buffer(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4),
                 {"tensor 'a'", "dtype must be a string"});
}

TEST(SafeTensorsHostile, DuplicateKeys) {
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                             2),
                 {"key 'a' appears twice"});
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", 1),
                 {"key 'dtype' appears twice"});
}

TEST(SafeTensorsHostile, UnknownAndMissingFields) {
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":0}})", 1),
                 {"tensor 'a'", "unknown field 'extra'"});
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1),
                 {"tensor 'a'", "missing field 'shape'"});
  expect_refused(make_buffer(R"({"a":[0,1]})", 1), {"tensor 'a'", "expected an object"});
}

TEST(SafeTensorsHostile, TrailingBytesNotCovered) {
  expect_refused(make_buffer(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3),
                 {"cover 2 bytes", "holds 3 bytes", "1 trailing"});
  expect_refused(make_buffer("{}", 1), {"cover 0 bytes", "holds 1 bytes"});
}

TEST(SafeTensorsHostile, BadMetadata) {
  expect_refused(make_buffer(R"({"__metadata__":{"k":1}})"), {"__metadata__['k'] must be a string", "got 1"});
  expect_refused(make_buffer(R"({"__metadata__":["k"]})"), {"__metadata__ must be an object"});
  expect_refused(make_buffer(R"({"__metadata__":{"k":"a","k":"b"}})"), {"key 'k' appears twice"});
}

TEST(SafeTensorsHostile, DeepNestingDoesNotOverflowTheStack) {
  const size_t depth = 1'000'000;
  std::string h = R"({"a":)" + std::string(depth, '[') + std::string(depth, ']') + "}";
  expect_refused(make_buffer(h), {"nests deeper than 64"});
  h = R"({"__metadata__":{"k":)" + std::string(depth, '[') + std::string(depth, ']') + "}}";
  expect_refused(make_buffer(h), {"nests deeper than 64"});
  h = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":)";
  for (size_t i = 0; i < depth; ++i) h += R"({"k":)";
  expect_refused(make_buffer(h, 1), {"nests deeper than 64"});
  // Shallow nesting gets the ordinary message.
  expect_refused(make_buffer(R"({"a":[[[]]]})"), {"tensor 'a'", "got an array of 1 elements"});
}

TEST(SafeTensorsHostile, OpenNamesThePath) {
  TempDir dir;
  const auto p = dir / "bad.safetensors";
  write_file(p, std::string("\x02\0\0\0\0\0\0\0{}", 10) + "zz");
  try {
    SafeTensorsFile::open(p.string());
    ADD_FAILURE() << "accepted trailing bytes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  write_file(dir / "short", "abc");
  EXPECT_THROW(SafeTensorsFile::open((dir / "short").string()), Error);
  EXPECT_THROW(SafeTensorsFile::open((dir / "missing").string()), Error);
  EXPECT_THROW(SafeTensorsFile::open(dir.path().string()), Error);  // a directory
}

// ---------------------------------------------------------------------------------------------
// Writer checks

TEST(SafeTensorsWriter, RefusesBadTensors) {
  std::vector<float> v(6);
  SafeTensorsWriter w;
  w.add("a", DType::f32, {2, 3}, as_bytes_of(v));
  EXPECT_THROW(w.add("a", DType::f32, {2, 3}, as_bytes_of(v)), Error);           // duplicate
  EXPECT_THROW(w.add("b", DType::f32, {2, 2}, as_bytes_of(v)), Error);           // 16 != 24 bytes
  EXPECT_THROW(w.add("c", DType::f64, {2, 3}, as_bytes_of(v)), Error);           // 48 != 24 bytes
  EXPECT_THROW(w.add("d", DType::f32, {-2, -3}, as_bytes_of(v)), Error);         // negative dims
  EXPECT_THROW(w.add("__metadata__", DType::f32, {6}, as_bytes_of(v)), Error);   // reserved
  EXPECT_THROW(w.add("bad\xff", DType::f32, {6}, as_bytes_of(v)), Error);        // not UTF-8
  EXPECT_THROW(w.set_metadata("k", "\xc3"), Error);
  try {
    w.add("b", DType::f32, {2, 2}, as_bytes_of(v));
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needs 16 bytes, got 24"), std::string::npos) << msg;
  }
  EXPECT_EQ(SafeTensorsFile::parse(w.serialize()).entries().size(), 1u);  // refused adds left no trace
}

// ---------------------------------------------------------------------------------------------
// Atomic writes

TEST(SafeTensorsAtomic, ReplacesExistingFileAndKeepsMode) {
  TempDir dir;
  const auto p = dir / "ckpt.safetensors";
  std::vector<int32_t> a = {1, 2}, b = {3, 4, 5};
  SafeTensorsWriter w1;
  w1.add("x", DType::i32, {2}, as_bytes_of(a));
  w1.write(p.string());
  ASSERT_EQ(::chmod(p.c_str(), 0640), 0);
  SafeTensorsWriter w2;
  w2.add("x", DType::i32, {3}, as_bytes_of(b));
  w2.write(p.string());
  const auto f = SafeTensorsFile::open(p.string());
  EXPECT_EQ(f.at("x").shape, std::vector<int64_t>{3});
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  EXPECT_EQ(dir.count(), 1u);
}

TEST(SafeTensorsAtomic, OpenFileSurvivesReplacement) {
  // A reader holding the old file keeps seeing the old bytes: the writer never writes in place.
  TempDir dir;
  const auto p = dir / "ckpt.safetensors";
  std::vector<int32_t> a = {1, 2}, b = {7, 8};
  SafeTensorsWriter w1, w2;
  w1.add("x", DType::i32, {2}, as_bytes_of(a));
  w2.add("x", DType::i32, {2}, as_bytes_of(b));
  w1.write(p.string());
  const auto old = SafeTensorsFile::open(p.string());
  w2.write(p.string());
  int32_t first;
  std::memcpy(&first, old.bytes(old.at("x")).data(), 4);
  EXPECT_EQ(first, 1);
}

TEST(SafeTensorsAtomic, FailedDataWriteLeavesOldFileIntact) {
  // A real I/O failure in the middle of the data: the file size limit makes write() fail with
  // EFBIG (SIGXFSZ ignored) once the temp file passes 4 KiB.
  TempDir dir;
  const auto p = dir / "ckpt.safetensors";
  write_file(p, "old contents");
  std::vector<float> big(1 << 16, 1.5f);  // 256 KiB
  SafeTensorsWriter w;
  w.add("big", DType::f32, {1 << 16}, as_bytes_of(big));

  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    w.write(p.string());
  } catch (const Error& e) {
    msg = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);
  signal(SIGXFSZ, old_handler);

  EXPECT_NE(msg.find("write to"), std::string::npos) << "expected a write failure, got: '" << msg << "'";
  EXPECT_EQ(read_file(p), "old contents");
  EXPECT_EQ(dir.count(), 1u) << "temp file left behind";
}

TEST(SafeTensorsAtomic, FailedRenameLeavesNoTempFile) {
  TempDir dir;
  const auto target = dir / "is_a_dir";
  fs::create_directory(target);
  write_file(target / "keep", "x");
  std::vector<uint8_t> v = {1};
  SafeTensorsWriter w;
  w.add("v", DType::u8, {1}, as_bytes_of(v));
  try {
    w.write(target.string());
    ADD_FAILURE() << "rename over a directory succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rename"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dir.count(), 1u) << "temp file left behind";
  EXPECT_EQ(read_file(target / "keep"), "x");
}

TEST(SafeTensorsAtomic, MissingDirectory) {
  TempDir dir;
  std::vector<uint8_t> v = {1};
  SafeTensorsWriter w;
  w.add("v", DType::u8, {1}, as_bytes_of(v));
  EXPECT_THROW(w.write((dir / "no" / "such" / "x.safetensors").string()), Error);
  EXPECT_EQ(dir.count(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Exchange with PyTorch (tests/common/st_py.py, driven by tests/io/safetensors_reference.py)

namespace {
const char* kPython = "/usr/bin/python3";
bool python_has_torch() {
  static const bool ok = std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
  return ok;
}
int run_reference(const std::string& cmd, const fs::path& file) {
  const std::string line = std::string(kPython) + " " + BLU_TEST_DIR + "/io/safetensors_reference.py " + cmd + " '" +
                           file.string() + "'";
  return std::system(line.c_str());
}
}  // namespace

TEST(SafeTensorsPyOracle, CppWritesTorchReads) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch";
  TempDir dir;
  Fixture fx;
  SafeTensorsWriter w;
  fx.add_to(w);
  w.write((dir / "cpp.safetensors").string());
  EXPECT_EQ(run_reference("verify", dir / "cpp.safetensors"), 0);
}

TEST(SafeTensorsPyOracle, TorchWritesCppReads) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch";
  TempDir dir;
  const auto p = dir / "py.safetensors";
  ASSERT_EQ(run_reference("write", p), 0);
  Fixture fx;
  const auto f = SafeTensorsFile::open(p.string());
  fx.expect_in(f);
  // Same tensors, same layout rules: the files are identical byte for byte.
  SafeTensorsWriter w;
  fx.add_to(w);
  const auto mine = w.serialize();
  EXPECT_EQ(read_file(p), std::string(reinterpret_cast<const char*>(mine.data()), mine.size()));
}
