// The execution context on the GPU (Note [Execution context], core/exec_context.h): kernels queue
// their work on the context's stream and take their scratch from its workspace, so a whole
// training step can be captured into a CUDA graph on a stream of the caller's choosing.
// - A GPT-2 forward + backward + AdamW step (bf16 compute) on a non-default stream set through the
//   context, captured in cudaStreamCaptureModeGlobal with the workspace pre-sized and frozen (the
//   allocator warmed by eager steps first), replays to the same losses and parameters, bit for bit,
//   as the same step run eagerly. A kernel on another stream would be missing from the graph (the
//   replay would differ); scratch allocated inside the capture would fail the frozen workspace; a
//   touch of the legacy default stream would invalidate the capture (the stream is a blocking one).
// - That last detector works: a capture on such a stream is invalidated by a launch on the legacy
//   default stream, and not by ops dispatched under the context.
// - The fused attention backward's dQ accumulator and row sums come from the context's workspace:
//   captured and replayed it matches eager (o, lse, dK, dV bitwise; dQ, summed by atomics, within
//   bf16 rounding), and a frozen workspace smaller than that scratch is refused, naming the bytes.
// - cuda::StreamGuard sets the same context's stream (one current stream, not two).
// Run: ctest -L cuda, or build-cuda/tests/test_cuda --gtest_filter='ExecContextCuda*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "blu/backend/cuda/flash_attention.h"
#include "blu/backend/cuda/runtime.h"
#include "blu/blu.h"
#include "blu/core/exec_context.h"
#include "blu/models/gpt2/gpt2.h"
#include "blu/optim/optimizer.h"
#include "common/checks.h"
#include "common/tiny_gpt.h"
#include "cuda/cuda_test_util.h"

namespace blu {
namespace {

using test::bitwise_equal;
using test::kGPU;

// A stream that synchronises with the legacy default stream (cudaStreamCreate's default flags):
// under a global-mode capture on it, any work queued on the legacy stream is an error.
class BlockingStream {
 public:
  BlockingStream() { BLU_CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~BlockingStream() { cudaStreamDestroy(s_); }
  BlockingStream(const BlockingStream&) = delete;
  BlockingStream& operator=(const BlockingStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Graph {
 public:
  ~Graph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  void begin(cudaStream_t s) { BLU_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal)); }
  cudaError_t end(cudaStream_t s) {
    const cudaError_t e = cudaStreamEndCapture(s, &graph_);
    if (e == cudaSuccess) BLU_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
    return e;
  }
  void replay(cudaStream_t s) { BLU_CUDA_CHECK(cudaGraphLaunch(exec_, s)); }
  size_t nodes() const {
    size_t n = 0;
    BLU_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
    return n;
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

Tensor host(const Tensor& t, cudaStream_t s) {
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  return to_device(t.detach(), kCPU);
}

TEST(ExecContextCuda, StreamGuardSetsTheContextsStream) {
  SKIP_WITHOUT_CUDA();
  cuda::Stream side;
  const cudaStream_t before = cuda::current_stream();
  EXPECT_EQ(before, cuda::default_stream(0));
  {
    cuda::StreamGuard g(side.get());
    EXPECT_EQ(current_context(kGPU).stream, static_cast<void*>(side.get()));
    EXPECT_EQ(cuda::current_stream(), side.get());
  }
  EXPECT_EQ(current_context(kGPU).stream, nullptr);
  EXPECT_EQ(cuda::current_stream(), before);
}

struct Gpt2Run {
  std::unique_ptr<models::GPT> model;
  std::unique_ptr<optim::Optimizer> opt;
  Tensor idx, targets;
};

// One training step: the loss (before the update) and the updated parameters stay on the device.
Tensor train_step(Gpt2Run& r) {
  r.opt->zero_grad();
  const Tensor loss = r.model->forward(r.idx, r.targets).loss;
  loss.backward();
  r.opt->step();
  return loss.detach();
}

TEST(ExecContextCuda, Gpt2StepCapturedOnAContextStreamReplaysBitForBit) {
  SKIP_WITHOUT_CUDA();
  BlockingStream stream;
  const cudaStream_t s = stream.get();
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, s, &ws});

  // Everything — parameters, inputs, optimizer state — is made on the context's stream.
  models::GPTConfig cfg = test::tiny_gpt();
  Gpt2Run r;
  r.model = std::make_unique<models::GPT>(cfg, 7);
  r.model->to(kGPU);
  r.model->set_compute_dtype(DType::bf16);
  r.opt = optim::make_adamw(optim::decay_groups(r.model->named_parameters(), 0.1), optim::AdamWOptions{.lr = 1e-3});
  const int64_t B = 4, T = cfg.block_size;
  r.idx = to_device(randint(0, cfg.vocab_size, {B, T}, DType::i64), kGPU);
  r.targets = to_device(randint(0, cfg.vocab_size, {B, T}, DType::i64), kGPU);

  // Warm the allocator and the workspace with eager steps.
  for (int i = 0; i < 2; ++i) (void)train_step(r);
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  // The state before the step under test, to start both runs of it from.
  std::vector<Tensor> params0;
  for (auto& [name, p] : r.model->named_parameters()) params0.push_back(clone(p.detach()));
  nn::NamedTensors opt0;
  for (auto& [name, t] : r.opt->state()) opt0.emplace_back(name, t.device().is_cpu() ? t : clone(t));
  auto restore = [&] {
    NoGradGuard ng;
    size_t i = 0;
    for (auto& [name, p] : r.model->named_parameters()) copy_(p, params0[i++]);
    r.opt->load_state(opt0);
  };

  // Eager: two steps from that state (restored as the captured run restores it, so both refresh
  // the 16-bit compute copies alike).
  restore();
  std::vector<Tensor> eager_losses;
  for (int i = 0; i < 2; ++i) eager_losses.push_back(host(train_step(r), s));
  std::vector<Tensor> eager_params;
  for (auto& [name, p] : r.model->named_parameters()) eager_params.push_back(host(p, s));

  // Captured: the same two steps (the step count is a host value, so one graph per step), from
  // the same state, with the workspace frozen at what the eager steps needed.
  restore();
  (void)train_step(r);  // a third warm step after the restore: the allocator has seen this state
  restore();
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  ws.reserve(ws.high_water());
  ws.freeze();
  Graph g1, g2;
  g1.begin(s);
  const Tensor loss1 = train_step(r);
  ASSERT_EQ(g1.end(s), cudaSuccess) << "the capture was invalidated: something touched another stream";
  g2.begin(s);
  const Tensor loss2 = train_step(r);
  ASSERT_EQ(g2.end(s), cudaSuccess) << "the capture was invalidated: something touched another stream";
  ws.unfreeze();
  EXPECT_GT(g1.nodes(), 50u);
  // Nothing ran yet (a capture only records): replay from the restored state.
  g1.replay(s);
  g2.replay(s);
  EXPECT_TRUE(bitwise_equal(host(loss1, s), eager_losses[0])) << "loss of step 1";
  EXPECT_TRUE(bitwise_equal(host(loss2, s), eager_losses[1])) << "loss of step 2";
  size_t i = 0;
  for (auto& [name, p] : r.model->named_parameters())
    EXPECT_TRUE(bitwise_equal(host(p, s), eager_params[i++])) << name << " after the replayed steps";
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
}

TEST(ExecContextCuda, CaptureDetectsTheLegacyDefaultStream) {
  SKIP_WITHOUT_CUDA();
  BlockingStream stream;
  const cudaStream_t s = stream.get();
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, s, &ws});
  const Tensor t = zeros({1024}, DType::f32, kGPU);
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  {  // The detector: a launch on the legacy default stream during the capture breaks it.
    Graph g;
    g.begin(s);
    const cudaError_t launch = cudaMemsetAsync(t.raw_data(), 0, t.nbytes(), cudaStreamLegacy);
    const cudaError_t end = g.end(s);
    EXPECT_TRUE(launch != cudaSuccess || end != cudaSuccess)
        << "work on the legacy stream went unnoticed by a global capture on a blocking stream";
    (void)cudaGetLastError();
  }
  {  // Ops dispatched under the context go to its stream: the capture holds.
    Graph g;
    g.begin(s);
    fill_(t, 2.0);
    (void)add(t, t);
    ASSERT_EQ(g.end(s), cudaSuccess);
    EXPECT_GE(g.nodes(), 2u);
  }
}

// bf16 fused attention at D = 64: the backward's scratch (dQ accumulator, row sums) is what the
// workspace holds.
TEST(ExecContextCuda, FlashAttentionScratchComesFromTheWorkspace) {
  SKIP_WITHOUT_CUDA();
  BlockingStream stream;
  const cudaStream_t s = stream.get();
  Workspace ws(kGPU);
  ExecContextGuard ctx(ExecContext{kGPU, s, &ws});
  // T = 1024: the dQ accumulator alone is 2 MiB, more than the smallest workspace (the 2 MiB it
  // rounds to), for the frozen-workspace check at the end.
  const int64_t B = 2, H = 4, T = 1024, D = 64;
  auto make = [&](uint64_t seed) {
    Generator gen(seed);
    Tensor t = to_device(to_dtype(randn({B, H, T, D}, DType::f32, kCPU, &gen), DType::bf16), kGPU);
    t.set_requires_grad(true);
    return t;
  };
  const Tensor q = make(1), k = make(2), v = make(3);
  Generator gd(4);
  const Tensor dout = to_device(to_dtype(randn({B, H, T, D}, DType::f32, kCPU, &gd), DType::bf16), kGPU);
  auto run = [&] {
    for (Tensor x : {q, k, v}) x.zero_grad();
    const Tensor o = scaled_dot_product_attention(q, k, v, true);
    o.backward(dout);
    return std::vector<Tensor>{o.detach(), q.grad(), k.grad(), v.grad()};
  };
  const std::vector<Tensor> eager = run();
  std::vector<Tensor> want;
  for (const Tensor& t : eager) want.push_back(host(t, s));
  (void)run();  // the allocator has seen a second step
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
  if (cuda::flash_attention_needs_dq_accum(DType::bf16)) {
    const size_t accum = size_t(cuda::flash_dq_accum_floats(B, H, T, D)) * sizeof(float);
    EXPECT_GE(ws.high_water(), accum + size_t(B * H * T) * sizeof(float))
        << "the backward's dQ accumulator and row sums are slices of the workspace";
  }

  ws.reserve(ws.high_water());
  ws.freeze();
  Graph g;
  g.begin(s);
  const std::vector<Tensor> got = run();
  ASSERT_EQ(g.end(s), cudaSuccess);
  ws.unfreeze();
  g.replay(s);
  EXPECT_TRUE(bitwise_equal(host(got[0], s), want[0])) << "o";
  EXPECT_TRUE(bitwise_equal(host(got[2], s), want[2])) << "dk";
  EXPECT_TRUE(bitwise_equal(host(got[3], s), want[3])) << "dv";
  // dQ is summed by atomics (flash_attention_backward.cu): equal up to the order of fp32 sums.
  const std::vector<double> dq = to_vector(host(got[1], s)), dq_want = to_vector(want[1]);
  ASSERT_EQ(dq.size(), dq_want.size());
  double worst = 0;
  for (size_t i = 0; i < dq.size(); ++i)
    worst = std::max(worst, std::abs(dq[i] - dq_want[i]) / (std::abs(dq_want[i]) + 1e-2));
  EXPECT_LE(worst, 1e-2) << "dq";

  // A frozen workspace smaller than the backward's scratch is refused with the bytes named.
  Workspace small(kGPU, 1);
  small.freeze();
  ExecContextGuard tight(ExecContext{kGPU, s, &small});
  const Tensor o = scaled_dot_product_attention(q, k, v, true);
  test::expect_error([&] { o.backward(dout); }, {"frozen", "holds " + std::to_string(small.capacity())});
  BLU_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace
}  // namespace blu
