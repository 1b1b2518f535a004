// autograd: accumulation into leaves (and into a grad slot), retain_graph, no_grad, detach, hooks, fan-in (a leaf used
// twice, a diamond), and the engine's errors (non-scalar root, integer leaves, a backward formula
// that returns a gradient of the wrong shape).
#include <gtest/gtest.h>

#include "common/checks.h"
#include "blu/autograd/node.h"
#include "blu/backend/backend.h"
#include "blu/blu.h"
#include "blu/ops/dispatch.h"

namespace blu {
namespace {

using test::expect_error;

using Vec = std::vector<double>;

TEST(Autograd, AccumulatesAcrossBackwardCalls) {
  Tensor x = from_vector({1, 2, 3}, {3}).set_requires_grad();
  sum(mul(x, 2.0)).backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{2, 2, 2}));
  sum(mul(x, x)).backward();  // a new graph: adds 2x
  EXPECT_EQ(to_vector(x.grad()), (Vec{4, 6, 8}));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  sum(x).backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{1, 1, 1}));
}

TEST(Autograd, RetainGraph) {
  Tensor x = from_vector({1, 2}, {2}).set_requires_grad();
  Tensor y = sum(mul(x, x));
  y.backward();
  expect_error([&] { y.backward(); }, {"second time", "retain_graph"});

  Tensor z = sum(mul(x, x));
  x.zero_grad();
  z.backward(Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(to_vector(x.grad()), (Vec{2, 4}));
  z.backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{4, 8}));  // doubled
}

TEST(Autograd, NoGradAndDetach) {
  Tensor x = from_vector({1, 2}, {2}).set_requires_grad();
  {
    NoGradGuard ng;
    Tensor y = mul(x, 3.0);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
    EXPECT_FALSE(GradMode::enabled());
  }
  EXPECT_TRUE(GradMode::enabled());
  Tensor y = mul(x, 3.0);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_NE(y.grad_fn(), nullptr);
  EXPECT_FALSE(y.is_leaf());

  Tensor d = y.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_TRUE(d.is_leaf());
  EXPECT_EQ(d.storage(), y.storage());
  // Only the path through y reaches x: the detached branch contributes nothing.
  sum(add(mul(d, x), y)).backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{3 + 3, 6 + 3}));  // d + 3
  expect_error([&] { sum(d).backward(); }, {"does not require grad"});
}

TEST(Autograd, LeafHooksSeeTheAccumulatedGradOncePerBackward) {
  Tensor x = from_vector({1, 2}, {2}).set_requires_grad();
  std::vector<Vec> seen;
  x.register_grad_hook([&](Tensor& g) { seen.push_back(to_vector(g)); });
  sum(add(mul(x, 2.0), mul(x, 5.0))).backward();  // two paths, one accumulation
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (Vec{7, 7}));
  sum(x).backward();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], (Vec{8, 8}));  // accumulated, not just this call's gradient
  expect_error([&] { mul(x, 2.0).register_grad_hook([](Tensor&) {}); }, {"leaves"});
}

TEST(Autograd, LeafUsedTwiceGetsTheSum) {
  Tensor x = from_vector({-1, 0.5, 3}, {3}).set_requires_grad();
  sum(mul(x, x)).backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{-2, 1, 6}));
}

TEST(Autograd, Diamond) {
  // a = 2x; b = a * 3; c = a * a; y = sum(b + c) → dy/dx = 2 * (3 + 2a) = 6 + 8x
  Tensor x = from_vector({1, -2}, {2}).set_requires_grad();
  Tensor a = mul(x, 2.0);
  Tensor b = mul(a, 3.0);
  Tensor c = mul(a, a);
  sum(add(b, c)).backward();
  EXPECT_EQ(to_vector(x.grad()), (Vec{14, -10}));
}

TEST(Autograd, FirstGradientIsAdoptedWithoutCopy) {
  Tensor x = zeros({1000}).set_requires_grad();
  Tensor y = mul(x, 3.0);
  Tensor r = ones({1000});
  const int64_t before = cpu_allocator().stats().allocs;
  y.backward(r);
  // The backward of mul-by-scalar makes one tensor, which the leaf keeps as its grad.
  EXPECT_EQ(cpu_allocator().stats().allocs - before, 1);
  EXPECT_EQ(to_vector(x.grad())[0], 3);
  EXPECT_NE(x.grad().storage(), r.storage());
}

// A grad slot (DDP's bucket view) receives the first gradient by copy and becomes the grad; later
// backwards add into it in place; zero_grad() forgets the grad but keeps the slot, so the next
// gradient overwrites the stale values instead of adding to them.
TEST(Autograd, GradSlotReceivesTheGradientInPlace) {
  Tensor x = from_vector({1, 2, 3}, {3}).set_requires_grad();
  Tensor buffer = full({5}, 7.0);  // the slot is a view into a larger buffer
  const Tensor slot = narrow(buffer, 0, 1, 3);
  x.set_grad_slot(slot);
  EXPECT_EQ(x.grad_slot().raw_data(), slot.raw_data());
  sum(mul(x, 2.0)).backward();
  EXPECT_EQ(x.grad().raw_data(), slot.raw_data());
  EXPECT_EQ(to_vector(buffer), (Vec{7, 2, 2, 2, 7}));
  sum(mul(x, x)).backward();
  EXPECT_EQ(x.grad().raw_data(), slot.raw_data());
  EXPECT_EQ(to_vector(buffer), (Vec{7, 4, 6, 8, 7}));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  sum(x).backward();
  EXPECT_EQ(to_vector(buffer), (Vec{7, 1, 1, 1, 7}));
  // A grad set by hand is used (added into) instead of the slot.
  x.set_grad(zeros({3}));
  sum(x).backward();
  EXPECT_NE(x.grad().raw_data(), slot.raw_data());
  EXPECT_EQ(to_vector(x.grad()), (Vec{1, 1, 1}));
  EXPECT_EQ(to_vector(buffer), (Vec{7, 1, 1, 1, 7}));
  // Removing the slot restores the ordinary behaviour.
  x.set_grad_slot(Tensor());
  x.zero_grad();
  sum(x).backward();
  EXPECT_FALSE(x.grad_slot().defined());
  EXPECT_NE(x.grad().storage(), buffer.storage());
  expect_error([&] { x.set_grad_slot(zeros({4})); }, {"set_grad_slot", "must be contiguous and match"});
  expect_error([&] { x.set_grad_slot(transpose(zeros({3, 1}), 0, 1)); }, {"set_grad_slot"});
  expect_error([&] { mul(x, 2.0).set_grad_slot(zeros({3})); }, {"only leaves"});
}

// The engine offers an empty grad slot to the node making the leaf's first gradient: a cast (the
// master weight of 16-bit compute) writes straight into it, and later contributions are summed
// there in place. Same values as without a slot, one tensor fewer per backward.
TEST(Autograd, CastWritesTheFirstGradientIntoTheSlot) {
  auto run = [](bool with_slot, bool twice) {
    Tensor x = from_vector({1, 2, 3}, {3}).set_requires_grad();
    Tensor buffer = zeros({4});
    if (with_slot) x.set_grad_slot(narrow(buffer, 0, 1, 3));
    Tensor w = from_vector({0.5, 0.25, 2}, {3}, DType::f64);
    // x·x first (its backward runs last), then x as a master weight in f64 compute: the cast's
    // backward runs first and makes the first gradient.
    const Tensor square = twice ? to_dtype(sum(mul(x, x)), DType::f64) : Tensor();
    Tensor loss = sum(mul(to_dtype(x, DType::f64), w));
    if (twice) loss = add(loss, square);
    const int64_t before = cpu_allocator().stats().allocs;
    loss.backward();
    const int64_t allocs = cpu_allocator().stats().allocs - before;
    if (with_slot) {
      EXPECT_EQ(x.grad().raw_data(), narrow(buffer, 0, 1, 3).raw_data());
      EXPECT_EQ(to_vector(buffer)[0], 0.0);
    }
    return std::make_pair(to_vector(x.grad()), allocs);
  };
  const auto [plain, plain_allocs] = run(false, false);
  const auto [slotted, slot_allocs] = run(true, false);
  EXPECT_EQ(plain, (Vec{0.5, 0.25, 2}));
  EXPECT_EQ(slotted, plain);
  EXPECT_EQ(slot_allocs, plain_allocs - 1) << "the cast's gradient was not written into the slot";
  const auto [plain2, plain2_allocs] = run(false, true);
  const auto [slotted2, slot2_allocs] = run(true, true);
  EXPECT_EQ(plain2, (Vec{2.5, 4.25, 8}));
  EXPECT_EQ(slotted2, plain2);
  EXPECT_LT(slot2_allocs, plain2_allocs) << "the second contribution was not summed into the slot";
}

// Note [Sinks run first]: a leaf's accumulator (and its hooks) runs as soon as its gradient is
// complete, before the backward of earlier ops — also when the previous step's graph is still
// alive, so the accumulators are older than every node of this step.
TEST(Autograd, LeafAccumulatorsRunAsSoonAsTheirGradientIsReady) {
  const Tensor x = from_vector({1, 2, 3}, {3}, DType::f64);
  Tensor w1 = from_vector({4, 5, 6}, {3}, DType::f64), w2 = from_vector({7, 8, 9}, {3}, DType::f64);
  w1.set_requires_grad(true);
  w2.set_requires_grad(true);
  auto forward = [&] { return sum(mul(mul(x, w1), w2)); };
  const Tensor kept = forward();  // the previous step's loss, kept (and its graph with it)
  kept.backward();
  w1.zero_grad();
  w2.zero_grad();
  int64_t muls = 0, muls_at_hook = -1;
  const int h = add_op_observer([&](const OpDef& op, std::span<const Tensor>, std::span<const Tensor>, const Attrs&) {
    muls += std::string(op.name) == "mul";
  });
  w2.register_grad_hook([&](Tensor&) { muls_at_hook = muls; });
  const Tensor loss = forward();
  muls = 0;
  loss.backward();
  remove_op_observer(h);
  // w2's gradient is complete after the outer mul's backward; the inner mul's backward (w1's
  // gradient) must come after its hook.
  ASSERT_GE(muls_at_hook, 0);
  EXPECT_LT(muls_at_hook, muls);
  EXPECT_EQ(to_vector(w2.grad()), (std::vector<double>{4, 10, 18}));
  EXPECT_EQ(to_vector(w1.grad()), (std::vector<double>{7, 16, 27}));
}

// attach_grad_sink: the alias's gradient goes to the sink, not into the graph behind it; the
// rest of the graph is untouched.
TEST(Autograd, GradSinkTakesTheGradientOfItsAlias) {
  Tensor a = from_vector({1, 2, 3}, {3}, DType::f64), b = from_vector({4, 5, 6}, {3}, DType::f64);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  std::vector<std::vector<double>> seen;
  const Tensor x = mul(a, 2.0);
  const Tensor y = attach_grad_sink(x, [&](const Tensor& g) { seen.push_back(to_vector(g)); }, "test sink");
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(y.raw_data(), x.raw_data());
  sum(mul(add(y, b), 3.0)).backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<double>{3, 3, 3}));
  EXPECT_FALSE(a.grad().defined());  // nothing flowed behind the sink
  EXPECT_EQ(to_vector(b.grad()), (std::vector<double>{3, 3, 3}));
  blu::test::expect_error([] { attach_grad_sink(zeros({2}, DType::i64), [](const Tensor&) {}, "int sink"); },
                          {"int sink", "floating", "i64"});
}

TEST(Autograd, Errors) {
  Tensor x = from_vector({1, 2}, {2}).set_requires_grad();
  expect_error([&] { mul(x, 2.0).backward(); }, {"1-element", "[2]"});
  expect_error([&] { mul(x, 2.0).backward(ones({3})); }, {"gradient given", "[3]", "[2]"});
  expect_error([&] { from_vector({1}, {1}, DType::i64).set_requires_grad(); }, {"floating", "i64"});
  expect_error([&] { mul(x, 2.0).set_requires_grad(); }, {"leaf"});
  Tensor y = from_vector({1, 2}, {2});
  expect_error([&] { y.set_grad(zeros({3})); }, {"[3]", "[2]"});
}

// A deliberately broken op: identity forward, backward returns a gradient of the wrong shape.
std::vector<TensorMeta> same_meta(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}
std::vector<Tensor> wrong_shape_backward(const BackwardContext&, std::span<const Tensor> g) {
  return {zeros({g[0].numel() + 1}, g[0].dtype(), g[0].device())};
}
const OpDef kBrokenIdentity{.name = "test_broken_identity", .infer = same_meta, .backward = wrong_shape_backward};
void broken_identity_kernel(const KernelCall& c) { copy_(c.out[0], c.in[0]); }
BLU_REGISTER_KERNEL(cpu, "test_broken_identity", broken_identity_kernel);

TEST(Autograd, EngineRejectsWrongShapedGradient) {
  Tensor x = from_vector({1, 2, 3}, {3}).set_requires_grad();
  Tensor y = dispatch1(kBrokenIdentity, {x});
  EXPECT_EQ(to_vector(y), (Vec{1, 2, 3}));
  expect_error([&] { sum(y).backward(); }, {"test_broken_identity", "[4]", "[3]"});
  // Through another op as well: the message names the op that made the bad gradient.
  Tensor z = mul(dispatch1(kBrokenIdentity, {mul(x, 2.0)}), 1.0);
  expect_error([&] { sum(z).backward(); }, {"backward of 'test_broken_identity'", "into 'mul_scalar'"});
}

}  // namespace
}  // namespace blu
