// Note [Folded gradient sums] (ops/dispatch.h): a tensor read by a norm and by something else (the
// residual stream of a pre-norm block) gets its two gradients summed by the norm's backward kernel
// instead of a separate add — bitwise what the add gives — and only when the other gradient is
// already waiting at a non-leaf producer in the norm input's dtype and layout.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "blu/blu.h"
#include "blu/ops/dispatch.h"

namespace blu {
namespace {

struct Seen {
  std::string op;
  size_t inputs;
};

// Runs f's backward with an observer: the ops it dispatches, and their defined inputs.
std::vector<Seen> backward_ops(const Tensor& loss) {
  std::vector<Seen> seen;
  const int obs = add_op_observer([&](const OpDef& op, std::span<const Tensor> in, auto, const Attrs&) {
    size_t n = 0;
    for (const Tensor& t : in) n += t.defined();
    seen.push_back({op.name, n});
  });
  loss.backward();
  remove_op_observer(obs);
  return seen;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

Tensor norm(bool rms, const Tensor& t, const Tensor& w, const Tensor& b) {
  return rms ? rms_norm(t, w, 1e-6) : layer_norm(t, w, b, 1e-5);
}

TEST(FoldedGrad, NormBackwardAddsTheResidualGradientBitwise) {
  for (const bool rms : {true, false})
    for (const DType dt : {DType::f32, DType::bf16, DType::f64}) {
      SCOPED_TRACE(std::string(rms ? "rms_norm " : "layer_norm ") + std::string(dtype_name(dt)));
      manual_seed(3);
      const Tensor x0 = to_dtype(randn({6, 40}), dt), g = to_dtype(randn({6, 40}), dt);
      const Tensor w = to_dtype(randn({40}), dt), b = to_dtype(randn({40}), dt);
      // t (not a leaf) is read by the norm and by the residual add: y = norm(t) + t.
      Tensor x = clone(x0).set_requires_grad(true);
      const Tensor t = mul(x, 2.0);
      const std::vector<Seen> seen = backward_ops(sum(mul(add(norm(rms, t, w, b), t), g)));
      // The same sum made by the engine's add: the norm reads a copy of t, so t's two gradients
      // come from the add's and the copy's backwards.
      Tensor xr = clone(x0).set_requires_grad(true);
      const Tensor tr = mul(xr, 2.0);
      sum(mul(add(norm(rms, clone(tr), w, b), tr), g)).backward();
      EXPECT_TRUE(same_bits(x.grad(), xr.grad()));
      const std::string bw = rms ? "rms_norm_backward" : "layer_norm_backward";
      int adds = 0, folded = 0;
      for (const Seen& s : seen) {
        adds += s.op == "add";
        folded += s.op == bw && s.inputs == (rms ? 5u : 6u);
      }
      EXPECT_EQ(folded, 1);
      EXPECT_EQ(adds, 0);  // the sum's add is the kernel's
    }
}

TEST(FoldedGrad, NotIntoALeafNorAcrossDtypes) {
  manual_seed(4);
  const Tensor w = randn({16}), g = randn({4, 16});
  // A leaf read twice: its accumulator sums (its first gradient may sit in a grad slot).
  Tensor x = randn({4, 16}).set_requires_grad(true);
  int folded = 0, adds = 0;
  for (const Seen& s : backward_ops(sum(mul(add(rms_norm(x, w, 1e-6), x), g)))) {
    folded += s.op == "rms_norm_backward" && s.inputs == 5;
    adds += s.op == "add";
  }
  EXPECT_EQ(folded, 0);
  EXPECT_EQ(adds, 1);
  // The other gradient in another dtype (t also read through a cast to f64): summed as before.
  Tensor y = randn({4, 16}).set_requires_grad(true);
  const Tensor t = mul(y, 2.0);
  const Tensor wide = sum(mul(to_dtype(t, DType::f64), to_dtype(g, DType::f64)));
  folded = 0;
  for (const Seen& s : backward_ops(add(to_dtype(sum(mul(rms_norm(t, w, 1e-6), g)), DType::f64), wide)))
    folded += s.op == "rms_norm_backward" && s.inputs == 5;
  EXPECT_EQ(folded, 0);
}

}  // namespace
}  // namespace blu
