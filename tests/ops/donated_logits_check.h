// Cross-entropy's backward over logits the caller no longer holds (Note [Donated buffers],
// ops/dispatch.h), on any device: a linear layer's logits, the loss, backward — once with the
// caller's handle on the logits kept (the backward allocates their gradient) and once dropped (it
// writes over them). Checks: the weight's gradient is the same bit for bit; kept logits are
// unchanged by backward; the dropped run's peak is lower by about the logits' bytes; with
// retain_graph the logits are not written over (a second backward adds the same gradient again).
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "blu/blu.h"
#include "blu/memory/allocator.h"
#include "blu/ops/linalg.h"
#include "blu/ops/nn.h"

namespace blu::test {

inline void check_donated_logits(Device dev, DType dt) {
  const int64_t N = 256, C = 16, V = 4096, K = V - 3;  // K classes of V columns, as GPT's padded head
  Generator gen(7);
  const Tensor x = to_device(to_dtype(randn({N, C}, DType::f32, kCPU, &gen), dt), dev);
  const Tensor t = to_device(randint(0, K, {N}, DType::i64, kCPU, &gen), dev);
  Tensor w = to_device(to_dtype(randn({V, C}, DType::f32, kCPU, &gen), dt), dev);
  w.set_requires_grad(true);
  Allocator& alloc = allocator_for(dev);
  const int64_t logits_bytes = N * V * int64_t(dtype_size(dt));
  struct Run {
    std::vector<double> grad;
    int64_t peak = 0;  // above the bytes live at the start
  };
  auto run = [&](bool keep, bool retain) {
    w.set_grad(Tensor());
    const int64_t base = alloc.stats().current_bytes;
    alloc.reset_peak();
    Tensor logits = linear(x, w);
    const std::vector<double> before = keep ? to_vector(to_device(logits, kCPU)) : std::vector<double>{};
    const Tensor loss = cross_entropy(logits, t, -1, Reduction::mean, K);
    if (!keep) logits = Tensor();
    loss.backward(Tensor(), retain);
    if (retain) loss.backward();
    if (keep) {
      EXPECT_EQ(to_vector(to_device(logits, kCPU)), before) << "kept logits changed by backward";
    }
    return Run{to_vector(to_device(w.grad(), kCPU)), alloc.stats().peak_bytes - base};
  };
  const Run kept = run(true, false), dropped = run(false, false), retained = run(false, true);
  EXPECT_EQ(kept.grad, dropped.grad) << "the gradient over donated logits differs";
  std::vector<double> twice = kept.grad;
  for (double& v : twice) v *= 2;
  EXPECT_EQ(retained.grad, twice) << "with retain_graph the second backward must see the logits";
  EXPECT_LE(dropped.peak + logits_bytes * 9 / 10, kept.peak)
      << "peak with the logits dropped " << dropped.peak << " B, kept " << kept.peak << " B, logits " << logits_bytes;
}

}  // namespace blu::test
