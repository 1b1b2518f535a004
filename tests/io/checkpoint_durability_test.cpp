// Tests for the durability of io/checkpoint and io/json_file: the checksum of a checkpoint is
// verified on load (an error naming the file, expected and got), a newer format version is refused
// by number, a file without a version (format 1) still loads, the newest checkpoint that verifies
// is chosen by step number past truncated or corrupt newer ones (with a warning), leftover temp
// files are removed, and an atomic JSON write to a full disk (/dev/full) fails loudly and keeps the
// previous file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "blu/blu.h"
#include "blu/io/checkpoint.h"
#include "blu/io/checksum.h"
#include "blu/io/json_file.h"
#include "blu/io/safetensors.h"
#include "common/checks.h"

namespace fs = std::filesystem;

namespace blu {
namespace {

using test::bitwise_equal;
using test::error_of;

class Small : public nn::Module {
 public:
  explicit Small(uint64_t seed) {
    Generator gen(seed);
    register_parameter("w", w, randn({3, 5}, DType::f32, kCPU, &gen));
    register_parameter("b", b, randn({5}, DType::f32, kCPU, &gen));
  }
  Tensor w, b;
};

std::unique_ptr<optim::Optimizer> make_opt(const nn::Module& m) {
  return optim::make_adamw(optim::decay_groups(m.named_parameters(), 0.1), {.lr = 1e-2});
}

void flip_byte(const fs::path& p, std::streamoff from_end) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  const char c = char(f.get());
  f.seekp(-from_end, std::ios::end);
  f.put(char(c ^ 0x10));
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// A copy of `src` with its tensors and train_state, and the metadata `extra` instead of the
// version and checksum.
void rewrite(const std::string& src, const std::string& dst, const std::map<std::string, std::string>& extra) {
  SafeTensorsFile f = SafeTensorsFile::open(src);
  SafeTensorsWriter w;
  for (const TensorEntry& e : f.entries()) w.add(e.name, e.dtype, e.shape, f.bytes(e));
  w.set_metadata("train_state", f.metadata().at("train_state"));
  for (const auto& [k, v] : extra) w.set_metadata(k, v);
  w.write(dst);
}

class CheckpointDurability : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/blu_ckpt_durable_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string save(int64_t step, int keep_last = 0) {
    TrainState st;
    st.step = step;
    st.model_config = {{"width", 5}};
    return save_checkpoint(dir_, model_, opt_.get(), st, keep_last);
  }
  fs::path dir_;
  Small model_{1};
  std::unique_ptr<optim::Optimizer> opt_ = make_opt(model_);
};

TEST_F(CheckpointDurability, WritesAVersionAndAChecksum) {
  const std::string path = save(3);
  SafeTensorsFile f = SafeTensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("format_version"), std::to_string(kCheckpointFormatVersion));
  EXPECT_EQ(f.metadata().at("checksum").rfind("xxh3-64:", 0), 0u) << f.metadata().at("checksum");
  EXPECT_EQ(f.metadata().at("checksum").size(), 8u + 16u);
  verify_checkpoint(path);
}

TEST_F(CheckpointDurability, ChecksumMismatchNamesFileExpectedAndGot) {
  const std::string path = save(1);
  flip_byte(path, 3);  // inside the last tensor's bytes: the file stays a valid safetensors file
  Small other(2);
  auto opt = make_opt(other);
  const Tensor before = clone(other.w);
  const std::string err = error_of([&] { load_checkpoint(path, other, opt.get()); });
  EXPECT_NE(err.find("checksum mismatch in " + path), std::string::npos) << err;
  EXPECT_NE(err.find("expected xxh3-64:"), std::string::npos) << err;
  EXPECT_NE(err.find(", got xxh3-64:"), std::string::npos) << err;
  EXPECT_TRUE(bitwise_equal(other.w, before));  // nothing was loaded
  EXPECT_NE(error_of([&] { verify_checkpoint(path); }).find("checksum mismatch"), std::string::npos);
}

TEST_F(CheckpointDurability, NewerFormatVersionIsRefusedByNumber) {
  const std::string path = save(1);
  const std::string future = (dir_ / "future.safetensors").string();
  rewrite(path, future, {{"format_version", "3"}});
  Small other(2);
  const std::string err = error_of([&] { load_checkpoint(future, other, nullptr); });
  EXPECT_NE(err.find(future + " has format version 3; this build reads versions 1 to 2"), std::string::npos) << err;
  rewrite(path, future, {{"format_version", "two"}});
  EXPECT_NE(error_of([&] { verify_checkpoint(future); }).find("format_version must be a positive integer, got 'two'"),
            std::string::npos);
}

TEST_F(CheckpointDurability, FileWithoutVersionLoadsAsFormat1) {
  const std::string path = save(1);
  const std::string old = (dir_ / "old.safetensors").string();
  rewrite(path, old, {});  // no format_version, no checksum: what main wrote before versions
  Small other(2);
  auto opt = make_opt(other);
  EXPECT_EQ(load_checkpoint(old, other, opt.get()).step, 1);
  EXPECT_TRUE(bitwise_equal(other.w, model_.w));
  // A format 2 file must carry its checksum.
  rewrite(path, old, {{"format_version", "2"}});
  EXPECT_NE(error_of([&] { verify_checkpoint(old); }).find("has no 'checksum' metadata"), std::string::npos);
}

TEST_F(CheckpointDurability, NewestValidCheckpointIsChosenPastTruncatedAndCorruptOnes) {
  save(1);
  const std::string two = save(2), three = save(3);
  fs::resize_file(three, fs::file_size(three) - 7);  // a save cut short by a crash outside our writer
  std::vector<std::string> warnings;
  const auto warn = [&](const std::string& w) { warnings.push_back(w); };
  EXPECT_EQ(latest_checkpoint(dir_.string()), three);
  EXPECT_EQ(latest_valid_checkpoint(dir_.string(), warn), two);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("warning: skipping checkpoint " + three + " (step 3)"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("trying the previous one"), std::string::npos) << warnings[0];

  flip_byte(two, 1);
  warnings.clear();
  EXPECT_EQ(latest_valid_checkpoint(dir_.string(), warn), (dir_ / "ckpt_00000001.safetensors").string());
  EXPECT_EQ(warnings.size(), 2u);
  flip_byte(dir_ / "ckpt_00000001.safetensors", 1);
  EXPECT_EQ(latest_valid_checkpoint(dir_.string(), warn), "");
}

TEST_F(CheckpointDurability, SelectionIsByStepNumberNotName) {
  const std::string a = save(99'999'999), b = save(100'000'000);  // "ckpt_100000000" < "ckpt_99999999" by name
  EXPECT_EQ(latest_checkpoint(dir_.string()), b);
  EXPECT_EQ(latest_valid_checkpoint(dir_.string()), b);
  save(5, /*keep_last=*/2);  // keeps the new one and the highest step before it
  EXPECT_FALSE(fs::exists(a));
  EXPECT_TRUE(fs::exists(b));
}

TEST_F(CheckpointDurability, LeftoverTempFilesAreRemovedByTheNextSave) {
  const fs::path leftover = dir_ / "ckpt_00000004.safetensors.tmp.Ab12Cd";
  std::ofstream(leftover) << "partial";
  const fs::path other = dir_ / "notes.tmp.txt";
  std::ofstream(other) << "not ours";
  save(5);
  EXPECT_FALSE(fs::exists(leftover));
  EXPECT_TRUE(fs::exists(other));
}

TEST_F(CheckpointDurability, FileDigestIsTheChecksumOfItsBytes) {
  const fs::path p = dir_ / "bytes.bin";
  std::ofstream(p, std::ios::binary) << "checkpoint bytes";
  io::Checksum sum;
  sum.update(std::string_view("checkpoint "));
  sum.update(std::string_view("bytes"));
  const io::FileDigest d = io::digest_file(p);
  EXPECT_EQ(d.bytes, 16u);
  EXPECT_EQ(d.checksum, sum.hex());
  flip_byte(p, 1);
  EXPECT_NE(io::digest_file(p).checksum, sum.hex());
  EXPECT_NE(error_of([&] { io::digest_file(dir_ / "absent"); }).find("cannot open " + (dir_ / "absent").string()),
            std::string::npos);
}

// A full disk: the bytes go to /dev/full (ENOSPC) — once through the fault injection of
// Note [Write fault injection], once through a temp path that is a link to /dev/full.
TEST_F(CheckpointDurability, AtomicWriteToAFullDiskFailsLoudlyAndKeepsThePreviousFile) {
  const fs::path p = dir_ / "COMMIT";
  io::write_json_file(p, {{"step", 1}});
  const std::string before = read_text(p);
  ::setenv("BLU_TEST_WRITE_FULL", "COMMIT", 1);
  std::string err = error_of([&] { io::write_json_file(p, {{"step", 2}}); });
  ::unsetenv("BLU_TEST_WRITE_FULL");
  EXPECT_NE(err.find("cannot write " + p.string() + ".tmp (for " + p.string() + "): No space left on device"),
            std::string::npos)
      << err;
  EXPECT_EQ(read_text(p), before);
  EXPECT_FALSE(fs::exists(p.string() + ".tmp"));

  fs::create_symlink("/dev/full", p.string() + ".tmp");
  err = error_of([&] { io::write_json_file(p, {{"step", 3}}); });
  EXPECT_NE(err.find("No space left on device"), std::string::npos) << err;
  EXPECT_EQ(read_text(p), before);
  io::write_json_file(p, {{"step", 4}});  // and a healthy disk writes
  EXPECT_EQ(io::read_json_file(p)["step"], 4);
}

TEST_F(CheckpointDurability, EmptyJsonFileIsAnErrorNamingIt) {
  const fs::path p = dir_ / "COMMIT";
  std::ofstream(p).close();
  const std::string err = error_of([&] { io::read_json_file(p); });
  EXPECT_NE(err.find(p.string() + ": empty file"), std::string::npos) << err;
}

}  // namespace
}  // namespace blu
