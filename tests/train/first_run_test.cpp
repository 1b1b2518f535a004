// The README's first run, piece by piece, through the built `blutrain` ($BLU_BLUTRAIN_BIN, else
// ../blutrain next to this test binary's folder): byte-level shards whose folder records the
// tokenizer, train and sample picking it up without flags, the n-gram baselines in the output and
// the metrics, --keep-best, and scripts/check_first_run.py (the demo's own check) on made-up runs.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "blu/data/shard.h"
#include "blu/models/registry.h"
#include "blu/train/metrics.h"
#include "data/data_test_util.h"

namespace blu {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

fs::path blutrain_path() {
  if (const char* env = std::getenv("BLU_BLUTRAIN_BIN"); env && *env) return env;
  return fs::canonical("/proc/self/exe").parent_path().parent_path() / "blutrain";
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr together
};

// Runs `program args...` with GPT-2's vocabulary out of reach: a byte-level run must not need it.
Result run_program(const std::string& program, const std::vector<std::string>& args) {
  std::string cmd = "BLU_GPT2_VOCAB_DIR=/nonexistent/gpt2-vocab " + quote(program);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " 2>&1";
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

Result blutrain(const std::vector<std::string>& args) { return run_program(blutrain_path().string(), args); }

std::vector<nlohmann::json> events(const fs::path& metrics, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == kind) out.push_back(j);
  }
  return out;
}

// A small fortune file: entries between lines of '%'.
void write_corpus(const fs::path& dir) {
  fs::create_directories(dir / "fortunes");
  std::string text;
  for (int i = 0; i < 40; ++i)
    text += "The cat sat on the mat, number " + std::to_string(i) + ".\n\t-- A. Cat\n%\nA dog is not a cat.\n%\n";
  test::write_bytes(dir / "fortunes" / "cats", text);
}

class FirstRun : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(blutrain_path())) GTEST_SKIP() << "blutrain not built at " << blutrain_path();
  }
};

TEST_F(FirstRun, ByteShardsTrainAndSampleWithoutTokenizerFlags) {
  TempDir dir;
  write_corpus(dir.path());
  const fs::path data = dir / "data";
  const Result prep = blutrain({"prepare", "--input", (dir / "fortunes").string(), "--out", data.string(), "--name",
                                "cats", "--val-fraction", "0.2", "--tokenizer", "byte"});
  ASSERT_EQ(prep.status, 0) << prep.output;
  EXPECT_NE(prep.output.find("tokenizer: byte (257 ids)"), std::string::npos) << prep.output;
  EXPECT_EQ(nlohmann::json::parse(test::read_bytes(data / "shards.json"))["tokenizer"], "byte");

  const fs::path run = dir / "run";
  const Result tr = blutrain({"train", "--data-dir", data.string(), "--model", "gpt2:demo-byte", "--n-layer", "1",
                              "--n-embd", "32", "--n-head", "2", "-B", "2", "-T", "16", "--steps", "4", "--val-every",
                              "2", "--val-batches", "2", "--sample-every", "4", "--sample-tokens", "8", "--keep-best",
                              "--out", run.string()});
  ASSERT_EQ(tr.status, 0) << tr.output;
  EXPECT_NE(tr.output.find("baseline: val loss of n-gram counts: unigram "), std::string::npos) << tr.output;
  EXPECT_NE(tr.output.find("| bigram "), std::string::npos) << tr.output;
  EXPECT_NE(tr.output.find("--- sample at step 4 ---"), std::string::npos) << tr.output;
  // The run records the tokenizer it read the shards with.
  const nlohmann::json run_json = nlohmann::json::parse(test::read_bytes(run / "run.json"));
  EXPECT_EQ(run_json["options"]["tokenizer"], "byte");
  // The metrics: one baseline event, and the baselines beside each validation loss.
  const auto base = events(run / "metrics.jsonl", "baseline");
  ASSERT_EQ(base.size(), 1u);
  EXPECT_EQ(base[0]["smoothing"], "add-one");
  EXPECT_EQ(base[0]["vocab"], 257);
  const auto evals = events(run / "metrics.jsonl", "eval");
  ASSERT_EQ(evals.size(), 2u);
  for (const auto& e : evals) {
    EXPECT_DOUBLE_EQ(e["bigram_loss"].get<double>(), base[0]["bigram_loss"].get<double>());
    EXPECT_DOUBLE_EQ(e["unigram_loss"].get<double>(), base[0]["unigram_loss"].get<double>());
  }
  // --keep-best: the copy of the checkpoint at the lowest validation loss.
  ASSERT_TRUE(fs::exists(run / "best.safetensors"));
  const auto best = events(run / "metrics.jsonl", "best");
  ASSERT_FALSE(best.empty());
  double lowest = 1e30;
  for (const auto& e : evals) lowest = std::min(lowest, e["val_loss"].get<double>());
  EXPECT_DOUBLE_EQ(best.back()["val_loss"].get<double>(), lowest);

  // sample decodes with the recorded tokenizer: GPT-2's is out of reach (and has 50257 ids, more
  // than this model's 257), so only the byte tokenizer can give text here.
  for (const fs::path& ckpt : {run, run / "best.safetensors"}) {
    const Result s = blutrain({"sample", "--ckpt", ckpt.string(), "--prompt", "The cat", "-n", "12", "--seed", "3"});
    ASSERT_EQ(s.status, 0) << s.output;
    EXPECT_EQ(s.output.rfind("The cat", 0), 0u) << s.output;
  }
  // Overwrite removes the best checkpoint with the rest of the run.
  const Result again = blutrain({"train", "--data-dir", data.string(), "--model", "gpt2:demo-byte", "--n-layer", "1",
                                 "--n-embd", "32", "--n-head", "2", "-B", "2", "-T", "16", "--steps", "3", "--out",
                                 run.string(), "--overwrite", "--peak-tflops", "0.001"});
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_FALSE(fs::exists(run / "best.safetensors"));
  // --peak-tflops: each step records its MFU, the model's FLOPs per token times tok/s over the peak.
  EXPECT_NE(again.output.find(" | mfu "), std::string::npos) << again.output;
  const auto model = models::build_model(
      nlohmann::json::parse(test::read_bytes(run / "run.json"))["model_config"]);
  const double flops_tok = model->flops_per_token(16);
  const auto steps = events(run / "metrics.jsonl", "step");
  ASSERT_EQ(steps.size(), 3u);
  for (const auto& e : steps) {
    ASSERT_TRUE(e.contains("mfu")) << e.dump();
    EXPECT_NEAR(e["mfu"].get<double>(), e["tok_per_s"].get<double>() * flops_tok / 1e9, 1e-9 * e["mfu"].get<double>());
  }
}

// A shard folder from before the record: GPT-2 tokens, and nothing loads GPT-2's files unless
// samples need them.
TEST_F(FirstRun, FolderWithoutRecordMeansGpt2) {
  TempDir dir;
  std::vector<uint16_t> t(4096);
  for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t((i * 131) % 50000);
  write_shard(dir / "d_train_000000.bin", t);
  const Result tr = blutrain({"train", "--train-pattern", (dir / "d_train_*.bin").string(), "--model", "tiny", "-T",
                              "16", "-B", "2", "--steps", "1", "--out", (dir / "run").string()});
  ASSERT_EQ(tr.status, 0) << tr.output;
  EXPECT_EQ(nlohmann::json::parse(test::read_bytes(dir / "run" / "run.json"))["options"]["tokenizer"], "gpt2");
}

TEST_F(FirstRun, GptSizedModelOnByteShardsGetsANote) {
  TempDir dir;
  write_corpus(dir.path());
  const fs::path data = dir / "data";
  ASSERT_EQ(blutrain({"prepare", "--input", (dir / "fortunes").string(), "--out", data.string(), "--val-fraction",
                      "0.2", "--tokenizer", "byte"})
                .status,
            0);
  // A model with GPT-2's 50257 rows holds byte ids; the run says that a byte-sized one is faster.
  const Result r = blutrain({"train", "--data-dir", data.string(), "--model", "tiny", "-T", "16", "-B", "2",
                             "--steps", "1"});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("a model sized to it trains faster"), std::string::npos) << r.output;
}

TEST_F(FirstRun, PrepareRefusesTwoTokenizersInOneFolder) {
  TempDir dir;
  write_corpus(dir.path());
  const fs::path data = dir / "data";
  ASSERT_EQ(blutrain({"prepare", "--input", (dir / "fortunes").string(), "--out", data.string(), "--name", "a",
                      "--val-fraction", "0.2", "--tokenizer", "byte"})
                .status,
            0);
  const Result r = blutrain({"prepare", "--input", (dir / "fortunes").string(), "--out", data.string(), "--name",
                             "b", "--val-fraction", "0.2", "--tokenizer", "gpt2"});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("would mix two tokenizers"), std::string::npos) << r.output;
  EXPECT_EQ(nlohmann::json::parse(test::read_bytes(data / "shards.json"))["tokenizer"], "byte");
}

// A byte-level model's sample need not be UTF-8: the metrics line still gets written, with the
// invalid bytes replaced, and parses.
TEST(FirstRunMetrics, SampleThatIsNotUtf8IsWritten) {
  TempDir dir;
  {
    train::MetricsLog log((dir / "metrics.jsonl").string());
    log.write({{"event", "sample"}, {"step", 1}, {"text", std::string("ok \xff\xc3 end")}});
  }
  const auto s = events(dir / "metrics.jsonl", "sample");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]["text"], "ok \xef\xbf\xbd\xef\xbf\xbd end");
}

// scripts/check_first_run.py passes a run that learned and speaks the corpus' words, and fails
// one that did not.
class CheckScript : public ::testing::Test {
 protected:
  Result check(const std::string& sample, double val_loss) {
    test::write_bytes(dir_ / "corpus.txt", "The cat sat on the mat.\n%\nA dog isn't a cat, said the man.\n");
    fs::create_directories(dir_ / "run");
    const nlohmann::json eval = {{"event", "eval"}, {"step", 10}, {"val_loss", val_loss}, {"bigram_loss", 2.5},
                                 {"unigram_loss", 3.2}};
    const nlohmann::json smp = {{"event", "sample"}, {"step", 10}, {"text", sample}};
    test::write_bytes(dir_ / "run" / "metrics.jsonl", eval.dump() + "\n" + smp.dump() + "\n");
    return run_program("/usr/bin/python3", {BLU_SOURCE_DIR "/scripts/check_first_run.py", (dir_ / "run").string(),
                                            "--corpus", (dir_ / "corpus.txt").string(), "--min-word-count", "8"});
  }
  TempDir dir_;
};

TEST_F(CheckScript, PassesLearnedEnglish) {
  const Result r = check("The man sat on the mat.\nA cat isn't a dog, said the cat.\n", 2.0);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("0.5000 below the bigram"), std::string::npos) << r.output;
}

// The documents' separator is no word (counted as one, these nine words would be 75% known).
TEST_F(CheckScript, SeparatorIsNoWord) {
  const Result r = check("The cat sat.<|endoftext|>The mat.<|endoftext|>A dog.<|endoftext|>The man.", 2.0);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("9 of 9 words"), std::string::npos) << r.output;
}

TEST_F(CheckScript, FailsTokenSalad) {
  const Result r = check("Thr mna sta no teh tam.\nA cta isnt a dgo, sadi the cat, the the.\n", 2.0);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("FAIL"), std::string::npos) << r.output;
}

TEST_F(CheckScript, FailsTooLittleLearning) {
  const Result r = check("The man sat on the mat.\nA cat isn't a dog, said the cat.\n", 2.2);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("(needs >= 0.4) FAIL"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace blu
