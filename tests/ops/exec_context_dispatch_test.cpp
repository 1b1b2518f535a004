// ops/dispatch and the execution context: a kernel receives, in KernelCall::ctx, the context
// current for its device (the guard's inside an ExecContextGuard, the thread's default outside),
// and the context's workspace is reset before each call, so consecutive calls reuse the same
// scratch bytes (Note [Execution context]).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "blu/backend/backend.h"
#include "blu/blu.h"
#include "blu/core/exec_context.h"
#include "blu/ops/dispatch.h"

namespace blu {
namespace {

std::vector<TensorMeta> same_meta(std::span<const Tensor> in, const Attrs&) {
  return {TensorMeta{in[0].shape(), in[0].dtype(), in[0].device()}};
}

struct Seen {
  Device device;
  void* stream = nullptr;
  Workspace* scratch = nullptr;
  size_t used_on_entry = 0;
  void* slice = nullptr;
};
thread_local std::vector<Seen> t_seen;

// Copies its input, records the context it got and takes a 100-byte scratch slice.
void record_context_kernel(const KernelCall& c) {
  Seen s{c.ctx.device, c.ctx.stream, c.ctx.scratch, c.ctx.scratch->used(), nullptr};
  s.slice = c.ctx.scratch->take(100);
  t_seen.push_back(s);
  const float* x = c.in[0].data<float>();
  float* y = c.out[0].data<float>();
  for (int64_t i = 0; i < c.in[0].numel(); ++i) y[i] = x[i];
}
BLU_REGISTER_KERNEL(cpu, "test_record_context", record_context_kernel);

const OpDef kRecord{.name = "test_record_context", .infer = same_meta};

TEST(ExecContextDispatch, KernelGetsTheGuardsContext) {
  t_seen.clear();
  const Tensor x = from_vector({1, 2}, {2});
  Workspace ws(kCPU);
  int stream_token = 0;
  {
    ExecContextGuard g(ExecContext{kCPU, &stream_token, &ws});
    (void)dispatch1(kRecord, {x});
    (void)dispatch1(kRecord, {x});
  }
  (void)dispatch1(kRecord, {x});
  ASSERT_EQ(t_seen.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(t_seen[i].device, kCPU);
    EXPECT_EQ(t_seen[i].stream, &stream_token) << "call " << i;
    EXPECT_EQ(t_seen[i].scratch, &ws) << "call " << i;
    EXPECT_EQ(t_seen[i].used_on_entry, 0u) << "the workspace is reset before each call";
  }
  EXPECT_EQ(t_seen[0].slice, t_seen[1].slice) << "consecutive calls reuse the same scratch bytes";
  EXPECT_EQ(ws.high_water(), Workspace::kAlignment);
  // Outside the guard: the thread's default context.
  EXPECT_EQ(t_seen[2].stream, nullptr);
  EXPECT_EQ(t_seen[2].scratch, current_context(kCPU).scratch);
  EXPECT_NE(t_seen[2].scratch, &ws);
}

TEST(ExecContextDispatch, EachThreadDispatchesInItsOwnContext) {
  const Tensor x = from_vector({3}, {1});
  Workspace ws_a(kCPU), ws_b(kCPU);
  std::vector<Seen> a, b;
  auto run = [&](Workspace* ws, std::vector<Seen>* out) {
    ExecContextGuard g(ExecContext{kCPU, nullptr, ws});
    for (int i = 0; i < 20; ++i) (void)dispatch1(kRecord, {x});
    *out = t_seen;
  };
  std::thread ta(run, &ws_a, &a), tb(run, &ws_b, &b);
  ta.join();
  tb.join();
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (const Seen& s : a) EXPECT_EQ(s.scratch, &ws_a);
  for (const Seen& s : b) EXPECT_EQ(s.scratch, &ws_b);
}

}  // namespace
}  // namespace blu
