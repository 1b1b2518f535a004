// ops/dispatch kernel lookup: an op's kernel is found by name in the backend's table once per op
// and device type and then read from the OpDef, so dispatching an op again does no by-name lookup
// (Backend::lookups counts them); an op without a kernel for the device still fails on every call
// with the message that names the op and the device.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/blu.h"
#include "blu/ops/dispatch.h"
#include "common/checks.h"

namespace blu {
namespace {

using test::expect_error;

std::vector<TensorMeta> same_meta(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}

std::atomic<int> g_kernel_runs{0};
// f32, contiguous; computes in place of calling other ops, whose own first dispatch would count.
void plus_one_kernel(const KernelCall& c) {
  ++g_kernel_runs;
  const float* x = c.in[0].data<float>();
  float* y = c.out[0].data<float>();
  for (int64_t i = 0; i < c.in[0].numel(); ++i) y[i] = x[i] + 1;
}
BLU_REGISTER_KERNEL(cpu, "test_cached_plus_one", plus_one_kernel);

uint64_t cpu_lookups() { return backend(DeviceType::cpu).lookups(); }

TEST(DispatchKernel, LooksTheNameUpOncePerOp) {
  const OpDef op{.name = "test_cached_plus_one", .infer = same_meta};
  const Tensor x = from_vector({1, 2, 3}, {3});
  const uint64_t before = cpu_lookups();
  const int runs = g_kernel_runs;
  std::vector<Tensor> ys;
  ys.push_back(dispatch1(op, {x}));
  EXPECT_EQ(cpu_lookups() - before, 1u) << "the first call looks the kernel up by name";
  ys.push_back(dispatch1(op, {x}));
  ys.push_back(dispatch1(op, {x}));
  EXPECT_EQ(cpu_lookups() - before, 1u) << "later calls read the kernel cached in the OpDef";
  EXPECT_EQ(g_kernel_runs - runs, 3) << "the cached kernel still runs on every call";
  for (const Tensor& y : ys) EXPECT_EQ(to_vector(y), (std::vector<double>{2, 3, 4}));

  // The cache belongs to the OpDef: another definition of the same name looks it up once itself.
  const OpDef twin{.name = "test_cached_plus_one", .infer = same_meta};
  const uint64_t before_twin = cpu_lookups();
  const Tensor y1 = dispatch1(twin, {x}), y2 = dispatch1(twin, {x});
  EXPECT_EQ(cpu_lookups() - before_twin, 1u);
  EXPECT_EQ(to_vector(y2), (std::vector<double>{2, 3, 4}));
}

TEST(DispatchKernel, ConcurrentFirstCallsAgree) {
  const OpDef op{.name = "test_cached_plus_one", .infer = same_meta};
  constexpr int kThreads = 8, kCalls = 50;
  std::vector<Tensor> xs;
  for (int t = 0; t < kThreads; ++t) xs.push_back(from_vector({double(t)}, {1}));
  std::vector<std::vector<Tensor>> ys(kThreads);
  const uint64_t before = cpu_lookups();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) ys[t].push_back(dispatch1(op, {xs[t]}));
    });
  for (auto& th : threads) th.join();
  // Threads racing the first call may each look the name up; none looks it up twice.
  const uint64_t lookups = cpu_lookups() - before;
  EXPECT_GE(lookups, 1u);
  EXPECT_LE(lookups, uint64_t(kThreads));
  for (int t = 0; t < kThreads; ++t)
    for (const Tensor& y : ys[t]) ASSERT_EQ(to_vector(y), (std::vector<double>{double(t) + 1}));
}

TEST(DispatchKernel, MissingKernelFailsOnEveryCall) {
  const OpDef op{.name = "test_op_without_kernel", .infer = same_meta};
  const Tensor x = from_vector({1, 2}, {2});
  const uint64_t before = cpu_lookups();
  for (int i = 0; i < 2; ++i)
    expect_error([&] { dispatch1(op, {x}); }, {"test_op_without_kernel: no kernel for device cpu"});
  // Nothing was cached for it: each call looked for a kernel again.
  EXPECT_EQ(cpu_lookups() - before, 2u);
  EXPECT_EQ(op.kernel_cache[size_t(DeviceType::cpu)].load(), nullptr);
}

}  // namespace
}  // namespace blu
