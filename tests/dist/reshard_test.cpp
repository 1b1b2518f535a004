// Layout checkpoints across layouts (dist/layout_checkpoint.h), end to end on Gloo: a tiny GPT-2
// (tied, padded vocabulary) and a tiny Llama (GQA, untied head) train 3 steps under layout A,
// save, and continue 3 steps under layout B from what A wrote; the losses must match an
// uninterrupted single-process run. The covering set of (writer → reader) pairs, each layout
// at least once on each side, both families:
//   tp → pp, zero3 → tp, single → zero1, tpsp → zero3 (GPT-2);
//   tp → single, zero1 → single (2 ranks to 1), pp → tpsp, zero3 → ddp (Llama).
// Same layout: a resumed run equals the uninterrupted run of that layout bit for bit (TP, PP,
// ZeRO-3, and single), also after `kill -9` of a rank in the forward or in the middle of a save
// (TP, TP+SP, PP, ZeRO-1, ZeRO-3, single);
// a corrupt or truncated newest checkpoint falls back to the previous one under each layout.
//
// Tolerance across layouts (fp32): the layouts compute the same sums in other orders (TP's split
// K summed by all-reduce, a vocabulary-split cross-entropy, DP's gradients averaged over ranks,
// a pipeline's two micro-batches summed), a few ulps per op. Measured over the pairs below: the
// losses of six AdamW steps at lr 1e-3 within 1.1e-7 relative of the single process; bound 1e-6.
// A wrongly placed box, a moment loaded into the wrong parameter or a lost step count moves the
// loss by far more (checked: a checkpoint with its moments zeroed moves the next step's loss by
// more than 10x the bound — ReshardTest.ZeroedMomentsAreSeen).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "blu/dist/layout_checkpoint.h"
#include "blu/blu.h"
#include "blu/io/json_file.h"
#include "common/checks.h"
#include "dist_test_util.h"

namespace blu::dist::test {
namespace {

namespace fs = std::filesystem;

constexpr double kRel = 1e-6;

int ranks_of(const std::string& layout) { return layout == "single" ? 1 : 2; }

std::map<int64_t, double> read_losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream f(path);
  int64_t s;
  double l;
  while (f >> s >> l) out[s] = l;
  return out;
}

// Runs `layout` over steps [from, to); returns its losses by step.
std::map<int64_t, double> run(const TempDir& tmp, const std::string& family, const std::string& layout, int64_t from,
                              int64_t to, const std::string& load, const std::string& save,
                              std::vector<std::pair<std::string, std::string>> extra = {}, int expect_status = 0,
                              std::string* output = nullptr) {
  static int n = 0;
  const std::string out = tmp.str() + "/losses_" + std::to_string(n++);
  extra.insert(extra.end(), {{"BLU_RS_FAMILY", family},
                             {"BLU_RS_LAYOUT", layout},
                             {"BLU_RS_FROM", std::to_string(from)},
                             {"BLU_RS_TO", std::to_string(to)},
                             {"BLU_RS_LOAD", load},
                             {"BLU_RS_SAVE", save},
                             {"BLU_DIST_OUT", out}});
  const LaunchResult r = run_workers("reshard", ranks_of(layout), extra);
  if (expect_status == 0) {
    EXPECT_EQ(r.status, 0) << family << " " << layout << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err;
  } else {
    EXPECT_NE(r.status, 0) << family << " " << layout;
  }
  if (output) *output = r.out + r.err;
  return read_losses(out);
}

void expect_near(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t from,
                 int64_t to, const std::string& what) {
  double worst = 0;
  for (int64_t s = from; s < to; ++s) {
    ASSERT_TRUE(got.count(s) && want.count(s)) << what << ": no loss for step " << s;
    EXPECT_NEAR(got.at(s), want.at(s), kRel * std::abs(want.at(s))) << what << " step " << s;
    worst = std::max(worst, std::abs(got.at(s) - want.at(s)) / std::abs(want.at(s)));
  }
  std::printf("%s: losses within %.2e relative\n", what.c_str(), worst);
}

void expect_bitwise(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t from,
                    int64_t to, const std::string& what) {
  for (int64_t s = from; s < to; ++s) {
    ASSERT_TRUE(got.count(s) && want.count(s)) << what << ": no loss for step " << s;
    EXPECT_EQ(got.at(s), want.at(s)) << what << " step " << s;
  }
}

struct Pair {
  std::string family, writer, reader;
};

TEST(ReshardTest, EveryLayoutLoadsWhatAnotherWrote) {
  const std::vector<Pair> pairs = {{"gpt2", "tp", "pp"},      {"gpt2", "zero3", "tp"},      {"gpt2", "single", "zero1"},
                                   {"gpt2", "tpsp", "zero3"}, {"llama", "tp", "single"},    {"llama", "zero1", "single"},
                                   {"llama", "pp", "tpsp"},   {"llama", "zero3", "ddp"}};
  std::map<std::string, std::map<int64_t, double>> ref;
  for (const std::string family : {"gpt2", "llama"}) {
    TempDir tmp;
    ref[family] = run(tmp, family, "single", 0, 6, "", "");
    ASSERT_EQ(ref[family].size(), 6u);
    EXPECT_LT(ref[family].at(5), ref[family].at(0) - 1e-3) << family << ": the loss must move";
  }
  for (const Pair& p : pairs) {
    TempDir tmp;
    const std::string what = p.family + " " + p.writer + " -> " + p.reader, ck = tmp.str() + "/ckpt";
    const auto a = run(tmp, p.family, p.writer, 0, 3, "", ck);
    expect_near(a, ref[p.family], 0, 3, what + " (writer)");
    const auto b = run(tmp, p.family, p.reader, 3, 6, ck, "");
    expect_near(b, ref[p.family], 3, 6, what + " (reader)");
  }
}

TEST(ReshardTest, SameLayoutResumesBitwise) {
  for (const auto& [family, layout] : std::vector<std::pair<std::string, std::string>>{
           {"gpt2", "tp"}, {"llama", "pp"}, {"gpt2", "zero3"}, {"llama", "single"}}) {
    TempDir tmp;
    const std::string what = family + " " + layout, ck = tmp.str() + "/ckpt";
    const auto whole = run(tmp, family, layout, 0, 5, "", "");
    run(tmp, family, layout, 0, 2, "", ck);
    const auto resumed = run(tmp, family, layout, 2, 5, ck, "");
    expect_bitwise(resumed, whole, 2, 5, what);
  }
}

// kill -9 of rank 1 (of the one rank, alone) at a random step, in its forward or in the middle of
// a save; the job then resumes from its newest committed checkpoint and gives the uninterrupted
// losses bit for bit — under TP, TP+SP, a pipeline, ZeRO-1, ZeRO-3 and one process.
TEST(ReshardTest, KillNineThenResumeIsBitwise) {
  std::srand(unsigned(::getpid()));
  for (const auto& [family, layout] : std::vector<std::pair<std::string, std::string>>{
           {"gpt2", "tp"}, {"llama", "pp"}, {"llama", "tpsp"}, {"gpt2", "zero1"}, {"llama", "zero3"}, {"gpt2", "single"}}) {
    TempDir tmp;
    const std::string ck = tmp.str() + "/ckpt";
    const auto whole = run(tmp, family, layout, 0, 5, "", "");
    const int64_t kill_at = 1 + std::rand() % 3;  // a step in [1, 3]
    const int phase = std::rand() % 2;
    const std::string what = family + " " + layout + " killed at step " + std::to_string(kill_at) +
                             (phase ? " in the save" : " in the forward");
    run(tmp, family, layout, 0, 5, "", ck,
        {{"BLU_RS_KILL_AT", std::to_string(kill_at)}, {"BLU_RS_KILL_PHASE", std::to_string(phase)},
         {"BLU_RS_KILL_RANK", layout == "single" ? "0" : "1"}},
        /*status=*/1);
    // Committed: the steps before kill_at (a save after each step).
    const std::string latest = latest_any_checkpoint(ck);
    ASSERT_FALSE(latest.empty()) << what;
    const int64_t resume = LayoutCheckpoint(latest).train_state().step;
    EXPECT_EQ(resume, kill_at) << what;
    const auto resumed = run(tmp, family, layout, resume, 5, ck, ck);
    expect_bitwise(resumed, whole, resume, 5, what);
  }
}

// The newest checkpoint corrupted (a changed byte) or truncated: every layout falls back to the
// previous one, warns, and continues with the uninterrupted losses.
TEST(ReshardTest, CorruptNewestFallsBackUnderEachLayout) {
  TempDir ref_tmp;
  const auto ref = run(ref_tmp, "gpt2", "single", 0, 4, "", "");
  int i = 0;
  for (const std::string layout : {"single", "zero1", "zero3", "tp", "tpsp", "pp"}) {
    TempDir tmp;
    const std::string ck = tmp.str() + "/ckpt";
    run(tmp, "gpt2", layout, 0, 3, "", ck);  // keeps ckpt_2 and ckpt_3
    const fs::path bad = fs::path(ck) / "ckpt_00000003" / (layout == "single" ? "pieces_00000.safetensors"
                                                                              : "pieces_00001.safetensors");
    ASSERT_TRUE(fs::exists(bad)) << bad;
    if (i++ % 2 == 0) {
      std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-3, std::ios::end);
      f.put('\x5a');
    } else {
      fs::resize_file(bad, fs::file_size(bad) / 2);
    }
    std::string output;
    const auto got = run(tmp, "gpt2", layout, 2, 4, ck, "", {}, 0, &output);
    EXPECT_NE(output.find("skipping checkpoint"), std::string::npos) << layout << "\n" << output;
    expect_near(got, ref, 2, 4, layout + " after falling back");
  }
}

// The test above must be able to fail: a checkpoint whose moments are zeroed loads, and the next
// losses move by more than the tolerance.
TEST(ReshardTest, ZeroedMomentsAreSeen) {
  TempDir tmp;
  const std::string ck = tmp.str() + "/ckpt";
  const auto ref = run(tmp, "gpt2", "single", 0, 6, "", "");
  run(tmp, "gpt2", "tp", 0, 3, "", ck);
  const std::string latest = latest_any_checkpoint(ck);
  ASSERT_FALSE(latest.empty());
  // Rewrite the checkpoint with the moments zeroed (the parameters kept), as a single writer.
  const LayoutCheckpoint in(latest);
  std::vector<GlobalPiece> pieces;
  for (const std::string& n : in.tensors().names()) {
    Tensor t = in.tensors().full(n);
    if (n.starts_with("optim.exp_avg")) t = zeros(t.shape(), t.dtype());
    pieces.push_back(t.dim() == 0 ? GlobalPiece{n, {}, {}, 0, reshape(t, {1})}
                                  : GlobalPiece{n, t.shape(), std::vector<int64_t>(size_t(t.dim()), 0), -1, t});
  }
  const std::string ck2 = tmp.str() + "/zeroed";
  save_layout_checkpoint(ck2, CheckpointRanks{}, pieces, in.train_state(), in.layout(), 0);
  const auto got = run(tmp, "gpt2", "single", 3, 5, ck2, "");
  ASSERT_TRUE(got.count(3) && got.count(4));
  EXPECT_NEAR(got.at(3), ref.at(3), kRel * std::abs(ref.at(3)));  // the weights themselves are right
  EXPECT_GT(std::abs(got.at(4) - ref.at(4)), 10 * kRel * std::abs(ref.at(4)));
  std::printf("zeroed moments: step 4's loss off by %.2e relative\n", std::abs(got.at(4) - ref.at(4)) / std::abs(ref.at(4)));
}

// Checkpoints written by main before layout checkpoints (data/main_1c1bc3e: a 2-stage pipeline's
// and a single process's) load under every layout, every parameter bit for bit; the older
// ZeRO-sharded format (train/data/legacy_765617b) loads under ZeRO and is refused elsewhere with a
// message naming its format and version.
TEST(ReshardTest, MainCheckpointsLoadUnderEveryLayout) {
  const fs::path data = fs::path(BLU_TEST_DIR) / "dist/data/main_1c1bc3e";
  for (const std::string ckpt : {"pipeline/ckpt_00000002", "single/ckpt_00000002.safetensors"})
    for (const std::string layout : {"single", "zero1", "zero3", "tp", "pp"}) {
      const LaunchResult r = run_workers("reshard_fixture", ranks_of(layout),
                                         {{"BLU_RS_PATH", (data / ckpt).string()}, {"BLU_RS_LAYOUT", layout}});
      EXPECT_EQ(r.status, 0) << ckpt << " under " << layout << "\n" << r.out << r.err;
      EXPECT_NE(r.out.find("parameters equal the checkpoint's"), std::string::npos) << ckpt << " " << layout;
    }
  const fs::path zero = fs::path(BLU_TEST_DIR) / "train/data/legacy_765617b/zero/ckpt_00000002";
  for (const std::string layout : {"single", "tp"}) {  // its model has one block: no pipeline
    const LaunchResult r = run_workers("reshard_fixture", ranks_of(layout),
                                       {{"BLU_RS_PATH", zero.string()},
                                        {"BLU_RS_LAYOUT", layout},
                                        {"BLU_RS_EXPECT_ERROR", "ZeRO-sharded checkpoint (format 1)"}});
    EXPECT_EQ(r.status, 0) << layout << "\n" << r.out << r.err;
  }
}

// A layout checkpoint's COMMIT of another version is refused naming it; a pieces file that COMMIT
// does not list (a file of another save) is refused naming the file.
TEST(ReshardTest, CommitVersionAndStrayFilesAreRefused) {
  TempDir tmp;
  const std::string ck = tmp.str() + "/ckpt";
  TrainState st;
  st.step = 1;
  save_layout_checkpoint(ck, CheckpointRanks{}, {GlobalPiece{"model.w", {2, 3}, {0, 0}, -1, zeros({2, 3})}}, st,
                         {{"name", "single"}}, 0);
  const fs::path dir = fs::path(ck) / "ckpt_00000001";
  verify_layout_checkpoint(dir.string());
  EXPECT_EQ(latest_any_checkpoint(ck), dir.string());
  fs::copy_file(dir / "pieces_00000.safetensors", dir / "pieces_00001.safetensors");
  std::string err = blu::test::error_of([&] { verify_layout_checkpoint(dir.string()); });
  EXPECT_NE(err.find("pieces_00001.safetensors is not listed in its COMMIT"), std::string::npos) << err;
  fs::remove(dir / "pieces_00001.safetensors");
  nlohmann::json commit = io::read_json_file(dir / "COMMIT");
  commit["format_version"] = 4;
  io::write_json_file(dir / "COMMIT", commit);
  err = blu::test::error_of([&] { verify_layout_checkpoint(dir.string()); });
  EXPECT_NE(err.find("has format version 4; this build reads version 3"), std::string::npos) << err;
  EXPECT_EQ(latest_any_checkpoint(ck), "");
}

}  // namespace
}  // namespace blu::dist::test
