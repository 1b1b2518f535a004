// ops/view copy_many_ on the CPU: every destination gets its source's bytes (contiguous pairs in
// the op, a strided pair through copy_), each destination's storage counts the write (Note
// [Storage versions]: compute copies of parameters written this way are re-cast), sources are
// untouched, and bad pairs are refused with a message naming the pair. The CUDA kernel is checked
// against these results in tests/cuda/optim_multi_cuda_test.cpp (CudaCopyMany).
#include <gtest/gtest.h>

#include "blu/blu.h"
#include "common/checks.h"

namespace blu {
namespace {

using test::bitwise_equal;
using test::expect_error;

TEST(CopyMany, CopiesEveryPairAndBumpsTheDestinations) {
  Generator gen(7);
  const Tensor flat_src = randn({1000}, DType::f32, kCPU, &gen);
  const Tensor flat_dst = zeros({1000}, DType::f32);
  const Tensor h_src = randn({5, 3}, DType::bf16, kCPU, &gen), h_dst = zeros({5, 3}, DType::bf16);
  const Tensor t_src = randn({4, 6}, DType::f32, kCPU, &gen), t_dst = zeros({6, 4}, DType::f32);
  const Tensor empty_t = zeros({0}, DType::f32);
  const Tensor before = clone(flat_src);
  const uint64_t v0 = flat_dst.storage()->version(), vh = h_dst.storage()->version();
  {
    NoGradGuard no_grad;
    copy_many_({narrow(flat_dst, 0, 3, 500), narrow(flat_dst, 0, 600, 7), h_dst, transpose(t_dst, 0, 1), empty_t},
               {narrow(flat_src, 0, 401, 500), narrow(flat_src, 0, 0, 7), h_src, t_src, empty_t});
  }
  EXPECT_TRUE(bitwise_equal(narrow(flat_dst, 0, 3, 500), narrow(flat_src, 0, 401, 500)));
  EXPECT_TRUE(bitwise_equal(narrow(flat_dst, 0, 600, 7), narrow(flat_src, 0, 0, 7)));
  EXPECT_EQ(to_vector(narrow(flat_dst, 0, 0, 3)), (std::vector<double>{0, 0, 0}));   // untouched around them
  EXPECT_EQ(to_vector(narrow(flat_dst, 0, 503, 97)), std::vector<double>(97, 0.0));
  EXPECT_TRUE(bitwise_equal(h_dst, h_src));
  EXPECT_TRUE(bitwise_equal(contiguous(transpose(t_dst, 0, 1)), t_src));  // the strided pair
  EXPECT_TRUE(bitwise_equal(flat_src, before));
  EXPECT_GT(flat_dst.storage()->version(), v0);
  EXPECT_GT(h_dst.storage()->version(), vh);
}

TEST(CopyMany, RefusesBadPairs) {
  NoGradGuard no_grad;
  const Tensor a = zeros({4}, DType::f32), b = zeros({4}, DType::bf16), c = zeros({5}, DType::f32);
  expect_error([&] { copy_many_({a, a}, {a}); }, {"copy_many_", "2 destinations but 1 sources"});
  expect_error([&] { copy_many_({a, a}, {a, b}); }, {"pair 1", "one dtype and numel"});
  expect_error([&] { copy_many_({a}, {c}); }, {"pair 0", "one dtype and numel"});
  expect_error([&] { copy_many_({a}, {Tensor()}); }, {"pair 0", "undefined"});
}

TEST(CopyMany, RefusesTensorsThatRequireGradWhileRecording) {
  Tensor p = zeros({3}, DType::f32);
  p.set_requires_grad(true);
  expect_error([&] { copy_many_({p}, {ones({3})}); }, {"pair 0", "requires grad", "NoGradGuard"});
  NoGradGuard no_grad;
  copy_many_({p}, {ones({3})});
  EXPECT_EQ(to_vector(p), (std::vector<double>{1, 1, 1}));
}

}  // namespace
}  // namespace blu
