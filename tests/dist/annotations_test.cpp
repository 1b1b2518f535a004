// The annotation language (dist/annotations.h): the text and C++ forms give the same tree, trees
// resolve into layouts (mesh sizes, stage ranges, schedules, uneven shares), to_text round-trips,
// and every invalid annotation is refused with a message naming the primitive and the rule.
#include <gtest/gtest.h>

#include "blu/core/error.h"
#include "blu/dist/annotations.h"
#include "common/checks.h"

namespace blu::dist {
namespace {

using blu::test::error_of;

std::vector<std::string> gpt_blocks(int n) {
  std::vector<std::string> b;
  for (int i = 0; i < n; ++i) b.push_back("h." + std::to_string(i));
  return b;
}

Layout layout(const std::string& text, int blocks = 12, int world = 0) {
  return resolve_layout(parse_annotation(text), gpt_blocks(blocks), world);
}

void expect_refused(const std::string& text, const std::vector<std::string>& parts, int blocks = 12, int world = 0) {
  const std::string e = error_of([&] { layout(text, blocks, world); });
  ASSERT_NE(e, "(no error)") << text << ": expected an error";
  for (const auto& p : parts) EXPECT_NE(e.find(p), std::string::npos) << text << "\n  got: " << e;
}

TEST(Annotations, HybridLayoutFromText) {
  const Layout l = layout(
      "replicate(2) { pipeline(2, schedule=1f1b, micro=8) { stage(h.0-h.5) { split(2) } stage(h.6-h.11) { split(2) } } }",
      12, 8);
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.world_size(), 8);
  EXPECT_EQ(l.schedule, Schedule::one_f_one_b);
  EXPECT_EQ(l.micro_batches, 8);
  const std::vector<std::pair<int64_t, int64_t>> stages = {{0, 5}, {6, 11}};
  EXPECT_EQ(l.stage_blocks, stages);
  EXPECT_EQ(l.replica_weights, std::vector<double>({0.5, 0.5}));
  EXPECT_EQ(l.describe(), "dp=2 × pp=2 (1f1b, 8 micro-batches) × tp=2");
}

TEST(Annotations, CppFormEqualsText) {
  const Annotation cpp = replicate(2, pipeline(2, {{"schedule", "1f1b"}, {"micro", "8"}},
                                               {stage("h.0-h.5", split(2)), stage("h.6-h.11", split(2))}));
  const std::string text = to_text(cpp);
  EXPECT_EQ(text, "replicate(2) { pipeline(2, micro=8, schedule=1f1b) { stage(h.0-h.5) { split(2) } "
                  "stage(h.6-h.11) { split(2) } } }");
  EXPECT_EQ(to_text(parse_annotation(text)), text);
  const Layout a = resolve_layout(cpp, gpt_blocks(12), 8), b = layout(text, 12, 8);
  EXPECT_EQ(a.describe(), b.describe());
  EXPECT_EQ(a.stage_blocks, b.stage_blocks);
}

TEST(Annotations, ShortFormsAndUnevenShares) {
  // Short ranges, one-block stages, uneven stages, Llama's block names.
  std::vector<std::string> llama;
  for (int i = 0; i < 4; ++i) llama.push_back("model.layers." + std::to_string(i));
  const Layout l = resolve_layout(
      parse_annotation("pipeline(3, micro=3){stage(model.layers.0-1) stage(model.layers.2) stage(model.layers.3)}"),
      llama, 3);
  const std::vector<std::pair<int64_t, int64_t>> stages = {{0, 1}, {2, 2}, {3, 3}};
  EXPECT_EQ(l.stage_blocks, stages);
  EXPECT_EQ(l.dp, 1);
  // An even pipeline needs no stage list; interleaved defaults to 2 chunks.
  const Layout even = layout("pipeline(2, schedule=interleaved, micro=4)", 8);
  const std::vector<std::pair<int64_t, int64_t>> quarters = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  EXPECT_EQ(even.stage_blocks, quarters);
  EXPECT_EQ(even.chunks, 2);
  // Hardware-aware shares are normalised.
  const Layout w = layout("replicate(2, weights=[3, 1], zero=2) { split(2, sp=true, widths=[1,1]) }", 12, 4);
  EXPECT_EQ(w.replica_weights, std::vector<double>({0.75, 0.25}));
  EXPECT_EQ(w.zero, 2);
  EXPECT_TRUE(w.sequence_parallel);
  EXPECT_EQ(w.tp, 2);
  EXPECT_TRUE(layout("pipeline(2, balance=time, micro=2)", 7).balance_by_time);
  const Layout rows = layout("split(2, row_chunks=4)", 12, 2);
  EXPECT_EQ(rows.tp_row_chunks, 4);
  EXPECT_NE(rows.describe().find("(row chunks 4)"), std::string::npos) << rows.describe();
  EXPECT_EQ(layout("split(2)", 12, 2).tp_row_chunks, 1);
}

TEST(Annotations, SyntaxErrorsNameTheColumn) {
  expect_refused("", {"empty"});
  expect_refused("replicate(2", {"column 12", "expected ')'"});
  expect_refused("replicate(x)", {"column 11", "degree must be a positive integer", "'x'"});
  expect_refused("shard(2)", {"unknown primitive 'shard'"});
  expect_refused("replicate(2) { split(2) ", {"never closed"});
  expect_refused("replicate(2) split(2)", {"column 14", "after the annotation's end"});
  expect_refused("split(2, sp=true, sp=false)", {"'sp' twice"});
}

TEST(Annotations, InvalidLayoutsAreRefused) {
  expect_refused("replicate(2, zero=4)", {"zero must be 0, 1, 2 or 3"});
  expect_refused("replicate(2, batch=3)", {"unknown argument 'batch'", "weights, zero"});
  expect_refused("replicate(2, weights=[1,2,3])", {"weights has 3 entries, expected 2"});
  expect_refused("replicate(2, weights=[1,-2])", {"positive numbers"});
  expect_refused("replicate(2) { split(2) split(2) }", {"at most one"});
  expect_refused("stage(h.0-h.3)", {"cannot stand outside a pipeline"});
  expect_refused("split(2) { split(2) }", {"split encloses nothing"});
  expect_refused("split(2, row_chunks=0)", {"row_chunks must be a positive integer", "'0'"});
  expect_refused("pipeline(2, schedule=zigzag)", {"unknown schedule 'zigzag'", "gpipe, 1f1b or interleaved"});
  expect_refused("pipeline(4, micro=2)", {"2 micro-batches for 4 stages"});
  expect_refused("pipeline(2, schedule=interleaved, micro=3)", {"multiples of the stage count"});
  expect_refused("pipeline(2, chunks=2)", {"chunks=2 needs schedule=interleaved"});
  expect_refused("pipeline(3)", {"8 blocks do not split evenly into 3 stages", "balance=time"}, 8);
  expect_refused("pipeline(13)", {"13 stages", "12 blocks", "would have none"});
  expect_refused("pipeline(2) { stage(h.0-h.5) }", {"1 stages given, expected 2"});
  expect_refused("pipeline(2) { stage(h.0-h.4) stage(h.6-h.11) }", {"stage(h.6-h.11)", "starts at block h.6",
                                                                    "ended at h.4"});
  expect_refused("pipeline(2) { stage(h.0-h.5) stage(h.6-h.10) }", {"end at h.10", "run to h.11"});
  expect_refused("pipeline(2) { stage(h.0-h.5) stage(h.6-h.12) }", {"no block 'h.12'", "h.0 … h.11 (12)"});
  expect_refused("pipeline(2) { stage(h.5-h.0) stage(h.6-h.11) }", {"runs backwards"});
  expect_refused("pipeline(2) { stage(h.0-h.5) { split(2) } stage(h.6-h.11) }", {"split(1) differs", "split(2)"});
  expect_refused("pipeline(2) { stage(h.0-h.5) { pipeline(2) } stage(h.6-h.11) }", {"holds only a split"});
  expect_refused("pipeline(2) { split(2) split(2) }", {"holds only stage"});
  expect_refused("pipeline(2, balance=time) { stage(h.0-h.5) stage(h.6-h.11) }", {"balance=time picks the stages"});
  expect_refused("replicate(2) { split(2) }", {"dp=2 × tp=2 needs 4 ranks, the job has 8"}, 12, 8);
}

}  // namespace
}  // namespace blu::dist
