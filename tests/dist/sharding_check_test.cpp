// The ops' sharding rules (Note [Sharding rules], ops/sharding.h) through the check mode of
// dist/sharding_check.h, on one process: placements set by hand, ops run, the derived placements
// and the refusals compared with what tensor parallelism needs. The multi-process side (a whole
// tensor-parallel GPT-2 and Llama step runs under the check with no refusal) is in tp_test.cpp.
#include <gtest/gtest.h>

#include "blu/blu.h"
#include "blu/dist/sharding_check.h"
#include "common/checks.h"

namespace blu::dist {
namespace {

using blu::test::expect_error;

Tensor leaf(const Shape& s) { return zeros(s); }

TEST(ShardingRules, ColumnThenRowGivesAPartialSum) {
  ShardingCheck check;
  const Tensor x = leaf({2, 5, 8}), w1 = leaf({6, 8}), b1 = leaf({6}), w2 = leaf({8, 6}), b2 = leaf({8});
  check.set(x, Placement::replicate());
  check.set(w1, Placement::shard(-2));  // column: output features split
  check.set(b1, Placement::shard(-1));
  check.set(w2, Placement::shard(-1));  // row: input features split
  check.set(b2, Placement::replicate());
  const Tensor h = gelu(linear(x, w1, b1), true);
  EXPECT_EQ(check.get(h), Placement::shard(-1));
  const Tensor y = linear(h, w2);
  EXPECT_EQ(check.get(y), Placement::partial());
  // Reduced (set by hand here; g does it in a run), then the replicated bias.
  Tensor r = clone(y);
  check.set(r, Placement::replicate());
  EXPECT_EQ(check.get(add(r, b2)), Placement::replicate());
  EXPECT_TRUE(check.refusals().empty());
  EXPECT_GE(check.ops_checked(), 4);
}

TEST(ShardingRules, RefusesWhatNeedsACollectiveFirst) {
  const Tensor x = leaf({2, 5, 8}), w = leaf({8, 6}), b = leaf({8}), ln_w = leaf({8}) , h = leaf({2, 5, 6});
  {
    ShardingCheck check;
    check.set(h, Placement::shard(-1));
    check.set(w, Placement::shard(-1));
    check.set(b, Placement::replicate());
    // A row-parallel GEMM with its bias inside: the bias would be summed once per rank.
    expect_error([&] { linear(h, w, b); }, {"op 'linear'", "shard(-1)", "replicate", "a collective is missing"});
  }
  {
    ShardingCheck check;
    check.set(x, Placement::partial());
    check.set(ln_w, Placement::replicate());
    // A norm of a partial sum (the all-reduce forgotten).
    expect_error([&] { layer_norm(x, ln_w, Tensor()); }, {"op 'layer_norm'", "partial"});
  }
  {
    ShardingCheck check(false);  // record, do not throw
    check.set(x, Placement::partial());
    check.set(b, Placement::replicate());
    add(x, b);                    // a replicated addend to a partial sum: counted once per rank
    gelu(x, true);                // nonlinear in a partial sum
    rms_norm(x, ln_w, 1e-5);      // ln_w unknown: not checked
    check.set(x, Placement::shard(-1));
    check.set(ln_w, Placement::replicate());
    rms_norm(x, ln_w, 1e-5);      // statistics over a split feature dim
    EXPECT_EQ(check.refusals().size(), 3u);
  }
}

TEST(ShardingRules, SequenceShardsPassRowwiseOps) {
  ShardingCheck check;
  const Tensor x = leaf({2, 4, 8}), ln_w = leaf({8}), ln_b = leaf({8}), w = leaf({8, 8}), bias = leaf({8});
  check.set(x, Placement::shard(-2));  // sequence parallelism: [B, T/tp, C]
  for (const Tensor& t : {ln_w, ln_b, w, bias}) check.set(t, Placement::replicate());
  const Tensor n = layer_norm(x, ln_w, ln_b);
  EXPECT_EQ(check.get(n), Placement::shard(-2));
  EXPECT_EQ(check.get(add(n, bias)), Placement::shard(-2));  // the bias broadcasts along the sequence
  EXPECT_EQ(check.get(reshape(n, {8, 8})), Placement::shard(-2));  // rows stay split
  EXPECT_EQ(check.get(transpose(n, 1, 2)), Placement::shard(-1));   // the shard follows its dim
  EXPECT_EQ(check.get(narrow(n, 1, 0, 2)), std::nullopt);           // cut along the shard: untracked
  // Vocabulary-parallel embedding: this rank's rows for the ids it owns are a partial sum.
  const Tensor table = leaf({16, 8}), ids = zeros({2, 4}, DType::i64);
  check.set(table, Placement::shard(-2));
  EXPECT_EQ(check.get(embedding(table, ids)), Placement::partial());
  EXPECT_TRUE(check.refusals().empty());
}

}  // namespace
}  // namespace blu::dist
