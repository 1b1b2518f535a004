#include "blu/data/prepare.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <set>
#include <stdexcept>

#include "blu/data/shard.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

constexpr int32_t kEot = 256;

// Bytes as tokens: the simplest tokenizer that keeps documents readable in the shards.
std::vector<int32_t> byte_encode(std::string_view s) {
  std::vector<int32_t> t;
  for (unsigned char c : s) t.push_back(c);
  return t;
}

// A folder in the shape of Debian's fortunes: entry files, strfile indexes, .u8 links, and a
// binary file. Returns the documents prepare must find, in order.
std::vector<std::string> make_fortunes(const fs::path& root) {
  const fs::path dir = root / "fortunes";
  fs::create_directories(dir / "sub");
  test::write_bytes(dir / "alpha", "one\n%\ntwo lines\nhere\n%\n%\nthree\n");
  test::write_bytes(dir / "alpha.dat", std::string("\x00\x00\x00\x02\x00\x00\x00\x03", 8));
  fs::create_symlink("alpha", dir / "alpha.u8");
  test::write_bytes(dir / "beta", "four\r\n%\r\nfive\n");
  test::write_bytes(dir / "beta.dat", std::string("\x01\x02", 2));
  test::write_bytes(dir / "nul_inside", std::string("text\0more\n%\nx\n", 14));
  test::write_bytes(dir / "sub" / "gamma", "six\n%\nseven");
  return {"one\n", "two lines\nhere\n", "three\n", "four\r\n", "five\n", "six\n", "seven"};
}

std::vector<uint16_t> read_tokens(const fs::path& p) {
  ShardReader r(p);
  return {r.tokens().begin(), r.tokens().end()};
}

// Splits a token stream at end-of-text tokens back into byte strings.
std::vector<std::string> split_docs(const std::vector<uint16_t>& stream) {
  std::vector<std::string> docs;
  for (uint16_t t : stream) {
    if (t == kEot)
      docs.emplace_back();
    else
      docs.back().push_back(static_cast<char>(t));
  }
  return docs;
}

std::vector<uint16_t> concat_shards(const std::vector<fs::path>& files) {
  std::vector<uint16_t> all;
  for (const auto& f : files) {
    auto t = read_tokens(f);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

TEST(SplitFortunes, EntriesBetweenPercentLines) {
  EXPECT_EQ(split_fortunes("a\n%\nb\nc\n%\n"), (std::vector<std::string>{"a\n", "b\nc\n"}));
  EXPECT_EQ(split_fortunes("%\n  \n%\nx"), (std::vector<std::string>{"x"}));
  EXPECT_EQ(split_fortunes("100%\n% \n%\r\ny\n"), (std::vector<std::string>{"100%\n% \n", "y\n"}));
  EXPECT_TRUE(split_fortunes("").empty());
}

TEST(Prepare, FirstShardIsValidation) {
  TempDir tmp;
  const auto docs = make_fortunes(tmp.path());
  PrepareOptions opt;
  opt.name = "fort";
  opt.shard_tokens = 16;
  const PrepareStats st = prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt);

  std::vector<uint16_t> expected;
  for (const auto& d : docs) {
    expected.push_back(kEot);
    for (unsigned char c : d) expected.push_back(c);
  }
  EXPECT_EQ(st.documents, 7);
  EXPECT_EQ(st.tokens, static_cast<int64_t>(expected.size()));
  const int64_t n_shards = (static_cast<int64_t>(expected.size()) + 15) / 16;
  EXPECT_EQ(st.shards, n_shards);
  EXPECT_EQ(st.val_shards, 1);
  EXPECT_EQ(st.val_tokens, 16);
  EXPECT_EQ(st.train_shards, n_shards - 1);
  EXPECT_EQ(st.files,
            (std::vector<fs::path>{tmp / "fortunes/alpha", tmp / "fortunes/beta", tmp / "fortunes/sub/gamma"}));
  EXPECT_EQ(st.skipped, (std::vector<fs::path>{tmp / "fortunes/alpha.dat", tmp / "fortunes/alpha.u8",
                                               tmp / "fortunes/beta.dat", tmp / "fortunes/nul_inside"}));

  // Names, sizes, and the stream in order: val first, then train.
  ASSERT_EQ(static_cast<int64_t>(st.shard_paths.size()), n_shards);
  EXPECT_EQ(st.shard_paths[0], tmp / "out/fort_val_000000.bin");
  EXPECT_EQ(st.shard_paths[1], tmp / "out/fort_train_000000.bin");
  EXPECT_EQ(st.shard_paths.back(), tmp / ("out/fort_train_00000" + std::to_string(n_shards - 2) + ".bin"));
  for (size_t i = 0; i + 1 < st.shard_paths.size(); ++i) EXPECT_EQ(read_tokens(st.shard_paths[i]).size(), 16u);
  EXPECT_LE(read_tokens(st.shard_paths.back()).size(), 16u);
  EXPECT_EQ(concat_shards(st.shard_paths), expected);
  EXPECT_EQ(split_docs(expected), docs);  // every document starts with EOT
  EXPECT_EQ(st.val_documents + st.train_documents, 7);
  // Only the shards are left in the output folder.
  EXPECT_EQ(test::list_dir(tmp / "out").size(), static_cast<size_t>(n_shards));
}

TEST(Prepare, WholeFilesOutsideFortunes) {
  TempDir tmp;
  fs::create_directories(tmp / "txt");
  test::write_bytes(tmp / "txt/b.txt", "second\n%\nstill second\n");
  test::write_bytes(tmp / "txt/a.txt", "first\n");
  test::write_bytes(tmp / "txt/empty.txt", "  \n");
  test::write_bytes(tmp / "single.txt", "third");
  PrepareOptions opt;
  opt.shard_tokens = 8;
  // A folder and a file; the folder's files in sorted order, blank files give no document.
  auto st = prepare({tmp / "txt", tmp / "single.txt"}, tmp / "out", byte_encode, kEot, opt);
  EXPECT_EQ(split_docs(concat_shards(st.shard_paths)),
            (std::vector<std::string>{"first\n", "second\n%\nstill second\n", "third"}));
  EXPECT_EQ(st.documents, 3);
  // Asking for fortune splitting splits b.txt.
  opt.split = DocSplit::fortune;
  opt.name = "f";
  st = prepare({tmp / "txt"}, tmp / "out", byte_encode, kEot, opt);
  EXPECT_EQ(split_docs(concat_shards(st.shard_paths)),
            (std::vector<std::string>{"first\n", "second\n", "still second\n"}));
}

TEST(Prepare, ValFractionSplitsDocumentsBySeed) {
  TempDir tmp;
  const auto docs = make_fortunes(tmp.path());
  auto run = [&](uint64_t seed, const std::string& out) {
    PrepareOptions opt;
    opt.shard_tokens = 10;
    opt.val_fraction = 0.3;  // round(0.3 * 7) = 2 documents
    opt.seed = seed;
    return prepare({tmp / "fortunes"}, tmp / out, byte_encode, kEot, opt);
  };
  const PrepareStats st = run(1, "a");
  EXPECT_EQ(st.val_documents, 2);
  EXPECT_EQ(st.train_documents, 5);
  std::vector<fs::path> val, train;
  for (const auto& p : st.shard_paths) {
    (p.filename().string().find("_val_") != std::string::npos ? val : train).push_back(p);
    EXPECT_LE(read_tokens(p).size(), 10u);
  }
  EXPECT_EQ(static_cast<int64_t>(val.size()), st.val_shards);
  EXPECT_EQ(static_cast<int64_t>(train.size()), st.train_shards);
  const auto val_docs = split_docs(concat_shards(val));
  const auto train_docs = split_docs(concat_shards(train));
  ASSERT_EQ(val_docs.size(), 2u);
  ASSERT_EQ(train_docs.size(), 5u);
  // Each split keeps the input order, and together they are all documents, each once.
  std::vector<std::string> merged;
  size_t vi = 0, ti = 0;
  for (const auto& d : docs) {
    if (vi < val_docs.size() && val_docs[vi] == d)
      merged.push_back(val_docs[vi++]);
    else if (ti < train_docs.size() && train_docs[ti] == d)
      merged.push_back(train_docs[ti++]);
  }
  EXPECT_EQ(merged, docs);

  // Same seed, same bytes; different seeds pick different documents.
  const PrepareStats again = run(1, "b");
  ASSERT_EQ(again.shard_paths.size(), st.shard_paths.size());
  for (size_t i = 0; i < st.shard_paths.size(); ++i)
    EXPECT_EQ(test::read_bytes(again.shard_paths[i]), test::read_bytes(st.shard_paths[i]));
  std::set<std::vector<std::string>> val_sets;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const auto s = run(seed, "s" + std::to_string(seed));
    std::vector<fs::path> v;
    for (const auto& p : s.shard_paths)
      if (p.filename().string().find("_val_") != std::string::npos) v.push_back(p);
    val_sets.insert(split_docs(concat_shards(v)));
  }
  EXPECT_GT(val_sets.size(), 1u);
}

TEST(Prepare, RefusesToOverwriteAndRemovesStaleShardsWhenAsked) {
  TempDir tmp;
  make_fortunes(tmp.path());
  PrepareOptions opt;
  opt.name = "x";
  opt.shard_tokens = 8;
  const auto first = prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt);
  const auto before = test::list_dir(tmp / "out");
  ASSERT_GT(before.size(), 4u);
  const std::string val0 = test::read_bytes(tmp / "out/x_val_000000.bin");

  opt.shard_tokens = 32;
  expect_error([&] { prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt); },
               {"already holds", "x_*.bin", "overwrite"});
  EXPECT_EQ(test::list_dir(tmp / "out"), before);
  EXPECT_EQ(test::read_bytes(tmp / "out/x_val_000000.bin"), val0);

  // Another name in the same folder is fine.
  opt.name = "y";
  prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt);

  opt.name = "x";
  opt.overwrite = true;
  const auto second = prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt);
  std::vector<std::string> x_files;
  for (const auto& n : test::list_dir(tmp / "out"))
    if (n.rfind("x_", 0) == 0) x_files.push_back(n);
  EXPECT_EQ(static_cast<int64_t>(x_files.size()), second.shards);  // stale x_train_* removed
  EXPECT_LT(second.shards, first.shards);
}

TEST(Prepare, NoPartialFilesOnFailure) {
  TempDir tmp;
  make_fortunes(tmp.path());
  PrepareOptions opt;
  opt.shard_tokens = 4;  // several shards are written before the failure
  int calls = 0;
  auto failing = [&](std::string_view s) -> std::vector<int32_t> {
    if (++calls == 6) throw std::runtime_error("tokenizer broke");
    return byte_encode(s);
  };
  EXPECT_THROW(prepare({tmp / "fortunes"}, tmp / "out", failing, kEot, opt), std::runtime_error);
  EXPECT_TRUE(test::list_dir(tmp / "out").empty());

  auto too_big = [&](std::string_view s) {
    auto t = byte_encode(s);
    t.back() = 70000;
    return t;
  };
  expect_error([&] { prepare({tmp / "fortunes"}, tmp / "out", too_big, kEot, opt); },
               {"fortunes/alpha", "document 0", "70000", "uint16"});
  EXPECT_TRUE(test::list_dir(tmp / "out").empty());
}

// A corpus that fits in one shard is split by default, not refused (the first shard alone would
// be validation and leave nothing to train on): its first documents, about a tenth of the tokens,
// for validation, cut at a document start; one document is cut inside.
TEST(Prepare, SmallCorpusIsSplitByDefault) {
  TempDir tmp;
  const auto docs = make_fortunes(tmp.path());
  PrepareOptions opt;
  opt.shard_tokens = 1000;  // everything fits in one shard
  const PrepareStats st = prepare({tmp / "fortunes"}, tmp / "out", byte_encode, kEot, opt);
  EXPECT_EQ(st.val_shards, 1);
  EXPECT_EQ(st.train_shards, 1);
  EXPECT_GE(st.val_tokens, st.tokens / 10);
  EXPECT_LE(st.val_tokens, st.tokens / 2);
  EXPECT_EQ(st.val_documents + st.train_documents, 7);
  EXPECT_GE(st.val_documents, 1);
  // Cut at a document start: both shards begin with end-of-text, and together they are the corpus.
  ASSERT_EQ(st.shard_paths.size(), 2u);
  EXPECT_EQ(read_tokens(st.shard_paths[0]).front(), kEot);
  EXPECT_EQ(read_tokens(st.shard_paths[1]).front(), kEot);
  EXPECT_EQ(split_docs(concat_shards(st.shard_paths)), docs);
  // One document: cut inside it, a tenth of its tokens for validation.
  test::write_bytes(tmp / "one.txt", std::string(100, 'a'));
  const PrepareStats one = prepare({tmp / "one.txt"}, tmp / "out1", byte_encode, kEot, opt);
  EXPECT_EQ(one.val_tokens, 10);
  EXPECT_EQ(one.train_tokens, 91);
  EXPECT_EQ(one.val_documents, 1);
  EXPECT_EQ(one.train_documents, 0);
}

// Gzip-compressed text reads as the text itself; a file that only looks compressed is refused by name.
TEST(Prepare, ReadsGzipText) {
  TempDir tmp;
  const std::string text = "first entry\n%\nsecond entry\n%\nthird entry\n";
  fs::create_directories(tmp / "plain/fortunes");
  fs::create_directories(tmp / "gz/fortunes");
  test::write_bytes(tmp / "plain/fortunes/a", text);
  gzFile gz = gzopen((tmp / "gz/fortunes/a.gz").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  ASSERT_EQ(gzwrite(gz, text.data(), unsigned(text.size())), int(text.size()));
  ASSERT_EQ(gzclose(gz), Z_OK);
  PrepareOptions opt;
  opt.shard_tokens = 16;
  const PrepareStats plain = prepare({tmp / "plain"}, tmp / "out1", byte_encode, kEot, opt);
  const PrepareStats zipped = prepare({tmp / "gz"}, tmp / "out2", byte_encode, kEot, opt);
  EXPECT_EQ(zipped.documents, 3);
  EXPECT_EQ(concat_shards(zipped.shard_paths), concat_shards(plain.shard_paths));
  test::write_bytes(tmp / "bad.gz", std::string("\x1f\x8b\x08\x00garbage-not-deflate", 22));
  expect_error([&] { prepare({tmp / "bad.gz"}, tmp / "out3", byte_encode, kEot, opt); },
               {"bad.gz", "not readable gzip data"});
}

TEST(Prepare, BadInputs) {
  TempDir tmp;
  make_fortunes(tmp.path());
  expect_error([&] { prepare({tmp / "missing"}, tmp / "out", byte_encode, kEot); }, {"missing", "does not exist"});
  fs::create_directories(tmp / "bin");
  test::write_bytes(tmp / "bin/a.dat", "x");
  expect_error([&] { prepare({tmp / "bin"}, tmp / "out2", byte_encode, kEot); }, {"no text documents"});
  expect_error([&] { prepare({tmp / "fortunes"}, tmp / "out", byte_encode, 70000); }, {"end-of-text", "70000"});
}

TEST(Prepare, DebianFortunes) {
  const fs::path src = "/usr/share/games/fortunes";
  if (!fs::is_directory(src)) GTEST_SKIP() << src << " is not installed";
  TempDir tmp;
  PrepareOptions opt;
  opt.name = "fortunes";
  opt.shard_tokens = 1 << 18;
  const auto st = prepare({src}, tmp.path(), byte_encode, kEot, opt);
  EXPECT_GT(st.documents, 1000);
  EXPECT_GE(st.train_shards, 1);
  for (const auto& f : st.files) {
    EXPECT_NE(f.extension(), ".dat");
    EXPECT_NE(f.extension(), ".u8");
  }
  EXPECT_EQ(read_tokens(st.shard_paths[0])[0], kEot);
}

}  // namespace
}  // namespace blu
